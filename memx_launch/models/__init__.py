"""Models memx trains and calibrates: its own LLaMA, and the user's modules through adapters (torch)."""

from memx_launch.models.adapters import ModelParts, StageModule, find_blocks
from memx_launch.models.llama import LlamaStage, TransformerBlock, apply_tensor_parallel

__all__ = ["LlamaStage", "ModelParts", "StageModule", "TransformerBlock", "apply_tensor_parallel", "find_blocks"]
