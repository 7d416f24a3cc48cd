"""Hugging Face configs of the hybrid families memx models (``hf_config.py`` reads the rest): their
layers' pattern and the Mamba-2 or Gated DeltaNet layers' sizes (:mod:`~memx_launch.specs.hybrid`)."""

from __future__ import annotations

from typing import Any, Mapping

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number, require_type
from memx_launch.specs.model_checks import MAX_DIMENSION

# Hybrid families memx models: Nemotron-H (Mamba-2, attention and MLP layers in hybrid_override_pattern),
# and Qwen3-Next and Qwen3.5 (blocks of Gated DeltaNet or gated attention, each with its MLP or
# experts: layer_types; Qwen3.5's language model, the text_config of its multimodal config).
DELTANET_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
HYBRID_TYPES = ("nemotron_h", *DELTANET_TYPES)
# A hybrid config's Mamba and Gated DeltaNet keys, by ModelSpec field.
MAMBA_KEYS = {"mamba_heads": "mamba_num_heads", "mamba_head_dim": "mamba_head_dim", "mamba_state_size": "ssm_state_size",
              "mamba_groups": "n_groups", "mamba_conv_kernel": "conv_kernel", "mamba_chunk_size": "chunk_size"}
DELTANET_KEYS = {"linear_key_heads": "linear_num_key_heads", "linear_value_heads": "linear_num_value_heads",
                 "linear_key_head_dim": "linear_key_head_dim", "linear_value_head_dim": "linear_value_head_dim",
                 "linear_conv_kernel": "linear_conv_kernel_dim"}
# Qwen3-Next's and Qwen3.5's layer_types: their Gated DeltaNet blocks beside whole-sequence attention ones.
LINEAR_ATTENTION = "linear_attention"


def hybrid_of(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """A hybrid family's layers (:data:`HYBRID_TYPES`): its pattern and the Mamba or Gated
    DeltaNet layers' sizes (:data:`MAMBA_KEYS`, :data:`DELTANET_KEYS`; where a config leaves one
    out, ModelSpec's default: Megatron-Core's)."""
    if model_type not in HYBRID_TYPES:
        return {}
    if model_type in DELTANET_TYPES:
        sizes, keys = deltanet_blocks_of(cfg, where), DELTANET_KEYS
    else:
        require_type(cfg.get("hybrid_override_pattern"), str, f"model ({where}).hybrid_override_pattern")
        sizes, keys = {"hybrid_pattern": cfg["hybrid_override_pattern"]}, MAMBA_KEYS
    for field, key in keys.items():
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a positive integer")
            sizes[field] = cfg[key]
    return sizes


def deltanet_blocks_of(cfg: Mapping[str, Any], where: str) -> dict:
    """Qwen3-Next's and Qwen3.5's blocks as hybrid layers: each block a Gated DeltaNet mixer (G) or gated
    attention (*), then its experts (E) or a dense MLP (-: without experts, in the blocks
    ``mlp_only_layers`` names, and between every ``decoder_sparse_step``-th, as Hugging Face
    places them), so twice as many layers as blocks. A block attends where ``layer_types`` says
    ``full_attention``, else every ``full_attention_interval``-th block (Hugging Face's default: 4)."""
    blocks = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        require_number(interval, f"model ({where}).full_attention_interval", lo=1, hi=MAX_DIMENSION, integer=True,
                       fix="config.json must give it as a positive integer")
        types = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(blocks)]
    if len(types) != blocks:
        raise ConfigError(f"model ({where}).layer_types", f"{len(types)} entries for {blocks} blocks",
                          "give one per block (num_hidden_layers)")
    dense = cfg.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(isinstance(i, int) for i in dense)):
        raise ConfigError(f"model ({where}).mlp_only_layers", f"must be a list of block indices, got {dense!r}",
                          "give the indices of the blocks with a dense MLP, or drop the key")
    step = cfg.get("decoder_sparse_step") or 1
    experts = [bool(cfg.get("num_experts")) and i not in dense and (i + 1) % step == 0 for i in range(blocks)]
    pattern = "".join(("G" if kind == LINEAR_ATTENTION else "*") + ("E" if moe else "-")
                      for kind, moe in zip(types, experts))
    # Hugging Face's defaults (Qwen3NextConfig's, Qwen3.5's) where a config leaves the heads out (the widths: ModelSpec's).
    return {"hybrid_pattern": pattern, "num_layers": len(pattern), "attention_output_gate": True,
            "linear_key_heads": 16, "linear_value_heads": 32}
