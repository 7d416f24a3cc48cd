"""How the user's own block runs, read off its modules where memx's options describe it: the
attention's queries, keys and values as one linear (GPT-2's c_attn, GPT-NeoX's, Falcon's and
Bloom's query_key_value, MPT's Wqkv, Phi-3's qkv_proj) or three, a gated MLP's gate and up as one
(Phi-3's gate_up_proj) or two, RMSNorms of torch ops (Hugging Face's LlamaRMSNorm and its
family's) or not, and dropout on its residual branches or on its attention's probabilities
(:func:`dropouts`).

Under autocast each linear casts its input to 16 bits and keeps the copy, so memx counts one cast
of the normed input per linear that reads it (planning/activations.py's ``autocast_extra_casts``):
a setup that assumes Hugging Face Llama's three linears counts two casts too many a block of
GPT-2's, and one that assumes Megatron's fused linears two too few of Llama's. An RMSNorm of torch
ops keeps fp32 copies of its input where a fused kernel keeps the input alone (``fused_norm``).

A linear is an ``nn.Linear`` or Transformers' ``Conv1D`` (GPT-2's), read by its output width:
fused queries, keys and values are one linear as wide as the three together, a fused gate and up
twice the MLP's width; where those widths could also be another linear's, nothing is read. An
RMSNorm is read as torch ops when its class is one of its own (its name ends in RMSNorm), not
torch's ``nn.RMSNorm``, whose kernel depends on the device: that one is left to the setup.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from memx_launch.models.adapters import block_kind
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

READ_FIELDS = ("fused_qkv", "fused_gate_up", "fused_norm", "dropout", "attention_dropout", "selective_recompute")
"""The TrainingSpec fields :func:`read_block` may set."""


def linear_widths(block: nn.Module) -> list[int]:
    """Output widths of the block's linear modules (``nn.Linear``, Transformers' ``Conv1D``)."""
    widths = []
    for module in block.modules():
        if isinstance(module, nn.Linear):
            widths.append(module.out_features)
        elif type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int):
            widths.append(module.nf)
    return widths


def torch_op_rms_norms(block: nn.Module) -> bool:
    """Whether the block normalises with an RMSNorm class of its own (torch ops), not torch's."""
    return any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, nn.RMSNorm) for m in block.modules())


# Dropout on the attention's probabilities, by its attribute's name: an ``nn.Dropout`` (GPT-2's attn_dropout,
# BLOOM's attention_dropout) or the probability the attention passes its kernel (StarCoder's attn_dropout, the
# Llama family's attention_dropout). Any other ``nn.Dropout`` of a block is on a residual branch (GPT-2's and
# StarCoder's resid_dropout and MLP dropout, Phi's resid_dropout), as are the probabilities a block passes
# F.dropout there (Seed-OSS's residual_dropout, BLOOM's hidden_dropout).
ATTENTION_DROPOUT_NAMES = ("attn_dropout", "attention_dropout")
RESIDUAL_DROPOUT_NAMES = ("residual_dropout", "hidden_dropout")


def dropouts(block: nn.Module) -> tuple[bool, bool]:
    """(on a residual branch, on the attention's probabilities): whether ``block``, training, drops out there."""
    residual = attention = False
    if not block.training:
        return residual, attention
    for name, module in block.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            if name.rsplit(".", 1)[-1] in ATTENTION_DROPOUT_NAMES:
                attention = True
            else:
                residual = True
        for key in RESIDUAL_DROPOUT_NAMES + ATTENTION_DROPOUT_NAMES:
            value = getattr(module, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                residual = residual or key in RESIDUAL_DROPOUT_NAMES
                attention = attention or key in ATTENTION_DROPOUT_NAMES
    return residual, attention


def read_block(block: nn.Module, model: ModelSpec) -> dict[str, bool]:
    """The :data:`READ_FIELDS` ``block`` (one block of ``model``, whole: TP 1) settles: its
    projections where it has linear modules to read, ``fused_norm`` off where its RMSNorms are
    torch ops and on where norms read as RMSNorms are torch's LayerNorm kernel; nothing else."""
    found = {}
    widths = linear_widths(block)
    qkv = model.q_hidden_size + 2 * model.kv_hidden_size
    ffn = model.ffn_hidden_size
    gated_dense = model.gated_mlp and not model.num_experts and model.has_mlp
    mlp_widths = {ffn, 2 * ffn} if gated_dense else {ffn}
    if model.num_experts:  # the experts', a shared expert's, the router's and that expert's gate's
        for width in (model.moe_ffn_hidden_size, model.shared_expert_ffn_hidden_size):
            mlp_widths |= {width, 2 * width}
        mlp_widths |= {model.num_experts, 1}
    if widths and model.has_attention and not model.kv_lora_rank and qkv not in mlp_widths:
        found["fused_qkv"] = qkv in widths
    if widths and gated_dense and 2 * ffn != qkv:
        found["fused_gate_up"] = 2 * ffn in widths
    shared = model.shared_expert_ffn_hidden_size if model.num_experts and model.gated_mlp and model.has_mlp else 0
    # (Transformers' routed experts are 3-D parameters, not linears: their widths are not read)
    if widths and shared and 2 * shared not in (qkv, model.num_experts, model.q_hidden_size, model.kv_hidden_size):
        found["fused_gate_up"] = 2 * shared in widths  # a shared expert's gate and up as one linear (GraniteMoeShared)
    if torch_op_rms_norms(block):
        found["fused_norm"] = False
    elif not model.layer_norm and any(isinstance(m, nn.LayerNorm) for m in block.modules()):
        found["fused_norm"] = True  # weight-only norms read as RMSNorm's that run torch's LayerNorm kernel (MPT's)
    residual, attention = dropouts(block)
    if residual:
        found["dropout"] = True  # 1-byte masks on CUDA (CPU's dropout keeps its mask in the input's dtype)
    if attention:
        found["attention_dropout"] = True  # kept only where the attention is unfused (BLOOM's)
    return found


def own_block_training(training: TrainingSpec, block: nn.Module, model: ModelSpec) -> tuple[TrainingSpec, dict]:
    """``training`` as ``block`` runs (:func:`read_block`; and ``selective_recompute="block"`` where
    memx-run cannot reach its attention core, so that its selective level checkpoints the whole
    block: models/adapters.py; torchtitan's op-level policy reads the block's ops and runs on any),
    and the options that changed (what calibration's records of the block say they ran with:
    profiling/kernel.py's ``run_options``)."""
    read = read_block(block, model)
    if not block_kind(block).knows_attention and training.selective_recompute != "op":
        read["selective_recompute"] = "block"
    changed = {k: v for k, v in read.items() if getattr(training, k) != v}
    return replace(training, **changed), changed
