"""Hybrid models (Nemotron-H, Nemotron 3): layers of Mamba-2 mixers, attention, MLPs and mixtures
of experts in a pattern of their own, each behind one pre-norm and a residual add. The pattern's kinds and a Mamba layer's sizes;
``ModelSpec.layer_kinds`` gives each kind's shape to price, ``model_checks`` what a pattern may hold."""

from __future__ import annotations

# A hybrid model's layer kinds by their character in Megatron's --hybrid-override-pattern.
HYBRID_LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# What a hybrid model's layers other than its expert ones (E) hold none of.
NO_EXPERTS = {"num_experts": 0, "experts_per_token": 0, "expert_ffn_hidden_size": 0, "shared_expert_ffn_hidden_size": 0,
              "expert_groups": 0, "expert_groups_per_token": 0}


def mamba_params(model) -> int:
    """A Mamba-2 mixer's parameters (Megatron-Core's MambaMixer): the input projection to z, x, B,
    C and dt (2 d_inner + 2 groups x d_state + heads), the depthwise causal convolution over x, B
    and C with its bias, A, D and dt's bias per head, the gated norm and the output projection;
    none in another layer."""
    if model.layer_kind != "mamba":
        return 0
    inner, h, heads = model.mamba_inner_size, model.hidden_size, model.mamba_heads
    conv = conv_channels(model)
    return h * (inner + conv + heads) + conv * (model.mamba_conv_kernel + 1) + 3 * heads + inner + inner * h


def conv_channels(model) -> int:
    """Channels of a Mamba layer's convolution: x (d_inner), B and C (groups x d_state each)."""
    return model.mamba_inner_size + 2 * model.mamba_groups * model.mamba_state_size
