"""Hybrid models (Nemotron-H, Nemotron 3, Qwen3-Next): layers of Mamba-2 mixers, Gated DeltaNet
mixers, attention, MLPs and mixtures of experts in a pattern of their own, each behind one pre-norm
and a residual add. The pattern's kinds and the mixers' sizes; ``ModelSpec.layer_kinds`` gives each
kind's shape to price, ``model_checks`` what a pattern may hold."""

from __future__ import annotations

import functools

# A hybrid model's layer kinds by their character in Megatron's --hybrid-override-pattern, and G,
# memx's own for a Gated DeltaNet mixer (Megatron runs those in GPT models' blocks instead:
# --experimental-attention-variant gated_delta_net, a G and the MLP after it one block).
HYBRID_LAYER_KINDS = {"M": "mamba", "G": "gated_deltanet", "*": "attention", "-": "mlp", "E": "moe"}
# A Gated DeltaNet model's layers as Megatron-LM's GPT blocks: each a mixer, then its MLP.
BLOCK_MIXERS, BLOCK_MLPS = "G*", "E-"
# What a hybrid model's layers other than its expert ones (E) hold none of.
NO_EXPERTS = {"num_experts": 0, "experts_per_token": 0, "expert_ffn_hidden_size": 0, "shared_expert_ffn_hidden_size": 0,
              "shared_expert_gate": False, "expert_groups": 0, "expert_groups_per_token": 0, "clamped_glu": False,
              "expert_biases": False, "experts_take_every_token": False}


def mamba_inner_size(model) -> int:
    """A Mamba layer's inner width: its heads x their width (Mamba-2's d_inner)."""
    return model.mamba_heads * model.mamba_head_dim


def deltanet_key_size(model) -> int:
    """A Gated DeltaNet layer's query (and key) width: its key heads x their width."""
    return model.linear_key_heads * model.linear_key_head_dim


def deltanet_value_size(model) -> int:
    """A Gated DeltaNet layer's value (and output gate) width: its value heads x their width."""
    return model.linear_value_heads * model.linear_value_head_dim


def mamba_params(model) -> int:
    """A Mamba-2 mixer's parameters (Megatron-Core's MambaMixer): the input projection to z, x, B,
    C and dt (2 d_inner + 2 groups x d_state + heads), the depthwise causal convolution over x, B
    and C with its bias, A, D and dt's bias per head, the gated norm and the output projection;
    none in another layer."""
    if model.layer_kind != "mamba":
        return 0
    inner, h, heads = mamba_inner_size(model), model.hidden_size, model.mamba_heads
    conv = conv_channels(model)
    return h * (inner + conv + heads) + conv * (model.mamba_conv_kernel + 1) + 3 * heads + inner + inner * h


def conv_channels(model) -> int:
    """Channels of a Mamba layer's convolution: x (d_inner), B and C (groups x d_state each)."""
    return mamba_inner_size(model) + 2 * model.mamba_groups * model.mamba_state_size


def deltanet_params(model) -> int:
    """A Gated DeltaNet mixer's parameters (Megatron-Core's GatedDeltaNet, Qwen3-Next's linear
    attention): the input projection to q, k, v, the output gate z, beta and alpha (2 keys' width
    + 2 values' width + 2 per value head), the depthwise convolution over q, k and v (no bias),
    A and dt's bias per value head, the output norm (one value head wide) and the output
    projection; none in another layer."""
    if model.layer_kind != "gated_deltanet":
        return 0
    keys, values, heads = deltanet_key_size(model), deltanet_value_size(model), model.linear_value_heads
    return (model.hidden_size * (2 * keys + 2 * values + 2 * heads) + deltanet_conv_channels(model) * model.linear_conv_kernel
            + 2 * heads + model.linear_value_head_dim + values * model.hidden_size)


def deltanet_conv_channels(model) -> int:
    """Channels of a Gated DeltaNet layer's convolution: q and k (the keys' width each) and v."""
    return 2 * deltanet_key_size(model) + deltanet_value_size(model)


def mixer_projections(model) -> tuple[int, int] | None:
    """(the input projection's output width, the output projection's input width) of a Mamba or
    Gated DeltaNet layer, whole (TP splits both); None in another layer."""
    if model.layer_kind == "mamba":  # z, x, B, C and dt; y
        return mamba_inner_size(model) + conv_channels(model) + model.mamba_heads, mamba_inner_size(model)
    if model.layer_kind == "gated_deltanet":  # q, k, v, z, beta and alpha; the gated output
        values = deltanet_value_size(model)
        return deltanet_conv_channels(model) + values + 2 * model.linear_value_heads, values
    return None


def layers_per_block(model) -> int:
    """Layers a split keeps together: 2 where the pattern is Gated DeltaNet blocks (pairs of a
    mixer, G or *, and its MLP, E or -: what Megatron-LM's GPT stack builds), else 1."""
    return _pattern_block(model.hybrid_pattern)


@functools.lru_cache(maxsize=64)  # the search asks it of every group it scores
def _pattern_block(pattern: str) -> int:
    pairs = len(pattern) % 2 == 0 and all(pattern[i] in BLOCK_MIXERS and pattern[i + 1] in BLOCK_MLPS
                                          for i in range(0, len(pattern), 2))
    return 2 if "G" in pattern and pairs else 1
