"""Multi-head latent attention (DeepSeek-V2 and V3, GLM-4.7-Flash): what its down projections keep
beside the heads' queries, keys and values, and what Transformers' implementation keeps beyond
them. In :func:`~memx_launch.planning.activations.activation_bytes`' units: bytes per token and
hidden element at 2 bytes an element (``dtype_bytes / 2`` scales them to the training dtype)."""

from __future__ import annotations

import numpy as np

from memx_launch.specs.model import ModelSpec


def latent_units(model: ModelSpec, fused_norm: bool, dtype_bytes: int) -> float:
    """The query and key-value latents (whole on every TP rank), each its norm's input and the normed
    tensor its up projection reads, and the shared rotary key: 2(2 q_lora + 2 kv_lora + rope)/h.
    Norms of torch ops (Hugging Face's RMSNorm, not ``fused_norm``) keep each latent's fp32 copy and
    the normalised tensor cast back to the training dtype, and the up projection its input (under
    autocast its 16-bit cast): ((4 + d)2/d + 2) a latent element; the rotary key then only in fp32,
    where the key-value latent's fp32 copy is a view of the down projection's output, which holds it."""
    h = model.hidden_size
    if fused_norm:
        return 2.0 * (2.0 * model.q_lora_rank + 2.0 * model.kv_lora_rank + model.rope_head_dim) / h
    normalised = 4.0 if model.norm_weight_in_fp32 else dtype_bytes
    per_latent = 2.0 * (4.0 + normalised) / dtype_bytes + 2.0
    rope = model.rope_head_dim if dtype_bytes == 4 else 0.0
    return (per_latent * (model.q_lora_rank + model.kv_lora_rank) + 2.0 * rope) / h


def transformers_value_view_units(model: ModelSpec, tp, flash) -> np.ndarray:
    """Transformers splits each head's key part and value off the key-value up projection's output as
    views (``modeling_deepseek_v3.py``'s ``expand_kv``): a fused kernel saves that value view, which keeps
    the whole output alive, the heads' unrotated key parts beside their values: 2 a nope/h over t."""
    return np.where(flash, 2.0 * model.num_heads * model.head_dim / model.hidden_size / tp, 0.0)


def transformers_output_copy_units(model: ModelSpec, tp, flash) -> np.ndarray:
    """Transformers hands the kernel a query made by ``torch.cat``, laid out by head: a kernel for
    queries as wide as the values (flash's: GLM-4.7-Flash's 192 + 64 = 256) writes its output so too,
    copied for the output projection (the copy ``rotary_concatenates`` counts): 2 a v/h over t.
    Narrower values (DeepSeek-V3's 128) take the memory-efficient kernel, whose output is laid out by
    token: none."""
    if model.num_heads * model.qk_head_dim != model.value_hidden_size:
        return np.zeros_like(flash, dtype=float)
    return np.where(flash, 2.0 * model.value_hidden_size / model.hidden_size / tp, 0.0)
