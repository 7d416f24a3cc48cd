"""The analytical cost model against the formulas it implements."""

import numpy as np
import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning import schedules
from memx_launch.planning.loss import logits_bytes
from memx_launch.planning.tp_links import tp_link_gbps
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B, the case of Korthikanti et al. Table 2


def korthikanti_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    """The paper's per-layer activation bytes for a GPT block (fp16, dropout, GELU 4h MLP).

    none: sbh(10 + 24/t + 5as/(ht)); with sequence parallel: (sbh/t)(34 + 5as/h);
    selective drops the 5as/h attention term; full keeps only the 2sbh layer input.
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


@pytest.mark.parametrize("t, sp, recompute, per_sbh", [
    (1, False, "none", 34 + 5 * A * S / H),
    (8, False, "none", 10 + 24 / 8 + 5 * A * S / (H * 8)),
    (8, True, "none", (34 + 5 * A * S / H) / 8),
    (8, True, "selective", 34 / 8),
    (8, False, "full", 2),
    (8, True, "full", 2 / 8),
])
def test_korthikanti_reference_values(t, sp, recompute, per_sbh):
    """The paper's Table 2 values, from its formula and from memx's model of the GPT block. memx's
    selective level also recomputes the MLP's GELU (Megatron's selective granularity today), so
    it keeps the GELU's input, 8 sbh / t, less than the paper's."""
    assert korthikanti_activation_bytes(S, B, H, A, t, sp, recompute) == pytest.approx(per_sbh * S * B * H)
    gpt = ModelSpec("gpt", 1, H, A, A, 4 * H, 50000, S, gated_mlp=False)
    level = {"none": cm.NONE, "selective": cm.SELECTIVE, "full": cm.FULL}[recompute]
    memx = cm.activation_bytes(gpt, B, S, t, level, flash_attention=False, sequence_parallel=sp, dropout=True,
                               attention_dropout=True).activation_bytes
    gelu_input = 8 / t if recompute == "selective" else 0.0
    assert float(memx) == pytest.approx((per_sbh - gelu_input) * S * B * H)


def test_llama_formula_reduces_to_korthikanti_for_a_gpt_block():
    """A GELU 4h MLP, full MHA, unfused attention and dropout on is the Korthikanti block;
    without dropout its three masks (two sbh, one as^2b) and the dropout output (2as^2b) go."""
    gpt = ModelSpec("gpt", 1, H, A, A, 4 * H, 50000, S, gated_mlp=False)
    for t in (1, 2, 8):
        for sp in (False, True):
            korthikanti = korthikanti_activation_bytes(S, B, H, A, t, sp)
            with_dropout = cm.activation_bytes(gpt, B, S, t, cm.NONE, flash_attention=False,
                                               sequence_parallel=sp, dropout=True,
                                               attention_dropout=True).activation_bytes
            assert float(with_dropout) == pytest.approx(korthikanti)
            without = cm.activation_bytes(gpt, B, S, t, cm.NONE, flash_attention=False,
                                          sequence_parallel=sp).activation_bytes
            dropout = 2 * S * B * H / (t if sp else 1) + 3 * A * S * S * B / t
            assert float(without) == pytest.approx(korthikanti - dropout)


def test_a_relu_mlp_keeps_its_output_only():
    """ReLU's backward needs only its output, which fc2 keeps as its input: one tensor of the MLP's
    width where GELU keeps its input too; with quantized linears fc2 keeps its own FP8 copy beside
    it, as it does beside GELU's output. OPT's MLP is ReLU; a gated ReLU is refused."""
    import dataclasses

    from memx_launch.errors import ConfigError

    gelu = ModelSpec("gpt", 1, H, A, A, 4 * H, 50000, S, gated_mlp=False)
    relu = dataclasses.replace(gelu, relu_mlp=True)
    for t, level in ((1, cm.NONE), (4, cm.NONE), (2, cm.SELECTIVE)):
        kept = [float(cm.activation_bytes(m, B, S, t, level, 2, flash_attention=True).activation_bytes)
                for m in (gelu, relu)]
        assert kept[0] - kept[1] == pytest.approx(S * B * 4 * H * 2 / t), (t, level)
        fp8 = [float(cm.activation_bytes(m, B, S, t, level, 2, flash_attention=True, quantized_bytes=1.0)
                     .activation_bytes) for m in (gelu, relu)]
        assert fp8[0] == pytest.approx(fp8[1])
    assert get_model("opt-350m").relu_mlp and not get_model("gpt-neo-2.7b").relu_mlp
    with pytest.raises(ConfigError, match="model.relu_mlp: set with gated_mlp"):
        dataclasses.replace(gelu, gated_mlp=True, relu_mlp=True)
    with pytest.raises(ConfigError, match="model.tanh_gelu_ops: set with a gated or ReLU MLP"):
        dataclasses.replace(relu, tanh_gelu_ops=True)


def test_recompute_levels_order_memory_and_time():
    model = get_model("llama2-7b")
    act = cm.activation_bytes(model, 1, 4096, 1, np.array([0, 1, 2])).activation_bytes
    assert act[0] > act[1] > act[2]
    assert act[2] == 2 * 4096 * 4096
    cluster_model = cm.AnalyticalCostModel(model, _one_device_cluster(), TrainingSpec())
    cost = cluster_model.layer_costs(np.zeros(3, int), np.ones(3), np.ones(3), np.full(3, 4096), np.arange(3))
    assert cost.time_s[0] < cost.time_s[1] < cost.time_s[2]
    # Full recompute redoes one forward: about 4/3 of the time of none.
    assert cost.time_s[2] / cost.time_s[0] == pytest.approx(4 / 3, rel=0.1)


def test_gqa_shrinks_stored_keys_and_values():
    mha = get_model("llama2-7b")
    gqa = ModelSpec("gqa", 32, 4096, 32, 8, 11008, 32000, 4096)
    a_mha = cm.activation_bytes(mha, 1, 4096, 1, cm.NONE).activation_bytes
    a_gqa = cm.activation_bytes(gqa, 1, 4096, 1, cm.NONE).activation_bytes
    # K and V drop from 4sbh to 1sbh.
    assert float(a_mha - a_gqa) == pytest.approx(3 * 4096 * 4096)


def test_model_state_bytes():
    assert cm.model_state_bytes_per_param(TrainingSpec(), 1) == 18
    assert cm.model_state_bytes_per_param(TrainingSpec(distributed_optimizer=True), 8) == 6 + 12 / 8
    assert cm.model_state_bytes_per_param(TrainingSpec(dtype="fp32"), 1) == 16
    assert cm.model_state_bytes_per_param(TrainingSpec(fully_sharded=True), 8) == 16 / 8


def test_inflight_microbatches_1f1b_and_interleaved():
    assert schedules.inflight_microbatches(np.arange(4), 4, 8).tolist() == [4, 3, 2, 1]
    assert schedules.inflight_microbatches(np.arange(4), 4, 2).tolist() == [2, 2, 2, 1]
    assert float(schedules.inflight_microbatches(0, 4, 8, 2)) == pytest.approx(4 * (1 + 3 / 8))
    # later ranks of an interleaved pipeline: (v-1) P + 2 (P-1-i) + 1 chunks, each 1/v of the stage
    assert schedules.inflight_microbatches(np.arange(4), 4, 8, 2).tolist() == [5.5, 4.5, 3.5, 2.5]
    assert schedules.inflight_microbatches(np.arange(4), 4, 4, 2).tolist() == [4, 4, 3.5, 2.5]  # at most G


def test_iteration_time_equations():
    t = np.array([[1.0, 2.0, 1.5]])
    pp = np.array([[0.1, 0.1, 0.0]])
    # Equation 3 plus the blocking sends of the bottleneck stage on every other micro-batch:
    # e = t + x_prev + x_next = (1.1, 2.2, 1.6).
    assert schedules.iteration_time_1f1b(t, pp, 8, 0.5, 0.25)[0] == pytest.approx(7 * 2.2 + 4.9 + 0.75)
    # Interleaving divides only the bubble; the transfers happen v times, each behind the next
    # chunk's compute (0.2 s of sends against chunks of 0.5-1 s: all hidden) ...
    v = 2
    assert schedules.iteration_time_interleaved(t, pp, 8, v, 0.5, 0.25)[0] == pytest.approx(
        8 * 2.0 + (4.5 - 2.0) / v + 0.75)
    # ... unless an edge blocks (a bridge between domains): its sends are paid whole, v times.
    e = np.array([1.2, 2.4, 1.7])
    assert schedules.iteration_time_interleaved(t, pp, 8, v, 0.5, 0.25, overlapped=False)[0] == pytest.approx(
        8 * 2.4 + (e.sum() - 2.4) / v + 0.75)
    # Sends longer than a chunk's compute show beyond it: stage 1's 0.6 + 0.6 s against 1 s.
    slow = np.array([[0.6, 0.6, 0.0]])
    e = np.array([1.0 + 2 * max(0.6 - 0.5, 0), 2.0 + 2 * (1.2 - 1.0), 1.5 + 2 * max(0.6 - 0.75, 0)])
    assert schedules.iteration_time_interleaved(t, slow, 8, v)[0] == pytest.approx(
        8 * e.max() + (e.sum() - e.max()) / v)


def _one_device_cluster():
    from memx_launch.specs.cluster import ClusterSpec
    return ClusterSpec.from_dict({"version": 1, "device_types": {
        "gpu": {"memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 300}]})


def test_tp_link_depends_on_the_group_size_through_numa_domains():
    from memx_launch.specs.cluster import ClusterSpec
    cluster = ClusterSpec.from_dict({"version": 1, "device_types": {"gpu": {"memory_gib": 32, "peak_tflops": 100}},
                                     "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 17, "numa_domains": 2,
                                                "cross_numa_gbps": 12}]})
    # PCIe-class links: collectives stage through the host (PCIE_STAGED_SHARE of each link).
    from memx_launch.specs.node import PCIE_STAGED_SHARE
    assert [tp_link_gbps(cluster, "gpu", t) for t in (2, 4, 8)] == pytest.approx(
        [17 * PCIE_STAGED_SHARE, 17 * PCIE_STAGED_SHARE, 12 * PCIE_STAGED_SHARE])
    model = cm.AnalyticalCostModel(get_model("llama2-7b"), cluster, TrainingSpec())
    t4, t8 = model.layer_costs(np.zeros(2, int), np.array([4, 8]), np.ones(2), np.full(2, 4096), np.zeros(2)).time_s
    # TP 8 halves the compute but its all-reduces cross the slower link.
    assert model.tp_gbps(np.zeros(2, int), np.array([4, 8])).tolist() == pytest.approx(
        [17 * 0.8 * PCIE_STAGED_SHARE, 12 * 0.8 * PCIE_STAGED_SHARE])
    assert t8 > t4 / 2


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["logits", "soft-capped logits"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_cross_entropy_peak_per_logit_is_what_the_guard_measures(dtype, softcap):
    """memx-run's loss (torch's cross entropy on the whole vocabulary) at its peak, in the
    log-softmax's backward: the logits, the log-softmax, and both gradients of the backward, and
    where the logits are soft-capped first (Gemma 2 and 3, models/hf_decoder.py), the tanh's
    output kept for its backward; the emulated guard counts live tensor bytes exactly."""
    import torch

    from memx_launch.runtime.batches import default_loss
    from memx_launch.profiling.emulation import EmulatedDevice

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    from memx_launch.models.hf_decoder import LogitTransform

    model = ModelSpec("head-only", 1, 64, 4, 4, 128, 4096, 64, logit_softcapping=softcap is not None)
    training = TrainingSpec(dtype=dtype, vocab_parallel_loss=False)
    transform = LogitTransform(1.0, 1.0, softcap) if softcap else torch.nn.Identity()
    mbs, seq = 4, 64
    head = torch.nn.Linear(model.hidden_size, model.vocab_size, bias=False).to(torch_dtype)
    hidden = torch.randn(mbs, seq, model.hidden_size, dtype=torch_dtype)
    targets = torch.randint(0, model.vocab_size, (mbs, seq))
    device = EmulatedDevice("x", 1.0)
    device.track([*head.parameters(), hidden, targets])
    device.reset_peak()
    before = device.live_bytes
    with device:
        logits = transform(head(hidden))  # the pipeline keeps a stage's output until its backward
        default_loss(logits, targets).backward()
    measured = device.peak_bytes - before
    assert measured == pytest.approx(float(logits_bytes(model, mbs, seq, 1, training)), rel=0.01)


def test_heads_wider_than_hidden_over_heads_widen_attention_not_the_residual_stream():
    # Gemma-7B's shape: 16 heads of 256 on a 3,072-wide residual stream (queries 4,096 wide).
    import dataclasses

    narrow = ModelSpec("g", 28, 3072, 16, 16, 24576, 256000, 4096)
    wide = dataclasses.replace(narrow, attention_head_dim=256)
    ratio = wide.q_hidden_size / narrow.q_hidden_size
    assert float(cm.causal_attention_flops(wide, 1, 4096, 1)) == pytest.approx(
        ratio * float(cm.causal_attention_flops(narrow, 1, 4096, 1)))
    assert wide.attention_params == pytest.approx(ratio * narrow.attention_params)
    # Q, the attention output, K and V (16 KV heads) are kept 1,024 wider each, 2 bytes a value;
    # the norms' inputs and the MLP's are not.
    kept = [float(cm.activation_bytes(m, 1, 4096, 1, cm.NONE).activation_bytes) for m in (narrow, wide)]
    assert kept[1] - kept[0] == pytest.approx(4096 * 2 * (1 + 1 + 2) * (4096 - 3072), rel=1e-9)


def test_a_checkpoint_that_stops_early_skips_the_last_linear_and_its_collective():
    """``checkpoint_early_stop`` (torch's non-reentrant checkpoint): a full recompute skips the
    block's last linear and the TP collective after it (half an all-reduce with SP, a reduce-
    scatter); the other levels and a mixture of experts' blocks are as before."""
    from memx_launch.specs.cluster import ClusterSpec

    cluster = ClusterSpec.from_dict({"version": 1, "device_types": {"h100": {
        "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "memory_bandwidth_gbps": 3350}},
        "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]})
    model = get_model("llama2-7b")
    levels = np.array([cm.NONE, cm.SELECTIVE, cm.FULL])
    def costs(spec=model, **options):
        costed = cm.AnalyticalCostModel(spec, cluster, TrainingSpec(**options))
        time = costed.layer_costs(np.zeros(3, int), np.full(3, 4), np.ones(3), np.full(3, 4096), levels).time_s
        return costed.tp_allreduces(levels), time
    (whole, whole_s), (stops, stops_s) = costs(), costs(checkpoint_early_stop=True)
    assert list(whole - stops) == [0, 0, 1] and list(whole_s[:2]) == list(stops_s[:2])
    assert 0 < whole_s[2] - stops_s[2] < whole_s[2] - whole_s[0]  # less than the whole recompute
    sp_whole, sp_stops = costs(sequence_parallel=True)[0], costs(sequence_parallel=True, checkpoint_early_stop=True)[0]
    assert list(sp_whole - sp_stops) == [0, 0, 0.5]
    mixture = get_model("mixtral-8x7b")
    assert list(costs(mixture)[0]) == list(costs(mixture, checkpoint_early_stop=True)[0])
