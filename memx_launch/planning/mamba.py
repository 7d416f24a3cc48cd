"""A hybrid model's Mamba-2 layer (Nemotron-H's ``M``: Megatron-Core's MambaMixer on mamba_ssm's
fused kernels) beside what a transformer block costs: its chunked scan's FLOPs, the element-wise
bytes around it and what it keeps for the backward. Its two linears (the input projection to z, x,
B, C and dt; the output projection) are ``matmuls.linear_shapes``'. Heads and groups split over TP.
No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.specs.hybrid import conv_channels, mamba_inner_size
from memx_launch.specs.model import ModelSpec

# HBM passes over the scan's chunk states (fp32, one d_inner x d_state matrix per chunk): the
# chunk-state kernel writes them, state passing reads and writes them, the chunk scan reads them.
STATE_PASSES = 4


def scan_flops(model: ModelSpec, tokens, tp) -> np.ndarray:
    """Forward FLOPs of a Mamba layer's chunked scan (SSD) on a rank, 2 per multiply-add: within a
    chunk of c tokens C B^T (c x d_state a group) and its product with x (c x d_inner), between
    chunks each chunk's state (d_inner x d_state) and the outputs it gives; 0 in another layer.
    The backward runs twice as many."""
    if model.layer_kind != "mamba":
        return 0.0
    inner, state, chunk = mamba_inner_size(model), model.mamba_state_size, model.mamba_chunk_size
    per_token = inner * chunk + 2.0 * inner * state + chunk * state * model.mamba_groups
    return 2.0 * np.asarray(tokens, dtype=np.float64) * per_token / np.asarray(tp, dtype=np.float64)


def step_scan_flops(model: ModelSpec, tokens, tp, recomputed) -> np.ndarray:
    """The chunked scan's FLOPs in a step of one micro-batch: forward, twice that backward, and
    the forward again where ``recomputed``."""
    return (3.0 + np.asarray(recomputed, dtype=np.float64)) * scan_flops(model, tokens, tp)


def traffic_bytes(model: ModelSpec, tokens, tp, dtype_bytes: float) -> tuple:
    """(forward, backward) HBM bytes of a Mamba layer's element-wise kernels on a rank (0 in
    another layer): the convolution reads x, B, C and writes them convolved and activated; the
    scan reads them with dt and writes y, and passes its chunk states (:data:`STATE_PASSES`); the
    gated norm reads y and z and writes its output. The backward runs each twice and the
    convolution again (the fused kernel keeps its input, not its output)."""
    if model.layer_kind != "mamba":
        return 0.0, 0.0
    d, inner, conv = dtype_bytes, mamba_inner_size(model), conv_channels(model)
    states = STATE_PASSES * 4.0 * inner * model.mamba_state_size / model.mamba_chunk_size
    per_token = d * (2.0 * conv + conv + model.mamba_heads + inner + 3.0 * inner) + states
    forward = np.asarray(tokens, dtype=np.float64) * per_token / np.asarray(tp, dtype=np.float64)
    return forward, 2.0 * forward + np.asarray(tokens, dtype=np.float64) * 2.0 * d * conv / np.asarray(tp)


def kept_units(model: ModelSpec, tp, fp8_share) -> np.ndarray:
    """What a Mamba layer keeps for its backward beside its norm, in ``activation_bytes``' units
    (2 = one hidden-wide tensor of the training dtype): the input projection's output (z, x, B, C
    and dt, which the fused kernel reads again), the scan's output y and the gated norm's output
    the output projection reads (quantized with FP8 linears); 0 in another layer."""
    if model.layer_kind != "mamba":
        return 0.0
    inner = mamba_inner_size(model)
    projected = inner + conv_channels(model) + model.mamba_heads
    return 2.0 * (projected + inner + fp8_share * inner) / model.hidden_size / np.asarray(tp, dtype=np.float64)


def working_units(model: ModelSpec, tp, dtype_bytes: float) -> np.ndarray:
    """What a Mamba layer's backward holds beside its gradients, in the same units: the
    convolution's output it computes again, and the scan's chunk states in fp32; 0 in another layer."""
    if model.layer_kind != "mamba":
        return 0.0
    states = 4.0 * mamba_inner_size(model) * model.mamba_state_size / model.mamba_chunk_size / dtype_bytes
    return 2.0 * (conv_channels(model) + states) / model.hidden_size / np.asarray(tp, dtype=np.float64)


def cp_degrees(model: ModelSpec, given):
    """The CP degrees a search asks for: ``given``, or None (those the sequence suits) but for a
    hybrid model, which is searched at CP 1 (:func:`check`)."""
    return (1,) if given is None and model.hybrid_pattern else given


def check(model: ModelSpec, training, cp_degrees=(1,)) -> None:
    """What memx refuses of a hybrid model's run (Mamba or Gated DeltaNet layers), not priced for
    its layers: context parallelism (a Mamba scan or a delta rule passes its state along the whole
    sequence, not a ring of key chunks; Megatron-Core 0.16 runs neither under CP), LoRA and
    torchtitan's op-level recompute."""
    if not model.hybrid_pattern:
        return
    if any(cp > 1 for cp in cp_degrees):
        raise ConfigError("--cp", f"{max(cp_degrees)} on the hybrid model {model.name}, whose layers memx does not "
                          "price under context parallelism", "drop --cp (CP 1)")
    unmodelled = [flag for flag, on in (("--lora-rank", training.lora_rank),
                                        ("--selective-recompute op", training.selective_recompute == "op")) if on]
    if unmodelled:
        raise ConfigError(unmodelled[0], f"not modelled for the hybrid model {model.name}",
                          "use full fine-tuning or Megatron's selective recompute")
