"""How the user's own block projects its input, read from its modules: the attention's queries,
keys and values as one linear (GPT-2's c_attn, GPT-NeoX's, Falcon's and Bloom's query_key_value,
MPT's Wqkv, Phi-3's qkv_proj) or three, and a gated MLP's gate and up as one (Phi-3's
gate_up_proj) or two. Under autocast each linear casts its input to 16 bits and keeps the copy,
so memx counts one cast of the normed input per linear that reads it
(planning/activations.py's ``autocast_extra_casts``): a setup that assumes Hugging Face Llama's
three linears counts two casts too many a block of GPT-2's.

A linear is an ``nn.Linear`` or Transformers' ``Conv1D`` (GPT-2's), read by its output width:
fused queries, keys and values are one linear as wide as the three together, a fused gate and up
twice the MLP's width. Where those widths could also be another linear's, nothing is read.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

PROJECTION_FIELDS = ("fused_qkv", "fused_gate_up")


def linear_widths(block: nn.Module) -> list[int]:
    """Output widths of the block's linear modules (``nn.Linear``, Transformers' ``Conv1D``)."""
    widths = []
    for module in block.modules():
        if isinstance(module, nn.Linear):
            widths.append(module.out_features)
        elif type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int):
            widths.append(module.nf)
    return widths


def block_projections(block: nn.Module, model: ModelSpec) -> dict[str, bool]:
    """{"fused_qkv": ..., "fused_gate_up": ...} as ``block`` (one block of ``model``, whole: TP 1)
    runs them; {} where it has no linear module to read (its weights used as bare parameters)."""
    widths = linear_widths(block)
    if not widths:
        return {}
    qkv = model.q_hidden_size + 2 * model.kv_hidden_size
    ffn = model.ffn_hidden_size
    gated_dense = model.gated_mlp and not model.num_experts and model.has_mlp
    mlp_widths = {ffn, 2 * ffn} if gated_dense else {ffn}
    found = {}
    if model.has_attention and not model.kv_lora_rank and qkv not in mlp_widths:
        found["fused_qkv"] = qkv in widths
    if gated_dense and 2 * ffn != qkv:
        found["fused_gate_up"] = 2 * ffn in widths
    return found


def own_block_training(training: TrainingSpec, block: nn.Module, model: ModelSpec) -> tuple[TrainingSpec, dict]:
    """``training`` with its projections as ``block`` runs them, and the options that changed (what
    calibration's records of the block say they ran with: profiling/kernel.py's ``run_options``)."""
    changed = {k: v for k, v in block_projections(block, model).items() if getattr(training, k) != v}
    return replace(training, **changed), changed
