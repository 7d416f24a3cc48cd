"""What tensor parallelism splits in a model: its heads, its KV heads, a hybrid model's Mamba groups
and its Gated DeltaNet key heads (which the value heads are a multiple of)."""

from __future__ import annotations


def splits_over_tp(model, tp: int) -> bool:
    """Whether TP ``tp`` divides the heads, the KV heads, a hybrid model's Mamba groups and its Gated
    DeltaNet key heads."""
    mamba_groups_split = "M" not in model.hybrid_pattern or model.mamba_groups % tp == 0
    deltanet_split = "G" not in model.hybrid_pattern or model.linear_key_heads % tp == 0
    return model.num_heads % tp == 0 and model.num_kv_heads % tp == 0 and mamba_groups_split and deltanet_split


def tp_units(model) -> str:
    """What TP splits, in words (:func:`splits_over_tp`)."""
    units = [f"{model.num_heads} heads", f"{model.num_kv_heads} KV heads"]
    units += [f"{model.mamba_groups} Mamba groups"] * ("M" in model.hybrid_pattern)
    units += [f"{model.linear_key_heads} Gated DeltaNet key heads"] * ("G" in model.hybrid_pattern)
    return ", ".join(units[:-1]) + (" and " if len(units) > 2 else ", ") + units[-1]
