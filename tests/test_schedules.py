"""Pipeline schedules by physics: property tests over random (seeded) layouts.

Interleaving shrinks the bubble only (Narayanan et al. 2021, section 2.2.2); no schedule may
predict an iteration shorter than every micro-batch through the slowest stage, nor imply
more model FLOP/s than a device's peak.
"""

import numpy as np
import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning import schedules
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.optimizer_step import optimizer_step_time
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec


def test_bubble_fraction_of_equal_stages_is_narayanans():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, g, v = int(rng.integers(2, 17)), int(rng.integers(1, 257)), int(rng.choice([1, 2, 4]))
        t = float(rng.uniform(1e-3, 1.0))
        total = float(schedules.pipeline_iteration_time(np.full(p, t), np.zeros(p), g, v))
        assert total / (g * t) - 1 == pytest.approx((p - 1) / (v * g))


def test_random_stage_times_never_beat_the_slowest_stage():
    rng = np.random.default_rng(1)
    for _ in range(500):
        p, g = int(rng.integers(1, 17)), int(rng.integers(1, 513))
        t = rng.uniform(1e-3, 1.0, size=p)
        x = np.append(rng.uniform(0, 0.05, size=p - 1), 0.0)
        t_fix = float(rng.uniform(0, 0.5))
        one = float(schedules.iteration_time_1f1b(t, x, g, t_fix))
        assert one >= g * t.max() + t_fix
        for v in (2, 4):
            inter = float(schedules.iteration_time_interleaved(t, x, g, v, t_fix))
            assert inter >= g * t.max() + t_fix
            if x.max() == 0:
                assert inter <= one  # without transfers interleaving can only shrink the bubble


def _cluster(n_a, n_b=0):
    types = {"h100": {"memory_gib": 80, "peak_tflops": 989, "memory_bandwidth_gbps": 3350}}
    nodes = [{"devices": {"h100": 8}, "intra_node_gbps": 450} for _ in range(n_a // 8)]
    if n_b:
        types["a100"] = {"memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}
        nodes += [{"devices": {"a100": 8}, "intra_node_gbps": 300} for _ in range(n_b // 8)]
    return ClusterSpec.from_dict({"version": 1, "device_types": types, "nodes": nodes, "inter_node_gbps": 25})


def _stage_model_flops(model, plan, i):
    """Model FLOPs of stage i in one iteration (forward + backward, no recompute)."""
    stage = plan.stages[i]
    tokens = plan.micro_batch_size * plan.seq_len
    layer = 3 * float(cm.layer_forward_flops(model, plan.micro_batch_size, plan.seq_len, plan.tp))
    flops = stage.num_layers * layer
    if i == plan.pp - 1:
        flops += 6.0 * tokens * model.hidden_size * model.vocab_size / plan.tp
    return plan.num_microbatches * flops


@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_respect_compute_and_peak(seed):
    rng = np.random.default_rng(seed)
    model = get_model(str(rng.choice(["llama2-7b", "llama2-13b", "llama3-8b"])))
    cluster = _cluster(16, 16 if seed % 2 else 0)
    world = cluster.world_size
    for _ in range(6):
        tp = int(rng.choice([1, 2, 4, 8]))
        # A stage's tp*dp devices are of one type: 16 of each type at most.
        pp = int(rng.choice([p for p in (1, 2, 4, 8) if world // p >= tp and 16 % (world // p) == 0
                             or (world == 16 and world // p >= tp)]))
        dp = world // (tp * pp)
        mbs = int(rng.choice([1, 2, 4]))
        seq = int(rng.choice([1024, 2048, 4096]))
        g = pp * int(rng.integers(1, 9))
        training = TrainingSpec(global_batch_size=g * dp * mbs, seq_len=seq)
        schedule, v = ("interleaved", int(rng.choice([2, 4]))) if pp > 1 and rng.random() < 0.6 else ("1f1b", 1)
        plan = evaluate_layout(model, cluster, training, tp=tp, pp=pp, dp=dp, micro_batch_size=mbs,
                               recompute=str(rng.choice(cm.RECOMPUTE_LEVELS)), schedule=schedule,
                               virtual_stages=v, references=(1.0, 1.0, 1.0))
        slowest = max(s.predicted_stage_time_s for s in plan.stages)
        stage_params = [s.num_layers * model.layer_params / tp for s in plan.stages]
        stage_params[0] += model.embedding_params / tp
        stage_params[-1] += model.head_params / tp
        step = max(float(optimizer_step_time(n, training, cluster.device_type(s.device_type), dp))
                   for n, s in zip(stage_params, plan.stages))
        assert plan.predicted_iteration_time_s >= plan.num_microbatches * slowest + step
        for i, stage in enumerate(plan.stages):
            peak = cluster.device_type(stage.device_type).peak_tflops * 1e12
            assert _stage_model_flops(model, plan, i) / plan.predicted_iteration_time_s <= peak


def test_interleaving_on_8_h100_stays_within_compute():
    """The issue's case: llama2-7b, pp=8; interleaving may save the bubble, never more."""
    model, cluster = get_model("llama2-7b"), _cluster(8)
    training = TrainingSpec(global_batch_size=512, seq_len=4096)
    times = {}
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
        plan = evaluate_layout(model, cluster, training, tp=1, pp=8, dp=1, micro_batch_size=1,
                               recompute="full", schedule=schedule, virtual_stages=v,
                               references=(1.0, 1.0, 1.0))
        times[v] = plan.predicted_iteration_time_s
        compute = plan.num_microbatches * max(s.predicted_stage_time_s for s in plan.stages)
        assert times[v] >= compute
    assert times[2] < times[1]  # half the bubble saved, more than the extra transfers cost
    for v in (2, 4):
        assert times[1] / times[v] < 1 + 7 / 512  # at most the whole bubble saved


def test_overlapped_interleaved_sends_hide_behind_the_next_chunk_unless_told_they_block(tmp_path):
    """Megatron-LM's interleaved schedule overlaps its sends by default (--overlap-p2p-communication);
    its 2021 schedule, and a plan told --no-overlap-p2p-comm, waits on each. One layer a chunk at
    TP 4 on two nodes: 80 sends a micro-batch, each hidden behind a layer's compute."""
    from memx_launch.planning.exporters import megatron_args

    model, cluster = get_model("llama2-70b"), _cluster(16)
    plans = {}
    for overlap in (True, False):
        training = TrainingSpec(global_batch_size=128, seq_len=4096, setup="megatron", overlap_p2p_comm=overlap)
        plans[overlap] = evaluate_layout(model, cluster, training, tp=4, pp=4, dp=1, micro_batch_size=1,
                                         schedule="interleaved", virtual_stages=20, references=(1.0, 1.0, 1.0))
    hidden, blocking = plans[True], plans[False]
    assert hidden.predicted_iteration_time_s < blocking.predicted_iteration_time_s
    compute = hidden.num_microbatches * max(s.predicted_stage_time_s for s in hidden.stages)
    assert compute <= hidden.predicted_iteration_time_s < compute * (1 + 3 / (20 * hidden.num_microbatches) + 0.02)
    assert "--no-overlap-p2p-communication" in megatron_args(blocking).args
    assert "--no-overlap-p2p-communication" not in megatron_args(hidden).args
