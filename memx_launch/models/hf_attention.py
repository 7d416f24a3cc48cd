"""The attention functions memx registers with Transformers for a Hugging Face model's blocks, each
recomputing the attention core in the backward on blocks of "selective" stages: SDPA (``memx_sdpa``)
for the Llama family and the mixtures, or the model's own implementation where SDPA cannot run it
(Gemma 2's soft-capped attention: ``memx_own_<implementation>``). And the gated MLP product that the
selective level recomputes too."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

HF_ATTENTION = "memx_sdpa"
OWN_ATTENTION_PREFIX = "memx_own_"


def use_memx_sdpa(config) -> None:
    """The model's attention through SDPA (``memx_sdpa``), whatever it was loaded with: the fused
    kernel memx's plans price."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def memx_sdpa(module, *args, **kwargs):
        if getattr(module, "_memx_selective", False) and torch.is_grad_enabled():
            return checkpoint(sdpa_attention_forward, module, *args, use_reentrant=False, **kwargs)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(HF_ATTENTION, memx_sdpa)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)  # the model's own forward still runs
    config._attn_implementation = HF_ATTENTION


def recompute_own_attention(config, blocks: list[nn.Module]) -> None:
    """The model's own attention (its ``_attn_implementation``: Transformers' eager by default, the
    function of the model's own module) under a memx name whose function recomputes it in the
    backward on blocks of "selective" stages, as memx_sdpa does SDPA, masked as that implementation is."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = config._attn_implementation
    if own.startswith(OWN_ATTENTION_PREFIX):  # the same model cut again
        return
    for block in blocks:
        attention = block.self_attn
        attention._memx_attention = ALL_ATTENTION_FUNCTIONS[own] if own != "eager" else \
            sys.modules[type(attention).__module__].eager_attention_forward
    AttentionInterface.register(OWN_ATTENTION_PREFIX + own, _own_attention)
    AttentionMaskInterface.register(OWN_ATTENTION_PREFIX + own, ALL_MASK_ATTENTION_FUNCTIONS[own])
    config._attn_implementation = OWN_ATTENTION_PREFIX + own


def _own_attention(module, *args, **kwargs):
    if getattr(module, "_memx_selective", False) and torch.is_grad_enabled():
        return checkpoint(module._memx_attention, module, *args, use_reentrant=False, **kwargs)
    return module._memx_attention(module, *args, **kwargs)


def hf_selective(block: nn.Module, on: bool) -> None:
    """The attention core (through memx's attention function) and a dense MLP's gated product
    recomputed in backward (a mixture's experts keep theirs)."""
    block.self_attn._memx_selective = on
    mlp = block.mlp
    if not hasattr(mlp, "gate_proj"):
        return
    if on:
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(
            checkpoint(_gated, mlp.act_fn, mlp.gate_proj(x), mlp.up_proj(x), use_reentrant=False))
    else:
        mlp.__dict__.pop("forward", None)


def _gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up
