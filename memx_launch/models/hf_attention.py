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


def use_memx_sdpa(config, blocks: list[nn.Module]) -> None:
    """The model's attention through SDPA (``memx_sdpa``), whatever it was loaded with: the fused
    kernel memx's plans price."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    _register(config, blocks, HF_ATTENTION, sdpa_attention_forward, sdpa_mask)


def recompute_own_attention(config, blocks: list[nn.Module]) -> None:
    """The model's own attention (its ``_attn_implementation``: Transformers' eager by default, the
    function of the model's own module), masked as that implementation is."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = config._attn_implementation
    if own.startswith(OWN_ATTENTION_PREFIX):  # the same model cut again
        return
    attention = ALL_ATTENTION_FUNCTIONS[own] if own != "eager" else \
        sys.modules[type(blocks[0].self_attn).__module__].eager_attention_forward
    _register(config, blocks, OWN_ATTENTION_PREFIX + own, attention, ALL_MASK_ATTENTION_FUNCTIONS[own])


def _register(config, blocks: list[nn.Module], name: str, attention, mask) -> None:
    """``attention`` run by the blocks under ``name`` (the model's forward asks its config's name,
    its masks built by ``mask``), recomputed in the backward on blocks of "selective" stages."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for block in blocks:
        block.self_attn._memx_attention = attention
    AttentionInterface.register(name, _recomputed_attention)
    AttentionMaskInterface.register(name, mask)
    config._attn_implementation = name


def _recomputed_attention(module, *args, **kwargs):
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
