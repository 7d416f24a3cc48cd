"""A hybrid model's Gated DeltaNet layer (Qwen3-Next's linear attention, ``G``: Megatron-Core's
GatedDeltaNet on the FLA kernels) beside what a transformer block costs: its chunked delta rule's
FLOPs, the element-wise bytes around it and what it keeps for the backward. Its two linears (the
input projection to q, k, v, the gate z, beta and alpha; the output projection) are
``matmuls.linear_shapes``'. Key and value heads split over TP; where there are more value heads
than key heads, q and k are repeated to the value heads before the kernel. No torch import.

Per value head and chunk of c tokens (key width dk, value width dv), the forward runs, in
multiply-adds per token: beta K K^T (c dk), the triangular solve (c^2 / 3), the WY products
w = A beta K and u = A beta V (c dk + c dv), the state's v_new = u - w S and update S += K^T v_new
(2 dk dv), and the output Q S + (Q K^T masked) v_new (dk dv + c dk + c dv). The backward runs
twice the forward's and recomputes w, u and the chunk states first (FLA keeps neither)."""

from __future__ import annotations

import numpy as np

from memx_launch.specs.hybrid import deltanet_conv_channels, deltanet_key_size, deltanet_value_size
from memx_launch.specs.model import ModelSpec

# HBM passes over the chunk states (fp32, one dk x dv matrix per value head and chunk): the
# forward writes them and the output kernel reads them.
STATE_PASSES = 2


def _widths(model: ModelSpec, tp):
    """(keys' width, values' width, value heads, keys' width once repeated to the value heads) on a rank."""
    tp = np.asarray(tp, dtype=np.float64)
    keys, values = deltanet_key_size(model) / tp, deltanet_value_size(model) / tp
    heads = model.linear_value_heads / tp
    return keys, values, heads, keys * model.linear_value_heads / model.linear_key_heads


def _per_head_macs(model: ModelSpec) -> tuple[float, float]:
    """(forward, backward's recomputation) multiply-adds per token and value head (module docstring)."""
    c, dk, dv = model.linear_chunk_size, model.linear_key_head_dim, model.linear_value_head_dim
    forward = c * (3.0 * dk + 2.0 * dv) + c * c / 3.0 + 3.0 * dk * dv
    return forward, c * (dk + dv) + 2.0 * dk * dv


def scan_flops(model: ModelSpec, tokens, tp) -> np.ndarray:
    """Forward FLOPs of a Gated DeltaNet layer's chunked delta rule on a rank, 2 per multiply-add;
    0 in another layer."""
    if model.layer_kind != "gated_deltanet":
        return 0.0
    heads = model.linear_value_heads / np.asarray(tp, dtype=np.float64)
    return 2.0 * np.asarray(tokens, dtype=np.float64) * heads * _per_head_macs(model)[0]


def step_scan_flops(model: ModelSpec, tokens, tp, recomputed) -> np.ndarray:
    """The chunked delta rule's FLOPs in a step of one micro-batch: forward, backward (twice the
    forward and its recomputation of w, u and the states) and the forward again where ``recomputed``."""
    if model.layer_kind != "gated_deltanet":
        return 0.0
    forward, again = _per_head_macs(model)
    backward = 2.0 * forward + again
    return scan_flops(model, tokens, tp) * (1.0 + np.asarray(recomputed, dtype=np.float64) + backward / forward)


def traffic_bytes(model: ModelSpec, tokens, tp, dtype_bytes: float) -> tuple:
    """(forward, backward) HBM bytes of a Gated DeltaNet layer's element-wise kernels on a rank (0
    in another layer). Forward, per token: q, k and v copied to the convolution's layout and
    convolved (read and write each), q and k made contiguous and L2-normed, repeated to the value
    heads, v and the gate made contiguous; the kernel reads q, k, v, writes and reads w, u and
    v_new, writes the output and passes the fp32 chunk states (:data:`STATE_PASSES`) and its
    chunk matrix A; the output norm, the gate's multiply and the copy back to the sequence-first
    layout. The backward reads and writes each twice."""
    if model.layer_kind != "gated_deltanet":
        return 0.0, 0.0
    d = dtype_bytes
    keys, values, heads, repeated = _widths(model, tp)
    conv = deltanet_conv_channels(model) / np.asarray(tp, dtype=np.float64)
    repeat = np.where(repeated > keys, 2.0 * (keys + repeated), 0.0)
    before = 4.0 * conv + 8.0 * keys + repeat + 4.0 * values
    kernel = 2.0 * repeated + values + 2.0 * (repeated + values) + 2.0 * values + values
    after = 5.0 * values + 2.0 * values
    dk, dv, c = model.linear_key_head_dim, model.linear_value_head_dim, model.linear_chunk_size
    fp32 = heads * (STATE_PASSES * 4.0 * dk * dv / c + 10.0 * c)  # states; A in fp32, solved into the dtype
    forward = np.asarray(tokens, dtype=np.float64) * (d * (before + kernel + after) + fp32)
    return forward, 2.0 * forward


def kept_units(model: ModelSpec, tp, fp8_share) -> np.ndarray:
    """What a Gated DeltaNet layer keeps for its backward beside its norm, in ``activation_bytes``'
    units (2 = one hidden-wide tensor of the training dtype): the convolution's input, the
    L2-normed q and k (and their copies repeated to the value heads), v, the gate, the kernel's
    chunk matrix A, the output before and after its norm, and the output projection's input
    (quantized with FP8 linears); beta, alpha and g per value head. 0 in another layer."""
    if model.layer_kind != "gated_deltanet":
        return 0.0
    keys, values, heads, repeated = _widths(model, tp)
    conv = deltanet_conv_channels(model) / np.asarray(tp, dtype=np.float64)
    repeated_copies = np.where(repeated > keys, 2.0 * repeated, 0.0)
    widths = (conv + 2.0 * keys + repeated_copies + 4.0 * values + fp8_share * values
              + heads * (model.linear_chunk_size + 5.0))
    return 2.0 * widths / model.hidden_size


def working_units(model: ModelSpec, tp, dtype_bytes: float) -> np.ndarray:
    """What a Gated DeltaNet layer's backward holds beside its gradients, in the same units: the
    convolution's output, w and u it computes again, and the chunk states in fp32; 0 in another layer."""
    if model.layer_kind != "gated_deltanet":
        return 0.0
    _, values, heads, repeated = _widths(model, tp)
    conv = deltanet_conv_channels(model) / np.asarray(tp, dtype=np.float64)
    states = heads * 4.0 * model.linear_key_head_dim * model.linear_value_head_dim / model.linear_chunk_size
    return 2.0 * (conv + repeated + values + states / dtype_bytes) / model.hidden_size
