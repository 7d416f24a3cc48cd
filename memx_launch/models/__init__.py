"""Models memx trains and calibrates: its own LLaMA (torch)."""

from memx_launch.models.llama import LlamaStage, TransformerBlock, apply_tensor_parallel

__all__ = ["LlamaStage", "TransformerBlock", "apply_tensor_parallel"]
