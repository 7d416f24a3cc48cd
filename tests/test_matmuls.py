"""Matmul efficiency by shape (planning/matmuls.py) and the cost model's linear layers."""

import numpy as np
import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning import matmuls as mm
from memx_launch.planning import quantization
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

rng = np.random.default_rng(0)


def test_never_above_the_best_rate_nor_peak_compute():
    """Property: over random shapes, SM counts and fills (a rate's :func:`fill_depth`) the share
    stays in (0, 1], and a GEMM is never timed faster than its FLOPs at the best rate or its
    bytes at HBM bandwidth."""
    m, n, k = (rng.integers(1, 40000, 2000) for _ in range(3))
    sms = rng.integers(1, 300, 2000)
    fill = mm.fill_depth(rng.uniform(0.05, 6.0, 2000), 1.0)
    share = mm.shape_efficiency(m, n, k, sms, fill_k=fill)
    assert ((share > 0) & (share <= 1)).all()
    best, hbm = 700e12, 3e12
    t = mm.gemm_seconds(m, n, k, best, hbm, sms, 2, fill)
    assert (t >= 2.0 * m * n * k / best).all()
    assert (t >= (m * k + k * n + m * n) * 2 / hbm).all()


def test_large_shapes_run_near_the_best_rate():
    assert float(mm.shape_efficiency(16384, 16384, 8192, 108)) > 0.9


def test_wave_quantization_one_tile_past_a_wave():
    """132 tiles fill H100's 132 SMs; 133 tiles need a second wave that is nearly empty."""
    full = float(mm.shape_efficiency(128 * 12, 128 * 11, 4096, 132))
    over = float(mm.shape_efficiency(128 * 12 + 1, 128 * 11, 4096, 132))
    assert over < 0.8 * full


def test_thin_gemms_are_slow_for_their_shape():
    """A micro-batch of one short sequence on a small model: few tiles on many SMs, a short K."""
    thin = float(mm.shape_efficiency(512, 1024, 1024, 132))
    assert thin < 0.5
    assert float(mm.shape_efficiency(512, 1024, 1024, 40)) > thin  # the same GEMM fills a T4 better


def test_a_weight_gradient_splits_its_deep_k_to_fill_the_sms():
    """A weight gradient's output is the weight (1,024 x 256: 16 tiles of 128 x 128 on 132 SMs)
    and its depth the micro-batch's tokens: split-K slices fill the SMs, and the fp32 partials
    cost their bytes. Never faster than the best rate; a GEMM whose output fills the SMs is
    not split."""
    best, hbm, sms = 60e12, 4e12, 132
    m, n, k = 1024, 256, 16384
    unsplit = 2.0 * m * n * k / (best * float(mm.shape_efficiency(m, n, k, sms)))
    split = float(mm.gemm_seconds(m, n, k, best, hbm, sms, 4))
    assert 2.0 * m * n * k / best < split < 0.5 * unsplit
    # Unsplit, the best tile is 64 x 64: 64 tiles on 132 SMs, half-fed. Split 8 ways: 128 tiles of 2,048 deep.
    assert float(mm.shape_efficiency(m, n, k, sms)) == pytest.approx(0.24, abs=0.01)
    assert float(mm.shape_efficiency(m, n, k, sms, 8)) == pytest.approx(0.91, abs=0.01)
    assert split > mm.SPLIT_K_PARTIAL_BYTES * 8 * m * n / hbm  # 8 slices' partials at least
    big = (16384, 4096, 4096)
    assert float(mm.gemm_seconds(*big, best, hbm, sms, 4)) == pytest.approx(
        2.0 * np.prod(big) / (best * float(mm.shape_efficiency(*big, sms))))
    assert float(mm.gemm_seconds(m, n, k, best, hbm, 0, 4)) == pytest.approx(2.0 * m * n * k / best)  # a CPU


def test_a_tile_s_fill_costs_the_same_time_at_any_rate():
    """A tile's fill and epilogue are a fixed time: an FP8 GEMM (twice the 16-bit rate) on a short
    K pays as many seconds for them as the same GEMM at 16 bits, so it reaches a smaller share of
    its rate; a compute-bound shape, unsplit."""
    m, n, k, sms, hbm, sixteen_bit = 16384, 4096, 1024, 132, 2.9e12, 989e12 * 0.75
    assert float(mm.fill_depth(sixteen_bit, sixteen_bit)) == mm.K_FILL
    unfilled = float(mm.shape_efficiency(m, n, k, sms, fill_k=0.0))
    overhead = []
    for rate, dtype_bytes in ((sixteen_bit, 2), (2.0 * sixteen_bit, 1)):
        fill = mm.fill_depth(rate, sixteen_bit)
        t = float(mm.gemm_seconds(m, n, k, rate, hbm, sms, dtype_bytes, fill))
        overhead.append(t - 2.0 * m * n * k / (rate * unfilled))
    assert overhead[0] > 0 and overhead[1] == pytest.approx(overhead[0])
    assert float(mm.shape_efficiency(m, n, k, sms, fill_k=2 * mm.K_FILL)) < float(mm.shape_efficiency(m, n, k, sms))


def test_memory_bound_side():
    """M = 1: a matrix-vector product is bound by reading the weights."""
    t = float(mm.gemm_seconds(1, 8192, 8192, 700e12, 2e12, 132, 2))
    assert t == pytest.approx((8192 + 8192 * 8192 + 8192) * 2 / 2e12)


def test_cpu_takes_its_measured_rate():
    assert float(mm.shape_efficiency(7, 9, 11, 0)) == 1.0
    assert mm.streaming_multiprocessors("cpu", None) == 0
    assert mm.streaming_multiprocessors("nvidia", 9.0) == 132
    assert mm.streaming_multiprocessors("nvidia", 9.0, 114) == 114  # H100 PCIe, given


def _cost(hidden, heads, sms=None):
    model = ModelSpec("m", 4, hidden, heads, heads, 4 * hidden, 32000, 2048, gated_mlp=False)
    device = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "compute_capability": 9.0,
              "memory_bandwidth_gbps": 3350, **({"sm_count": sms} if sms else {})}
    cluster = ClusterSpec.from_dict({"version": 1, "device_types": {"h": device},
                                     "nodes": [{"devices": {"h": 8}, "intra_node_gbps": 450}]})
    return model, cm.AnalyticalCostModel(model, cluster, TrainingSpec(dtype="bf16"))


def test_thin_layers_reach_a_smaller_share_of_peak():
    """Achieved matmul FLOP/s of a layer (its 6 x linear FLOPs over its time) fall with the
    micro-batch and the hidden size, and never pass the best rate."""
    achieved = {}
    for hidden in (1024, 8192):
        model, cost = _cost(hidden, hidden // 128)
        for mbs in (1, 8):
            t = float(cost.layer_costs(0, 1, mbs, 512, 0).time_s)
            flops = 6 * mbs * 512 * (model.attention_params + model.mlp_params)
            achieved[hidden, mbs] = flops / t
    best = cost.device_types[0].effective_tflops_for("bf16") * 1e12
    assert max(achieved.values()) < best
    assert achieved[1024, 1] < achieved[1024, 8] < achieved[8192, 8]
    assert achieved[1024, 1] < 0.5 * achieved[8192, 8]


def test_fp8_backward_gemms_pay_for_their_precise_accumulation_before_blackwell():
    """Training promotes the FP8 backward GEMMs' partial sums to fp32 (torchao, Transformer
    Engine) on Ada and Hopper; the forward keeps the tensor cores' fast accumulation. Blackwell
    accumulates in fp32, and no recipe pays on it, nor FP4 anywhere."""
    h100 = DeviceType("h100", "nvidia", 80, 989, compute_capability=9.0)
    b200 = DeviceType("b200", "nvidia", 180, 2250, compute_capability=10.0)
    slowdown = quantization.backward_gemm_slowdown
    assert slowdown(h100, TrainingSpec(fp8="current")) == quantization.FP8_PRECISE_ACCUMULATION_SLOWDOWN
    assert slowdown(h100, TrainingSpec()) == slowdown(b200, TrainingSpec(fp8="current")) == 1.0
    assert slowdown(b200, TrainingSpec(fp8="mxfp8")) == slowdown(b200, TrainingSpec(fp4="nvfp4")) == 1.0
    tokens, shapes = 8192.0, [(4096.0, 4096.0), (11008.0, 4096.0)]
    args = (1000e12, 3.35e12, 132, 1)
    plain = mm.forward_backward_seconds(tokens, shapes, *args)
    fp8 = mm.forward_backward_seconds(tokens, shapes, *args, backward_slowdown=quantization.FP8_PRECISE_ACCUMULATION_SLOWDOWN)
    forward = sum(mm.gemm_seconds(tokens, n, k, *args) for n, k in shapes)
    assert fp8 - forward == pytest.approx(quantization.FP8_PRECISE_ACCUMULATION_SLOWDOWN * (plain - forward))
