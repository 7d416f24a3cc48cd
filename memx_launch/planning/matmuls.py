"""Matmul time by shape: a roofline per GEMM (M, N, K) with tile and wave quantization (NVIDIA's
Matrix Multiplication Background User's Guide, docs.nvidia.com/deeplearning/performance). No torch.

A GEMM runs as output tiles of tm x tn, each on one streaming multiprocessor (SM), in waves of
as many tiles as the device has SMs. The device's best matmul rate (one input per device type)
is what a large, well-shaped GEMM sustains; a GEMM of another shape reaches a share of it:

- tile quantization: the edge tiles of M and N compute padding;
- wave quantization: the last wave leaves SMs idle (64 tiles on 132 SMs use 48% of them);
- tile shape: a smaller tile (which fills more SMs) loads more operand bytes per FLOP: a tile's
  reuse is tm tn / (tm + tn); 128 x 128 and larger keep the tensor cores fed, 256 x 64, 128 x 64
  and 64 x 64 reach 0.8, 2/3 and 1/2 of the rate (operand feed bound in proportion to reuse);
- the K loop: each tile fills and drains a software pipeline of a few K steps and writes its
  output once, a fixed time: about K_FILL of K's worth at the 16-bit tensor-core rate, so a
  GEMM reaches K / (K + K_FILL) of its rate; at r times that rate (FP8 2x, FP4 4x, TF32 1/2)
  the same time is r x K_FILL of K's worth;
- split-K: a GEMM whose output has too few tiles to fill the SMs but a deep K (a weight
  gradient: the weight's N x K out, the micro-batch's tokens deep) splits its K loop into slices
  that run as tiles of their own, each writing an fp32 partial that a reduction kernel sums
  (CUTLASS's GemmSplitKParallel; cuBLAS picks split-K or stream-K kernels by shape); the partials'
  bytes cost their HBM time;
- the memory side: no faster than reading A and B and writing C once at HBM bandwidth.

cuBLAS picks the tile per shape; memx takes the tile that gives the shortest time. A micro-batch
of 1-2 sequences on a small model is a grid of few tiles on many SMs: slow for that reason.
"""

from __future__ import annotations

import numpy as np

from memx_launch.specs.hybrid import mixer_projections

# Output tiles cuBLAS/CUTLASS kernels use, each (tm, tn, share of the best rate): its operand
# reuse tm tn / (tm + tn) against 128 x 128's, at most 1.
_TILE_SIDES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))
TILES = tuple((float(a), float(b), min(1.0, a * b / (a + b) / 64.0)) for a, b in _TILE_SIDES)
_TILE_M, _TILE_N, _TILE_FEED = (np.array(side) for side in zip(*TILES))
# K of pipeline fill and epilogue per output tile (a few 32-64 deep K steps) at the 16-bit rate.
K_FILL = 128.0
# Most slices a split-K GEMM cuts its K loop into.
MAX_SPLIT_K = 16
# Bytes per output element and slice of a split-K GEMM's partials: written and read back in fp32.
SPLIT_K_PARTIAL_BYTES = 8.0
# Streaming multiprocessors by NVIDIA compute capability, the datacenter part of each
# generation (V100, T4, A100, A10G, L4, H100/H200/GH200, B200, B300); AMD: MI300X's compute units.
SMS_BY_COMPUTE_CAPABILITY = {7.0: 80, 7.5: 40, 8.0: 108, 8.6: 80, 8.9: 58, 9.0: 132, 10.0: 148, 10.3: 148}
DEFAULT_SMS = {"nvidia": 108, "amd": 304}


def streaming_multiprocessors(vendor: str, compute_capability: float | None, given: int | None = None) -> int:
    """SMs of a device type: ``given``, else its compute capability's datacenter part, else
    the vendor's default (A100's 108 for NVIDIA); 0 for a CPU (no tiles nor waves: its measured
    matmul rate is taken as it is)."""
    if given:
        return int(given)
    if vendor == "cpu":
        return 0
    if compute_capability is not None and compute_capability in SMS_BY_COMPUTE_CAPABILITY:
        return SMS_BY_COMPUTE_CAPABILITY[compute_capability]
    return DEFAULT_SMS.get(vendor, DEFAULT_SMS["nvidia"])


def device_sms(device_types, emulated: bool) -> np.ndarray:
    """SMs of each device type (:func:`streaming_multiprocessors`); 0 on an emulated cluster,
    whose devices are CPU processes whatever vendor they stand in for (no tiles nor waves)."""
    return np.array([0 if emulated else streaming_multiprocessors(d.vendor, d.compute_capability, d.sm_count)
                     for d in device_types])


def shape_efficiency(m, n, k, sms, split=1, fill_k=K_FILL) -> np.ndarray:
    """Share of the best matmul rate a GEMM of output M x N and depth K reaches (arrays broadcast,
    ``split`` too), with the best of :data:`TILES`, its K loop cut into ``split`` slices, each
    tile's fill and epilogue ``fill_k`` of K's worth (:func:`fill_depth`). 1 means the best rate;
    never above it. ``sms`` 0: a CPU, 1."""
    m, n, k = (np.maximum(np.asarray(x, dtype=np.float64), 1.0) for x in (m, n, k))
    tiled = np.asarray(sms, dtype=np.float64) > 0
    sms = np.maximum(np.asarray(sms, dtype=np.float64), 1.0)[..., None]
    m, n = m[..., None], n[..., None]  # every tile at once, along a last axis
    grid = np.ceil(m / _TILE_M) * np.ceil(n / _TILE_N)
    tiles = grid * np.asarray(split)[..., None]
    waves = tiles / (np.ceil(tiles / sms) * sms)
    best = (_TILE_FEED * (m * n) / (grid * _TILE_M * _TILE_N) * waves).max(axis=-1)
    depth = k / split
    return np.where(tiled, best * depth / (depth + fill_k), 1.0)


def fill_depth(rate, sixteen_bit_rate):
    """K's worth of a tile's fill and epilogue at ``rate``: :data:`K_FILL` at the device's 16-bit
    rate, in proportion at another (an FP8 GEMM runs twice the K in the same time)."""
    return K_FILL * np.asarray(rate, dtype=np.float64) / np.asarray(sixteen_bit_rate, dtype=np.float64)


def gemm_seconds(m, n, k, best_flops, hbm_bytes_per_s, sms, dtype_bytes, fill_k=K_FILL) -> np.ndarray:
    """Seconds of one GEMM: its FLOPs at the shape's share of the best rate (split-K where that
    is faster, its fp32 partials' traffic included), or reading A and B and writing C at HBM
    bandwidth, whichever is longer. ``fill_k``: :func:`fill_depth` at ``best_flops``."""
    m, n, k = (np.asarray(x, dtype=np.float64) for x in (m, n, k))
    rate, hbm = np.asarray(best_flops), np.asarray(hbm_bytes_per_s)
    compute = 2.0 * m * n * k / (rate * shape_efficiency(m, n, k, sms, 1, fill_k))
    # Split-K where at least two slices fit: one wave of 128 x 128 output tiles holds two copies
    # of the output, and K two slices as deep as the fill (a CPU, 0 SMs, never). Most GEMMs are
    # not: the check is all they pay.
    tiles = np.ceil(np.maximum(m, 1.0) / 128.0) * np.ceil(np.maximum(n, 1.0) / 128.0)
    cut = (np.asarray(sms) >= 2.0 * tiles) & (k >= 2.0 * np.asarray(fill_k))
    if cut.any():
        compute = _split_k_seconds(compute, cut, tiles, m, n, k, rate, hbm, sms, fill_k)
    return np.maximum(compute, (m * k + k * n + m * n) * dtype_bytes / hbm)


def _split_k_seconds(compute, cut, tiles, m, n, k, rate, hbm, sms, fill_k) -> np.ndarray:
    """``compute`` with the GEMMs of ``cut`` split: as many slices (a power of two, at most
    MAX_SPLIT_K) as fill one wave of 128 x 128 tiles, each at least ``fill_k`` deep, where that beats
    the unsplit kernel, their partials' bytes included."""
    compute, tiles, m, n, k, rate, hbm, sms, fill_k = (np.array(np.broadcast_to(x, cut.shape), dtype=np.float64)
                                                       for x in (compute, tiles, m, n, k, rate, hbm, sms, fill_k))
    m, n, k, rate, hbm, sms, tiles, fill_k = (x[cut] for x in (m, n, k, rate, hbm, sms, tiles, fill_k))
    split = np.minimum(2.0 ** np.floor(np.log2(np.minimum(sms / tiles, k / fill_k))), MAX_SPLIT_K)
    partials = SPLIT_K_PARTIAL_BYTES * split * m * n / hbm
    sliced = 2.0 * m * n * k / (rate * shape_efficiency(m, n, k, sms, split, fill_k)) + partials
    compute[cut] = np.minimum(compute[cut], sliced)
    return compute


def forward_backward_seconds(tokens, shapes, best_flops, hbm_bytes_per_s, sms, dtype_bytes, fill_k=K_FILL,
                             backward_slowdown=1.0) -> np.ndarray:
    """One layer's linear layers forward and backward (:func:`linear_seconds`), the two backward
    GEMMs ``backward_slowdown`` times slower (FP8's precise accumulation:
    :func:`~memx_launch.planning.quantization.backward_gemm_slowdown`)."""
    forward, backward = linear_seconds(tokens, shapes, best_flops, hbm_bytes_per_s, sms, dtype_bytes, fill_k)
    return forward + backward_slowdown * backward


def linear_seconds(tokens, shapes, best_flops, hbm_bytes_per_s, sms, dtype_bytes, fill_k=K_FILL) -> tuple:
    """(forward, backward) seconds of one layer's linear layers: for each weight of ``shapes``
    ((N, K): output and input features, per TP rank), the forward M x N x K, and the input
    gradient M x K x N and the weight gradient N x K x M, with M the tokens of the micro-batch."""
    rate = (best_flops, hbm_bytes_per_s, sms, dtype_bytes, fill_k)
    forward = backward = 0.0
    for n, k in shapes:
        forward = forward + gemm_seconds(tokens, n, k, *rate)
        backward = backward + gemm_seconds(tokens, k, n, *rate) + gemm_seconds(n, k, tokens, *rate)
    return forward, backward


def latent_up_shapes(model, tp) -> list[tuple]:
    """(N, K) of latent attention's up projections on one TP rank (queries, then keys and values):
    what its selective recompute runs again."""
    tp = np.asarray(tp, dtype=np.float64)
    value = model.num_heads * (model.v_head_dim or model.head_dim)
    queries = [(model.q_hidden_size / tp, float(model.q_lora_rank))] if model.q_lora_rank else []
    return [*queries, ((model.num_heads * model.head_dim + value) / tp, float(model.kv_lora_rank))]


def linear_shapes(model, training, tp) -> list[tuple]:
    """(N, K) of each linear layer's weight of a block on one TP rank: the fused QKV (latent
    attention: its down and up projections; with an output gate, its query part twice), the
    output projection, the MLP's up (and gate: fused, or its own GEMM) and down projections. A
    mixture of experts has its shared expert's MLP here, if any (its routed experts:
    ``planning/experts.py``); a hybrid model's layer its attention's or its MLP's, a Mamba or
    Gated DeltaNet layer its input and output projections."""
    tp = np.asarray(tp, dtype=np.float64)
    h = float(model.hidden_size)
    mixer = mixer_projections(model)
    if mixer:  # a Mamba or Gated DeltaNet layer: its input projection and its output one
        return [(mixer[0] / tp, h), (h, mixer[1] / tp)]
    q, value = float(model.q_hidden_size), float(model.value_hidden_size)
    gated_q = 2.0 * q if model.attention_output_gate else q  # the query projection computes the output gate too
    attention = [((gated_q + 2.0 * model.kv_hidden_size) / tp, h), (h, value / tp)] if model.has_attention else []
    if model.kv_lora_rank:  # latent attention: whole down projections on every TP rank, heads' up projections split
        q_rank, kv_rank = float(model.q_lora_rank), float(model.kv_lora_rank)
        downs = [(q_rank, h)] if q_rank else [(q / tp, h)]
        attention = [*downs, (kv_rank + model.rope_head_dim, h), *latent_up_shapes(model, tp), (h, value / tp)]
    return [*attention, *mlp_shapes(model, training, tp)]


def linear_module_params(model, training, tp) -> list:
    """Parameters of each linear module of a block on one TP rank, as a framework that fetches
    weights module by module sees them (DeepSpeed ZeRO-3): those of :func:`linear_shapes`, the
    fused QKV as three modules where ``fused_qkv`` is off (Hugging Face's q, k and v projections)."""
    shapes = linear_shapes(model, training, tp)
    params = [n * k for n, k in shapes]
    if model.has_attention and not model.kv_lora_rank and not training.fused_qkv and not mixer_projections(model):
        kv = model.kv_hidden_size * shapes[0][1] / np.asarray(tp, dtype=np.float64)
        params[:1] = [params[0] - 2.0 * kv, kv, kv]
    return params


def mlp_shapes(model, training, tp) -> list[tuple]:
    """(N, K) of the dense MLP's linears on one TP rank (a mixture of experts': its shared
    expert's; none without one): up (and gate: fused, or its own GEMM), then down."""
    tp = np.asarray(tp, dtype=np.float64)
    h = float(model.hidden_size)
    ffn = float(model.shared_expert_ffn_hidden_size if model.num_experts else model.ffn_hidden_size)
    if not (ffn and model.has_mlp):
        return []
    if not model.gated_mlp:
        up = [(ffn / tp, h)]
    elif training.fused_gate_up:
        up = [(2.0 * ffn / tp, h)]
    else:
        up = [(ffn / tp, h), (ffn / tp, h)]
    return [*up, (h, ffn / tp)]


def row_parallel_shapes(model, training, tp) -> list[tuple]:
    """(N, K) of a block's row-parallel linears on one TP rank, those whose forward output is
    reduced (scattered) over TP: the attention's output projection (a Mamba or Gated DeltaNet
    layer's), the MLP's down projection (a mixture's shared expert's)."""
    shapes, mlp = linear_shapes(model, training, tp), mlp_shapes(model, training, tp)
    attention = shapes[:len(shapes) - len(mlp)]
    return [*attention[-1:], *mlp[-1:]]
