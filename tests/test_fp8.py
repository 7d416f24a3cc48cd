"""FP8 training (Transformer Engine's linears, delayed or current scaling): the FP8 peak for the
blocks' linear GEMMs, FP8 inputs kept for the backward, FP8 weight copies and amax histories,
the devices that have it, the flag, the --cases column and the Megatron export. No torch."""

import pytest
from estimates import cases_rows, cluster_file
from one_node import H100, one_node

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning import elementwise, quantization
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.matmuls import linear_shapes
from memx_launch.planning.model_states import FP8_AMAX_HISTORY
from memx_launch.planning.peaks import fp8_peak_tflops
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
GIB = 2**30


def _cluster(**device):
    return ClusterSpec.from_dict(one_node({**H100, **device}, 8, 450))


def _training(fp8=None, **kw):
    return TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron", fp8=fp8, **kw)


def _estimate(training, cluster=None, **layout):
    return evaluate_layout(MODEL, cluster or _cluster(), training,
                           **{"tp": 2, "pp": 1, "dp": 4, "micro_batch_size": 1, "references": (1, 1, 1), **layout})


def test_fp8_peak_is_given_or_twice_the_16_bit_peak_from_ada_on():
    assert fp8_peak_tflops(DeviceType(name="h", **H100)) == 2 * 989
    assert fp8_peak_tflops(DeviceType(name="l4", **{**H100, "peak_tflops": 121, "compute_capability": 8.9})) == 242
    assert fp8_peak_tflops(DeviceType(name="a", **{**H100, "compute_capability": 8.0})) is None
    assert fp8_peak_tflops(DeviceType(name="m", vendor="amd", memory_gib=192, peak_tflops=1307)) is None
    assert fp8_peak_tflops(DeviceType(name="m", vendor="amd", memory_gib=192, peak_tflops=1307,
                                      peak_tflops_fp8=2615)) == 2615


def test_a_device_without_fp8_or_fp32_training_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--fp8: device type gpu .*no FP8 matmuls.*peak_tflops_fp8"):
        _estimate(_training("delayed"), _cluster(compute_capability=8.0))
    _estimate(_training("delayed"), _cluster(compute_capability=8.0, peak_tflops_fp8=624))  # stated: taken
    with pytest.raises(ConfigError, match="--fp8: FP8 linears run inside 16-bit training"):
        TrainingSpec(dtype="fp32", fp8="current")
    with pytest.raises(ConfigError, match="--fp8: unknown recipe 'e4m3'"):
        TrainingSpec(fp8="e4m3")


def test_fp8_speeds_the_linears_up_to_their_peak_and_nothing_else():
    mbs, seq, tp = 1, 4096, 2
    bf16, fp8 = (cm.AnalyticalCostModel(MODEL, _cluster(), _training(f)).layer_costs(0, tp, mbs, seq, cm.NONE)
                 for f in (None, "delayed"))
    # Faster, but less than 2x: the attention core, element-wise work and TP communication stay
    # 16-bit, and FP8 adds its casts.
    assert bf16.time_s / 2 < fp8.time_s < bf16.time_s
    # Never faster than the linears' FLOPs at the FP8 peak (forward and both backward GEMMs).
    tokens = mbs * seq
    linear_flops = sum(3 * 2 * tokens * n * k for n, k in linear_shapes(MODEL, _training("delayed"), tp))
    assert fp8.time_s >= linear_flops / (2 * 989e12)


def test_a_whole_tensor_amax_reads_each_cast_tensor_once_more_and_casts_the_producers_outputs():
    """Current scaling and NVFP4 scale by the whole tensor's amax: a pass to find it, then the cast
    (2 + 2 + 1 + 1 bytes an element for FP8), unless the kernel that wrote the tensor found it; the
    norms and the activation cannot write FP8 themselves, so their 16-bit outputs are cast too.
    Delayed scaling and MXFP8 cast in one pass, the norms and activation writing FP8."""
    current = _training("current")
    assert [quantization.cast_bytes(_training(f)) for f in ("delayed", "current")] == [4.0, 6.0]
    assert quantization.cast_bytes(current, amax_found=True) == 4.0
    assert quantization.cast_bytes(TrainingSpec(fp8="mxfp8")) == pytest.approx(2 + 2 * (1 + 1 / 32))
    assert quantization.cast_bytes(TrainingSpec(fp4="nvfp4")) == pytest.approx(2 * 2 + 2 * (0.5 + 1 / 16))
    tokens, tp = 4096, 2
    hidden = tokens * MODEL.hidden_size / tp  # sequence parallel
    casts = elementwise.quantized_cast_elements(MODEL, tokens, hidden, tp)
    assert casts.producer_outputs == 2 * hidden + tokens * MODEL.ffn_hidden_size / tp  # two norms', the activation's
    assert casts.activation_input_grad == tokens * 2 * MODEL.ffn_hidden_size / tp  # the gated activation's
    traffic = {f: elementwise.elementwise_traffic_bytes(MODEL, _training(f, sequence_parallel=True), 1, tokens, tp,
                                                        cm.NONE) for f in ("delayed", "current")}
    # Every cast reads once more for its amax but where the writing kernel found it; the
    # producers' outputs are cast besides.
    assert float(traffic["current"] - traffic["delayed"]) == pytest.approx(
        2 * (casts.forward + casts.backward - casts.activation_input_grad) + 4 * casts.producer_outputs)


def test_standalone_quantized_linears_cast_the_norms_and_activation_outputs_themselves():
    """An eager block's quantized linears (te.Linear, torchao's Float8Linear) are not fused with
    the norms and the activation before them: those write 16 bits and each linear casts its input
    (read, write quantized along both axes), where Transformer Engine's LayerNormLinear and
    LayerNormMLP write the quantized output in the producing kernel."""
    tokens, tp = 4096, 1
    hidden = tokens * MODEL.hidden_size
    produced = elementwise.quantized_cast_elements(MODEL, tokens, hidden, tp).producer_outputs
    fused, standalone = (elementwise.elementwise_traffic_bytes(MODEL, _training("delayed", eager_block=eager), 1,
                                                               tokens, tp, cm.NONE) for eager in (False, True))
    assert float(standalone - fused) == pytest.approx(produced * quantization.cast_bytes(_training("delayed")))


def test_linears_that_cast_their_weight_at_each_gemm_pay_it_forward_and_backward():
    """torchao's Float8Linear keeps no FP8 weight between micro-batches (``--no-fp8-weight-cache``):
    each forward casts the weight, each backward casts it again for the input gradient (current
    scaling: an amax pass and the cast, one axis each); with FP8 weights (``--fp8-params``) there
    is nothing to cast."""
    tokens, tp = 4096, 2
    weights = sum(n * k for n, k in linear_shapes(MODEL, _training("current"), tp))
    cached, each_gemm, fp8_weights = (elementwise.elementwise_traffic_bytes(
        MODEL, _training("current", fp8_weight_cache=cache, fp8_params=params), 1, tokens, tp, cm.NONE)
        for cache, params in ((True, False), (False, False), (False, True)))
    assert float(each_gemm - cached) == pytest.approx(2 * weights * (2 + 2 + 1))
    assert float(fp8_weights) == pytest.approx(float(cached))


def test_fp8_keeps_linear_inputs_in_one_byte_and_fp8_weight_copies():
    bf16, delayed, current = (_estimate(_training(f)).stages[0].memory_parts_gib for f in (None, "delayed", "current"))
    layer = MODEL.layer_params / 2  # over TP 2
    copies = MODEL.num_layers * 2 * layer / GIB  # the FP8 weight and its transpose
    amax = MODEL.num_layers * 3 * 4 * FP8_AMAX_HISTORY * 4 / GIB  # 4 linears x 3 tensors, fp32
    assert current["parameters"] - bf16["parameters"] == pytest.approx(copies)
    assert delayed["parameters"] - current["parameters"] == pytest.approx(amax)
    # Sequence parallel at TP 2: the two normed inputs and the attention output and the MLP's
    # down-projection input (h / 2 and f / 2 per token over TP) go from 2 bytes to 1.
    h, f, s = MODEL.hidden_size, MODEL.ffn_hidden_size, 4096
    saved_per_layer = s * (2 * h / 2 + h / 2 + f / 2) * (2 - 1)
    assert bf16["activations"] - current["activations"] == pytest.approx(MODEL.num_layers * saved_per_layer / GIB,
                                                                         rel=0.05)
    assert bf16["gradients"] == current["gradients"] and bf16["optimizer_states"] == current["optimizer_states"]


def test_a_fully_sharded_run_makes_fp8_copies_of_the_gathered_layer_only():
    zero3 = dict(setup="zero3")
    bf16, fp8 = (_estimate(TrainingSpec(global_batch_size=64, seq_len=4096, fp8=f, **zero3), tp=1, dp=8)
                 .stages[0].memory_parts_gib for f in (None, "current"))
    assert fp8["parameters"] - bf16["parameters"] == pytest.approx(2 * MODEL.layer_params / GIB)


def test_casting_at_each_gemm_keeps_the_copies_of_the_layer_at_work_only():
    """torchao's Float8Linear (torchtitan) keeps no weight copies between micro-batches: a stage
    that holds its gathered weights through the step, or a replicated one, adds one layer's
    copies as working memory where Transformer Engine keeps every layer's."""
    for kw, tp, dp in ((dict(setup="fsdp2", hold_gathered="always"), 1, 8), (dict(setup="megatron"), 2, 4)):
        cached, cast = (_estimate(TrainingSpec(global_batch_size=64, seq_len=4096, fp8="current",
                                               fp8_weight_cache=c, **kw), tp=tp, dp=dp).stages[0].memory_parts_gib
                        for c in (True, False))
        layer = MODEL.layer_params / tp
        assert cached["parameters"] - cast["parameters"] == pytest.approx((MODEL.num_layers - 1) * 2 * layer / GIB)
    with pytest.raises(ConfigError, match="--no-fp8-weight-cache.*add --fp8"):
        TrainingSpec(fp8_weight_cache=False)


def test_fp8_weights_replace_the_16_bit_ones_and_gather_in_one_byte():
    # --fp8-params (Megatron's --fp8-param-gather): the FP8 weight and its transpose take the
    # 16-bit weight's two bytes, so the copies --fp8 adds are gone; the master stays fp32.
    bf16, current, kept = (_estimate(_training(f, **kw)).stages[0].memory_parts_gib
                           for f, kw in ((None, {}), ("current", {}), ("current", {"fp8_params": True})))
    layer = MODEL.layer_params / 2
    assert kept["parameters"] == pytest.approx(bf16["parameters"])
    assert current["parameters"] - kept["parameters"] == pytest.approx(MODEL.num_layers * 2 * layer / GIB)
    assert kept["optimizer_states"] == bf16["optimizer_states"]
    # Fully sharded in FSDP's units: each layer is gathered (and prefetched) in FP8 and transposed,
    # 3 bytes a parameter against 4 for its 16-bit gathers and 2 more for their FP8 copies.
    zero3 = dict(global_batch_size=64, seq_len=4096, setup="zero3", max_live_params=0.0, fp8="current")
    plain, fp8_weights = (_estimate(TrainingSpec(**zero3, fp8_params=p), tp=1, dp=8).stages[0].memory_parts_gib
                          for p in (False, True))
    assert plain["parameters"] - fp8_weights["parameters"] == pytest.approx(3 * MODEL.layer_params / GIB)
    # The distributed optimizer's all-gather of the updated weights moves one byte per weight.
    from memx_launch.planning.collectives import bucketed_seconds
    from memx_launch.planning.data_parallel import data_parallel_sync_time, gradient_bucket_params
    params, dp, gbps = 1e9, 8, 50.0
    training = _training("current", fp8_params=True)
    bucket = gradient_bucket_params(training, dp)
    assert float(data_parallel_sync_time(params, training, dp, gbps)) == pytest.approx(
        float(bucketed_seconds("reduce_scatter", params * 4, bucket * 4, dp, gbps)
              + bucketed_seconds("all_gather", params * 1, bucket * 1, dp, gbps)))
    with pytest.raises(ConfigError, match="--fp8-params: keeps the weights of FP8 linears.*add --fp8"):
        TrainingSpec(fp8_params=True)


def test_flag_cases_column_and_megatron_export(tmp_path, capsys):
    base = ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, one_node(H100, 8, 450)), "--global-batch-size",
            "64", "--seq-len", "4096", "--setup", "megatron"]
    assert main(["plan", *base, "--fp8", "current", "--quiet", "--json", str(tmp_path / "plan.json")]) == 0
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.training["fp8"] == "current"
    args = megatron_args(plan).args
    assert args[args.index("--fp8-format") + 1] == "hybrid" and args[args.index("--fp8-recipe") + 1] == "tensorwise"
    assert "--fp8-param-gather" not in args
    assert main(["plan", *base, "--fp8", "current", "--fp8-params", "--optimizer-dtype", "bf16", "--quiet",
                 "--json", str(tmp_path / "kept.json")]) == 0
    kept = Plan.load(str(tmp_path / "kept.json"))
    assert kept.training["fp8_params"] and kept.training["optimizer_dtype"] == "training"
    args = megatron_args(kept).args
    assert "--fp8-param-gather" in args and "--use-precision-aware-optimizer" in args
    assert args[args.index("--exp-avg-dtype") + 1] == "bf16"
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,fp8\nbf16,2,1,4,1,\nfp8,2,1,4,1,delayed\n",
                      base)
    assert rows["fp8"]["iteration_time_s"] < rows["bf16"]["iteration_time_s"]
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,fp8,fp8_params\n"
                      "copies,2,1,4,1,current,false\nkept,2,1,4,1,current,true\n", base)
    assert rows["kept"]["peak_memory_gib"] < rows["copies"]["peak_memory_gib"]


def test_blockwise_fp8_runs_on_hopper_and_exports_megatron_s_recipe():
    from test_exporters import _megatron_config

    current, blockwise = (_estimate(_training(fp8=r)) for r in ("current", "blockwise"))
    # Per-tensor FP8's bytes and an fp32 scale per 128 elements: a little more memory; each block
    # scaled as it is cast, where current scaling reads each tensor for its amax first: a little faster.
    assert blockwise.stages[0].predicted_peak_memory_gib > current.stages[0].predicted_peak_memory_gib
    assert blockwise.predicted_iteration_time_s < current.predicted_iteration_time_s \
        < 1.05 * blockwise.predicted_iteration_time_s
    args = megatron_args(blockwise).args
    assert args[args.index("--fp8-format") + 1] == "e4m3" and args[args.index("--fp8-recipe") + 1] == "blockwise"
    assert _megatron_config(blockwise, args).fp8_recipe == "blockwise"
