"""NVIDIA Blackwell (B200, GB200, B300, GB300) and its block-scaled recipes: MXFP8 (``--fp8 mxfp8``)
and NVFP4 (``--fp4 nvfp4``): the generation's defaults, the FP4 peak, what each recipe keeps, that
only Blackwell runs them, the flag and the --cases column. No torch."""

import pytest
from estimates import cases_rows, cluster_file
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning import quantization
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.matmuls import linear_shapes, streaming_multiprocessors
from memx_launch.planning.peaks import fp4_peak_tflops, linear_tflops
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.efficiency import default_efficiency
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
GIB = 2**30
B200 = {"vendor": "nvidia", "memory_gib": 178, "peak_tflops": 2250, "memory_bandwidth_gbps": 8000,
        "compute_capability": 10.0}


def _training(**kw):
    return TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron", **kw)


def _estimate(training, device=B200):
    return evaluate_layout(MODEL, ClusterSpec.from_dict(one_node(device, 8, 900)), training, tp=2, pp=1, dp=4,
                           micro_batch_size=1, references=(1, 1, 1))


def test_blackwell_takes_its_own_best_matmul_and_streaming_multiprocessors():
    # B200's best bf16 matmul, 77.6% of its peak (stas00's table), at Hopper's training share of it.
    assert default_efficiency("nvidia", 10.0) == pytest.approx(0.58 * 0.776 / 0.801)
    assert default_efficiency("nvidia", 10.3) == default_efficiency("nvidia", 10.0) < default_efficiency("nvidia", 9.0)
    assert streaming_multiprocessors("nvidia", 10.0) == streaming_multiprocessors("nvidia", 10.3) == 148


def test_fp4_peak_is_given_or_four_times_the_16_bit_peak_on_blackwell_six_on_blackwell_ultra():
    assert fp4_peak_tflops(DeviceType(name="b", **B200)) == 4 * 2250
    assert fp4_peak_tflops(DeviceType(name="gb300", **{**B200, "peak_tflops": 2500, "compute_capability": 10.3})) \
        == 6 * 2500
    assert fp4_peak_tflops(DeviceType(name="h", **H100)) is None
    assert fp4_peak_tflops(DeviceType(name="h", **H100, peak_tflops_fp4=1)) == 1
    b200 = DeviceType(name="b", **B200)
    fp8, fp4 = (linear_tflops(b200, _training(**kw)) for kw in ({"fp8": "mxfp8"}, {"fp4": "nvfp4"}))
    assert fp4 == pytest.approx(2 * fp8) and fp8 == pytest.approx(2 * b200.effective_tflops)


def test_block_scaled_recipes_run_on_blackwell_only_and_one_at_a_time():
    with pytest.raises(ConfigError, match=r"--fp8: device type gpu \(compute capability 9\).*MXFP8.*--fp8 current"):
        _estimate(_training(fp8="mxfp8"), H100)
    with pytest.raises(ConfigError, match=r"--fp4: device type gpu .*no FP4 matmuls.*peak_tflops_fp4"):
        _estimate(_training(fp4="nvfp4"), H100)
    with pytest.raises(ConfigError, match="--fp4: the linears run in FP8 or in FP4, not both"):
        TrainingSpec(fp8="current", fp4="nvfp4")
    with pytest.raises(ConfigError, match="--fp4: FP4 linears run inside 16-bit training"):
        TrainingSpec(dtype="fp32", fp4="nvfp4")
    with pytest.raises(ConfigError, match="--fp4: unknown recipe 'mxfp4'"):
        TrainingSpec(fp4="mxfp4")
    with pytest.raises(ConfigError, match="--fp8-params: keeps the weights of FP8 linears"):
        TrainingSpec(fp4="nvfp4", fp8_params=True)


def test_each_recipe_keeps_its_quantized_bytes_with_their_scales():
    parts = {name: _estimate(_training(**kw)).stages[0].memory_parts_gib
             for name, kw in (("bf16", {}), ("current", {"fp8": "current"}), ("mxfp8", {"fp8": "mxfp8"}),
                              ("blockwise", {"fp8": "blockwise"}), ("nvfp4", {"fp4": "nvfp4"}))}
    layer = MODEL.layer_params / 2  # over TP 2
    for name, q in (("current", 1.0), ("mxfp8", 1 + 1 / 32), ("blockwise", 1 + 4 / 128), ("nvfp4", 0.5 + 1 / 16)):
        # Two quantized copies of each weight (forward; backward), no amax history but delayed scaling's.
        assert parts[name]["parameters"] - parts["bf16"]["parameters"] == pytest.approx(
            MODEL.num_layers * 2 * q * layer / GIB)
    # The linears' kept inputs: 2 bytes -> the recipe's (sequence parallel at TP 2: the normed
    # inputs, the attention output and the down projection's input, h/2, h/2, h/2 and f/2 per token).
    h, f, s = MODEL.hidden_size, MODEL.ffn_hidden_size, 4096
    inputs = MODEL.num_layers * s * (3 * h / 2 + f / 2) / GIB
    for name, q in (("mxfp8", 1 + 1 / 32), ("blockwise", 1 + 4 / 128), ("nvfp4", 0.5 + 1 / 16)):
        assert parts["current"]["activations"] - parts[name]["activations"] == pytest.approx((q - 1) * -inputs,
                                                                                              rel=1e-6)


def test_nvfp4_linears_are_faster_than_mxfp8_ones_but_never_beat_the_fp4_peak():
    mbs, seq, tp = 1, 4096, 2
    cluster = ClusterSpec.from_dict(one_node(B200, 8, 900))
    bf16, mxfp8, nvfp4 = (cm.AnalyticalCostModel(MODEL, cluster, _training(**kw)).layer_costs(0, tp, mbs, seq, cm.NONE)
                          for kw in ({}, {"fp8": "mxfp8"}, {"fp4": "nvfp4"}))
    assert nvfp4.time_s < mxfp8.time_s < bf16.time_s
    linear_flops = sum(3 * 2 * mbs * seq * n * k for n, k in linear_shapes(MODEL, _training(), tp))
    assert nvfp4.time_s >= linear_flops / (4 * 2250e12)
    assert quantization.backward_gemm_slowdown(DeviceType(name="b", **B200), _training(fp8="current")) == 1.0


def test_flags_and_cases_columns(tmp_path, capsys):
    base = ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, one_node(B200, 8, 900)),
            "--global-batch-size", "64", "--seq-len", "4096", "--setup", "megatron"]
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,fp8,fp4\nmx,2,1,4,1,mxfp8,\n"
                                        "nv,2,1,4,1,,nvfp4\n", base)
    assert rows["nv"]["iteration_time_s"] < rows["mx"]["iteration_time_s"]
