"""Every parallel form trains on the emulated cluster (examples/clusters/cpu-emulated.yaml,
llama-tiny) within BOUND times the step time memx predicts for it (the analytical model of memx plan
and memx estimate), all forms in one 4-rank gloo launch. Before the emulation stopped charging
collective waits as compute (issue 22), TP plans never finished a step."""

import os

import pytest
import torch

from ranks import spawn_ranks

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "cpu-emulated.yaml")
# One layout per form (memx estimate's arguments), near what memx's search picks when restricted to
# the form (it finds no interleaved plan here) but with memory to spare: the analytical model's
# peaks are a few MiB short on the small device, which the emulated guard would refuse. The
# cluster's two device types, two devices each, cannot hold TP 2 in one stage of all 4 ranks (a
# stage has one type): TP 2 runs as TP 2 x PP 2.
FORMS = {
    "tp2 x pp2": dict(tp=2, pp=2, dp=1, micro_batch_size=8, stage_devices=["slow-big", "fast-small"],
                      layers_per_stage=[3, 5], recompute=["none", "full"]),
    "pp4": dict(tp=1, pp=4, dp=1, micro_batch_size=4,
                stage_devices=["slow-big", "slow-big", "fast-small", "fast-small"],
                layers_per_stage=[1, 1, 3, 3], recompute=["none", "none", "full", "full"]),
    "dp2 x pp2": dict(tp=1, pp=2, dp=2, micro_batch_size=4, stage_devices=["slow-big", "fast-small"],
                      layers_per_stage=[3, 5], recompute=["none", "full"]),
    "interleaved pp4 v2": dict(tp=1, pp=4, dp=1, micro_batch_size=4, schedule="interleaved", virtual_stages=2,
                               stage_devices=["slow-big", "slow-big", "fast-small", "fast-small"],
                               layers_per_stage=[2, 2, 2, 2], recompute=["none", "none", "full", "full"]),
    "tp2 x pp2 interleaved v2": dict(tp=2, pp=2, dp=1, micro_batch_size=8, schedule="interleaved", virtual_stages=2,
                                     stage_devices=["slow-big", "fast-small"], layers_per_stage=[4, 4],
                                     recompute=["none", "full"]),
}
# The first step also builds what later steps reuse (DTensor's sharding caches, DDP's buckets); of
# the later ones the fastest is judged, as other jobs on a shared CI machine slow single steps.
STEPS = 3
# The target is 3x (quiet runs: 2.2x at worst); a 2-core machine shared with another
# 4-process job measured 4.3x. The bound catches what it guards against, waits charged as compute,
# which grew every step past 20x; the 3x target belongs in a benchmark, not a unit test.
BOUND = 6.0


def _plans():
    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.model import get_model
    from memx_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.from_yaml(CLUSTER)
    training = TrainingSpec(global_batch_size=16, seq_len=64, dtype="fp32")  # memx-run's defaults for it
    plans = {name: evaluate_layout(get_model("llama-tiny"), cluster, training, references=(1, 1, 1), **layout)
             for name, layout in FORMS.items()}
    assert all(stage.predicted_peak_memory_gib < 0.8 * stage.memory_capacity_gib  # the guard refuses more
               for plan in plans.values() for stage in plan.stages)
    return cluster, plans


def _worker(rank, port, queue):
    import torch.distributed as dist
    from memx_launch.planning.report import layout_summary
    from memx_launch.runtime.emulation import device_for_rank
    from memx_launch.runtime.layout import process_rank
    from memx_launch.runtime.training import Runtime

    torch.set_num_threads(1)  # 4 ranks on a 2-core CI machine
    results = {}
    try:
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0)
        cluster, plans = _plans()
        for name, plan in plans.items():
            # Each plan orders the stages its own way: a process group per form, ranked as memx-run ranks it.
            dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=process_rank(plan, rank),
                                    world_size=4)
            runtime = Runtime(plan, rank, emulated=device_for_rank(cluster, rank))
            tokens = torch.randint(0, plan.model_spec.vocab_size, (plan.global_batch_size, plan.seq_len + 1),
                                   generator=torch.Generator().manual_seed(0))
            times = [runtime.step(runtime.local_batch(tokens[:, :-1]), runtime.local_batch(tokens[:, 1:])).step_time_s
                     for _ in range(STEPS)]
            results[name] = (layout_summary(plan), plan.predicted_iteration_time_s, times)
            dist.destroy_process_group()
    finally:
        queue.put((rank, results))


@pytest.mark.slow
def test_every_parallel_form_trains_within_a_bound_of_its_predicted_step_time():
    results = spawn_ranks(_worker, 4, timeout=300)[0]
    assert list(results) == list(FORMS)
    for name, (layout, predicted, times) in results.items():
        print(f"{name}: {layout}: steps {', '.join(f'{t:.2f}' for t in times)} s, predicted {predicted:.2f} s")
    slow = {name: f"{min(times[1:]):.2f} s is {min(times[1:]) / predicted:.1f}x the predicted {predicted:.2f} s "
            f"({layout})" for name, (layout, predicted, times) in results.items()
            if min(times[1:]) > BOUND * predicted}
    assert not slow, slow
