"""Training setups as users run them: presets, the memory each keeps, and the run options."""

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning import host_time
from memx_launch.planning.loss import logits_bytes
from memx_launch.planning.data_parallel import data_parallel_sync_time
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.efficiency import DEFAULT_EFFICIENCY, FP32_MATMUL_SHARE
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.setups import SETUPS
from memx_launch.specs.training import TrainingSpec


@pytest.mark.parametrize("setup, per_param", [
    ("megatron", lambda dp: 6 + 12 / dp),     # Megatron theoretical_memory_usage.py
    ("zero1", lambda dp: 4 + 12 / dp),        # ZeRO paper: 2 + 2 + K/Nd
    ("zero2", lambda dp: 2 + 14 / dp),
    ("zero3", lambda dp: 16 / dp),
    ("fsdp2", lambda dp: 16 / dp),
    ("ddp", lambda dp: 16 if dp == 1 else 20),  # torch DDP's buckets copy the fp32 gradients
    ("memx-run", lambda dp: 16 if dp == 1 else 20),  # its replicas are DDP's
])
def test_model_state_bytes_per_setup(setup, per_param):
    for dp in (1, 8, 64):
        assert float(cm.model_state_bytes_per_param(TrainingSpec(setup=setup), dp)) == pytest.approx(per_param(dp))


def test_explicit_fields_win_over_the_preset():
    spec = TrainingSpec(setup="megatron", distributed_optimizer=False, grad_dtype="bf16")
    assert spec.sequence_parallel and not spec.distributed_optimizer and spec.grad_dtype == "training"
    assert float(cm.model_state_bytes_per_param(spec, 8)) == 2 + 2 + 12
    # A spec rebuilt from what a plan records is the same spec.
    assert TrainingSpec(**spec.plan_fields()) == spec
    with pytest.raises(ConfigError, match="--setup"):
        TrainingSpec(setup="deepspeed")
    with pytest.raises(ConfigError, match="--sharded-gradients"):
        TrainingSpec(sharded_gradients=True)
    assert set(SETUPS) == {"megatron", "fsdp2", "torchtitan", "zero1", "zero2", "zero3", "ddp", "scaling", "memx-run"}
    # torchtitan: fsdp2's states, its TP plan's loss and kept inputs, torchao's casts, op-level SAC.
    titan, fsdp2 = TrainingSpec(setup="torchtitan", fp8="current"), TrainingSpec(setup="fsdp2", fp8="current")
    assert cm.model_state_bytes_per_param(titan, 8) == cm.model_state_bytes_per_param(fsdp2, 8)
    assert (titan.vocab_parallel_loss, titan.torch_loss_parallel, titan.sp_keeps_gathered_input,
            titan.fp8_weight_cache, titan.selective_recompute) == (True, True, True, False, "op")
    assert titan.eager_block and not titan.fused_norm  # torchtitan without torch.compile, its default
    assert TrainingSpec(**titan.plan_fields()) == titan
    assert TrainingSpec(**TrainingSpec(setup="torchtitan").plan_fields()).fp8_weight_cache is False


def test_a_16_bit_optimizer_keeps_master_weights_and_moments_in_6_bytes():
    # Apex's DistributedFusedAdam with dtype bf16 (NeMo's 340B and SFT recipes): a 16-bit remainder
    # of each fp32 master weight and 16-bit moments, 6 bytes against 12, sharded as before.
    for dp in (1, 8):
        spec = TrainingSpec(setup="megatron", optimizer_dtype="bf16")
        assert spec.optimizer_dtype == "training"
        assert float(cm.model_state_bytes_per_param(spec, dp)) == pytest.approx(2 + 4 + 6 / dp)
    # fp32 weights are their own master: only the moments shrink.
    assert float(cm.model_state_bytes_per_param(TrainingSpec(setup="fsdp2", optimizer_dtype="bf16"), 1)) == 4 + 4 + 4
    with pytest.raises(ConfigError, match="--optimizer-dtype: unknown precision 'fp8'"):
        TrainingSpec(optimizer_dtype="fp8")


def test_memx_run_s_embedding_and_head_are_whole_on_every_tp_rank():
    """memx-run splits the blocks by TP alone (models/adapters.py): its plans keep the embedding's and
    the head's weights, gradients and optimizer states whole on every TP rank, and time the head's
    GEMM whole with no all-gather of the logits; a vocab-parallel embedding splits all of them."""
    from memx_launch.planning.layouts import make_layout
    from memx_launch.planning.model_states import last_stage_params, parameters_per_rank

    model, cluster = get_model("llama2-7b"), _cluster()
    layout = make_layout(cluster, ("gpu",), 4, 1, ("gpu",), [[0, 1, 2, 3], [4, 5, 6, 7]])
    layers = np.array([[16, 16]])
    whole, split = (TrainingSpec(setup="memx-run", vocab_parallel_embedding=v) for v in (False, True))
    assert TrainingSpec(setup="memx-run").vocab_parallel_embedding is False
    assert TrainingSpec(setup="megatron").vocab_parallel_embedding is True
    assert (parameters_per_rank(model, whole, layout, layers) - parameters_per_rank(model, split, layout, layers)
            ).tolist() == [[model.embedding_params * 3 / 4, last_stage_params(model, 2) * 3 / 4]]
    estimates = [evaluate_layout(model, cluster, t, tp=4, pp=2, dp=1, micro_batch_size=1, references=(1, 1, 1))
                 for t in (whole, split)]
    ends = [(e.stages[0].memory_parts_gib["parameters"], e.stages[-1].memory_parts_gib["parameters"]) for e in estimates]
    assert all(w > s for w, s in zip(*ends))
    assert estimates[0].stages[-1].predicted_stage_time_s != estimates[1].stages[-1].predicted_stage_time_s


def test_with_sequence_parallelism_each_tp_rank_sends_its_shard_to_the_next_stage():
    # Megatron's pipeline tensor shape under sequence parallelism is seq / TP: each TP rank sends
    # its own shard to its peer, so a stage boundary moves 1/TP of the hidden state per rank.
    from memx_launch.planning.layouts import make_layout
    from memx_launch.planning.pipeline_sends import edge_hidden_bytes

    model, cluster = get_model("llama2-7b"), _cluster()
    layout = make_layout(cluster, ("gpu",), 4, 1, ("gpu",), [[0, 1, 2, 3], [4, 5, 6, 7]])
    whole = edge_hidden_bytes(model, TrainingSpec(), layout, 1, 2048)
    shard = edge_hidden_bytes(model, TrainingSpec(setup="megatron"), layout, 1, 2048)
    assert whole == 2048 * model.hidden_size * 2 and shard == whole / 4


def test_flash_attention_is_a_run_option():
    model = get_model("llama2-7b")
    cluster = _cluster()
    costs = []
    for flash in (True, False):
        analytical = cm.AnalyticalCostModel(model, cluster, TrainingSpec(flash_attention=flash))
        costs.append(float(analytical.layer_costs(np.zeros(1, int), np.ones(1), np.ones(1), np.full(1, 4096),
                                                  np.zeros(1)).activation_bytes[0]))
    # Without a fused kernel the softmax output (2 bytes per score) is kept: 2as^2b.
    assert costs[1] - costs[0] == pytest.approx(2 * 32 * 4096 * 4096 - 4 * 32 * 4096, rel=1e-9)


def test_dropout_masks_and_sequence_parallel():
    model = get_model("llama2-7b")
    s, h, t = 4096, 4096, 4
    base = float(cm.activation_bytes(model, 1, s, t, cm.NONE).activation_bytes)
    masks = float(cm.activation_bytes(model, 1, s, t, cm.NONE, dropout=True).activation_bytes)
    assert masks - base == pytest.approx(2 * s * h)  # two 1-byte residual masks, replicated
    sp = float(cm.activation_bytes(model, 1, s, t, cm.NONE, sequence_parallel=True).activation_bytes)
    assert base - sp == pytest.approx(8 * s * h * (1 - 1 / t))  # norms' tensors split over TP


def test_logits_in_the_training_dtype_halve_the_loss_memory():
    model = get_model("llama3-8b")
    fp32 = logits_bytes(model, 1, 8192, 1, TrainingSpec(loss_dtype="fp32"))
    bf16 = logits_bytes(model, 1, 8192, 1, TrainingSpec(loss_dtype="bf16"))
    assert fp32 == 8 * 8192 * 128256 and bf16 == fp32 / 2


def test_tied_embeddings_are_kept_on_the_last_stage():
    tied = ModelSpec("tied", 4, 1024, 8, 8, 4096, 50000, 1024, tie_embeddings=True)
    assert cm.last_stage_params(tied, 1) == tied.head_params
    assert cm.last_stage_params(tied, 2) == tied.head_params + tied.embedding_params


def test_overhead_and_fp32_peak_of_a_device_type():
    nvidia = DeviceType("a100", "nvidia", 80, 312, peak_tflops_fp32=156)
    assert nvidia.overhead_bytes == 1.25 * 2**30
    assert nvidia.communicator_bytes == 0.6 * 2**30
    assert DeviceType("cpu", "cpu", 8, 1).overhead_bytes == 0
    assert DeviceType("a", "nvidia", 80, 312, memory_overhead_gib=5).overhead_bytes == 5 * 2**30
    assert nvidia.effective_tflops_for("fp32") == pytest.approx(156 * FP32_MATMUL_SHARE)  # its own peak and share
    assert nvidia.effective_tflops_for("bf16") == nvidia.effective_tflops
    with pytest.raises(ConfigError, match="memory_overhead_gib"):
        DeviceType("a", "nvidia", 80, 312, memory_overhead_gib=90)


def test_estimate_counts_the_overhead_and_the_setup():
    model = get_model("llama2-13b")
    plans = {}
    for setup in ("ddp", "megatron", "zero3"):
        plans[setup] = evaluate_layout(model, _cluster(), TrainingSpec(global_batch_size=64, seq_len=2048, setup=setup),
                                       tp=1, pp=1, dp=8, micro_batch_size=1, references=(1.0, 1.0, 1.0))
    peak = {k: p.stages[0].predicted_peak_memory_gib for k, p in plans.items()}
    assert peak["zero3"] < peak["megatron"] < peak["ddp"]
    # ddp keeps 16 bytes per parameter whole: 13B parameters do not fit in 80 GiB.
    assert peak["ddp"] > 80 and peak["zero3"] < 80
    # The NVIDIA default (1.25 GiB) and one communicator (dp=8 is the world group) sit on top.
    overhead = ClusterSpec.from_dict({**_cluster_dict(), "device_types": {"gpu": {
        "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_overhead_gib": 0}}})
    bare = evaluate_layout(model, overhead, TrainingSpec(global_batch_size=64, seq_len=2048, setup="zero3"),
                           tp=1, pp=1, dp=8, micro_batch_size=1, references=(1.0, 1.0, 1.0))
    assert peak["zero3"] - bare.stages[0].predicted_peak_memory_gib == pytest.approx(1.25)


def test_every_communicator_a_rank_joins_holds_its_buffers():
    assert cm.communicators_per_rank(1, 1, 1) == 0
    assert cm.communicators_per_rank(1, 1, 8) == 1        # DP alone syncs on the world group
    assert cm.communicators_per_rank(8, 1, 1) == 3        # world, TP, model-parallel: same ranks, own buffers
    assert cm.communicators_per_rank(2, 2, 16) == 5       # world, TP, DP, PP, model-parallel
    model = get_model("llama2-13b")
    training = TrainingSpec(global_batch_size=64, seq_len=2048, setup="zero3")

    def peaks(tp, pp, dp):
        plan = evaluate_layout(model, _cluster(), training, tp=tp, pp=pp, dp=dp, micro_batch_size=1,
                               references=(1.0, 1.0, 1.0))
        return [s.predicted_peak_memory_gib for s in plan.stages]
    no_buffers = ClusterSpec.from_dict({**_cluster_dict(), "device_types": {"gpu": {
        "vendor": "cpu", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}}})
    bare = evaluate_layout(model, no_buffers, training, tp=2, pp=2, dp=2, micro_batch_size=1,
                           references=(1.0, 1.0, 1.0))
    # world, TP, DP, PP and model-parallel groups: 5 x 0.6 GiB, plus the 1.25 GiB process overhead, per stage.
    assert [a - b.predicted_peak_memory_gib for a, b in zip(peaks(2, 2, 2), bare.stages)] == \
        pytest.approx([5 * 0.6 + 1.25] * 2)
    # PCIe GPUs (through the host, as L4s and A10Gs): NCCL runs 2 channels where NVLink runs 24,
    # and its buffers are per channel: the same five communicators hold 2/24 of it.
    for link in ({"intra_node_gbps": 32}, {"intra_node_gbps": 300, "gpu_link": "pcie"}):
        pcie = ClusterSpec.from_dict({**_cluster_dict(), "nodes": [{"devices": {"gpu": 8}, **link}]})
        assert pcie.communicator_bytes("gpu") == pytest.approx(0.6 * 2**30 * 2 / 24)
        plan = evaluate_layout(model, pcie, training, tp=2, pp=2, dp=2, micro_batch_size=1, references=(1.0, 1.0, 1.0))
        assert [a.predicted_peak_memory_gib - b.predicted_peak_memory_gib for a, b in zip(plan.stages, bare.stages)] \
            == pytest.approx([5 * 0.6 * 2 / 24 + 1.25] * 2)
    assert _cluster().communicator_bytes("gpu") == 0.6 * 2**30  # NVLink: the measured size


def _cluster_dict():
    return {"version": 1, "device_types": {"gpu": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312,
                                                   "memory_bandwidth_gbps": 2039}},
            "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 300}]}


def _cluster():
    return ClusterSpec.from_dict(_cluster_dict())


# --------------------------------------------------------------------------- time terms


def test_collectives_pay_latency_per_step_and_bytes_per_link():
    # NCCL's model (collectives.py): a small all-reduce is latency bound (LL protocol, a few
    # microseconds per step), a large one runs at the bus bandwidth plus Simple's ring latency.
    n, gbps = 8, 100.0
    tiny = float(cm.allreduce_time(8, n, gbps))
    assert 5e-6 < tiny < 2 * (n - 1) * cm.LINK_LATENCY_S
    big = float(cm.allreduce_time(1e9, n, gbps))
    assert big == pytest.approx((8.4 + 2 * (n - 1) * 3.4) * 1e-6 + 2 * 7 / 8 * 1e9 / 100e9)
    assert float(cm.allreduce_time(1e9, 1, gbps)) == 0
    assert float(cm.p2p_time(1e6, 10.0)) == pytest.approx(cm.LINK_LATENCY_S + 1e6 / 10e9)
    assert float(cm.p2p_time(1e6, np.inf)) == 0


def test_data_parallel_volume_follows_the_setup():
    # One bucket each (no overlap_grad_reduce): the bytes decide, latency is a few microseconds.
    params, dp, gbps = 1e9, 8, 25.0
    one = dict(overlap_grad_reduce=False)
    plain = float(data_parallel_sync_time(params, TrainingSpec(**one), dp, gbps))                # fp32 all-reduce
    zero1 = float(data_parallel_sync_time(params, TrainingSpec(setup="zero1", **one), dp, gbps))  # bf16 RS + AG
    fsdp = float(data_parallel_sync_time(params, TrainingSpec(setup="zero3", **one), dp, gbps))   # 2 AG + RS, bf16
    assert zero1 == pytest.approx(plain / 2, rel=1e-3)
    assert fsdp == pytest.approx(1.5 * zero1, rel=1e-3)


def test_scaling_all_reduces_its_whole_gradients_in_fp32_and_gathers_its_16_bit_weights():
    # Aleph Alpha's optimizer (core/optimizer/allreduce.py: allreduce_tensor_in_float32) all-reduces
    # every gradient over DP, cast to fp32, then all-gathers the updated bf16 weights of each shard.
    from memx_launch.planning.collectives import bucketed_seconds

    params, dp, gbps = 1e9, 8, 25.0
    scaling = TrainingSpec(setup="scaling")
    assert scaling.fp32_allreduce and scaling.full_gradient_allreduce and not scaling.overlap_grad_reduce
    one = np.inf  # one bucket
    assert float(data_parallel_sync_time(params, scaling, dp, gbps)) == pytest.approx(
        float(bucketed_seconds("all_reduce", params * 4, one, dp, gbps)
              + bucketed_seconds("all_gather", params * 2, one, dp, gbps)))
    # Without the sharded optimizer the flag changes nothing: plain DP all-reduces anyway.
    plain = TrainingSpec(full_gradient_allreduce=True, overlap_grad_reduce=False)
    assert float(data_parallel_sync_time(params, plain, dp, gbps)) == pytest.approx(
        float(bucketed_seconds("all_reduce", params * 4, one, dp, gbps)))


def test_overlapped_gradient_reduction_hides_behind_the_last_backward():
    model, cluster = get_model("llama2-7b"), _cluster()
    times = {}
    for overlap in (False, True):
        training = TrainingSpec(global_batch_size=64, seq_len=2048, overlap_grad_reduce=overlap)
        plan = evaluate_layout(model, cluster, training, tp=1, pp=1, dp=8, micro_batch_size=1,
                               recompute="full", references=(1.0, 1.0, 1.0))
        times[overlap] = plan.predicted_iteration_time_s
        assert times[overlap] >= plan.num_microbatches * plan.stages[0].predicted_stage_time_s
    assert times[True] < times[False]


def test_small_layers_are_launch_bound_and_fp32_uses_its_peak():
    cluster = ClusterSpec.from_dict({**_cluster_dict(), "device_types": {"gpu": {
        "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "peak_tflops_fp32": 19.5,
        "memory_bandwidth_gbps": 2039}}})
    tiny = get_model("llama-tiny")
    cost = cm.AnalyticalCostModel(tiny, cluster, TrainingSpec()).layer_costs(
        np.zeros(1, int), np.ones(1), np.ones(1), np.full(1, 64), np.zeros(1))
    assert float(cost.time_s[0]) == pytest.approx(host_time.FUSED_BLOCK_HOST_S)
    model = get_model("llama2-7b")
    args = (np.zeros(1, int), np.ones(1), np.ones(1), np.full(1, 4096), np.zeros(1))
    bf16 = float(cm.AnalyticalCostModel(model, cluster, TrainingSpec()).layer_costs(*args).time_s[0])
    fp32 = float(cm.AnalyticalCostModel(model, cluster, TrainingSpec(dtype="fp32")).layer_costs(*args).time_s[0])
    # Compute bound: the ratio of the sustained rates (tensor cores' and CUDA cores' shares of their
    # peaks), less the memory-bound share.
    assert fp32 / bf16 > 0.8 * (312 * DEFAULT_EFFICIENCY) / (19.5 * FP32_MATMUL_SHARE)


def test_fp32_dropout_scores_are_two_fp32_tensors_and_a_byte_mask():
    gpt = ModelSpec("gpt", 1, 1024, 16, 16, 4096, 50000, 2048, gated_mlp=False)
    s, a = 2048, 16
    args = dict(flash_attention=False, dropout=True, attention_dropout=True)
    fp32 = float(cm.activation_bytes(gpt, 1, s, 1, cm.NONE, dtype_bytes=4, **args).activation_bytes)
    fp32_flash = float(cm.activation_bytes(gpt, 1, s, 1, cm.NONE, dtype_bytes=4, flash_attention=True,
                                           dropout=True, attention_dropout=True).activation_bytes)
    lse = 4 * a * s
    assert fp32 - fp32_flash == pytest.approx(9 * a * s * s - lse)


def test_a_fused_cross_entropy_keeps_the_16_bit_logits_and_their_gradient_only():
    model = get_model("llama3-8b")
    mbs, seq = 2, 4096
    logits = mbs * seq * model.vocab_size
    for loss_dtype in ("fp32", "bf16"):
        fused = TrainingSpec(fused_loss=True, loss_dtype=loss_dtype, vocab_parallel_loss=False)
        assert float(logits_bytes(model, mbs, seq, 4, fused)) == 4 * logits
    assert float(logits_bytes(model, mbs, seq, 4, TrainingSpec(fused_loss=True))) == logits  # vocab-parallel: 1/TP
    torch_loss = TrainingSpec(vocab_parallel_loss=False)
    assert float(logits_bytes(model, mbs, seq, 4, torch_loss)) == 14 * logits


def test_a_frameworks_host_time_is_the_least_a_layer_takes(tmp_path, capsys):
    """--host-ms-per-layer: an eager framework's host time per layer bounds small layers from
    below, their TP collectives hidden behind it; a layer whose device work is longer is unchanged."""
    from estimates import cases_rows, cluster_file

    from memx_launch.cli import main

    tiny = get_model("llama-tiny")
    small = (np.zeros(1, int), np.full(1, 2.0), np.ones(1), np.full(1, 64), np.zeros(1))  # TP 2
    fused = cm.AnalyticalCostModel(tiny, _cluster(), TrainingSpec()).layer_costs(*small).time_s[0]
    eager = cm.AnalyticalCostModel(tiny, _cluster(), TrainingSpec(host_ms_per_layer=3.0)).layer_costs(*small).time_s[0]
    assert fused == pytest.approx(host_time.FUSED_BLOCK_HOST_S) and eager == pytest.approx(3e-3)
    big = (np.zeros(1, int), np.ones(1), np.full(1, 4.0), np.full(1, 4096), np.zeros(1))
    times = [cm.AnalyticalCostModel(get_model("llama2-7b"), _cluster(), TrainingSpec(host_ms_per_layer=ms))
             .layer_costs(*big).time_s[0] for ms in (None, 3.0)]
    assert times[0] > 3e-3 and times[0] == times[1]
    setup = ["--model", "llama-tiny", "--cluster", cluster_file(tmp_path, _cluster_dict()),
             "--global-batch-size", "8", "--seq-len", "64"]
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,host_ms_per_layer\n"
                      "fused,1,1,8,1,\neager,1,1,8,1,3\n", setup)
    assert rows["eager"]["iteration_time_s"] > 10 * rows["fused"]["iteration_time_s"]
    layout = ["--tp", "1", "--pp", "1", "--dp", "8", "--micro-batch-size", "1"]
    assert main(["estimate", *setup, *layout, "--host-ms-per-layer", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--host-ms-per-layer" in err and "positive" in err
    # A cluster file states a type's host time (its nodes' CPUs), checked as the flag is.
    gpu = _cluster_dict()["device_types"]["gpu"]
    on_file = ClusterSpec.from_dict({**_cluster_dict(), "device_types": {"gpu": {**gpu, "host_ms_per_layer": 3.0}}})
    assert cm.AnalyticalCostModel(tiny, on_file, TrainingSpec()).layer_costs(*small).time_s[0] == pytest.approx(3e-3)
    with pytest.raises(ConfigError, match="device_types.gpu.host_ms_per_layer.*positive"):
        ClusterSpec.from_dict({**_cluster_dict(), "device_types": {"gpu": {**gpu, "host_ms_per_layer": -1}}})
