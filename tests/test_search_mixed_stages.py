"""`memx plan --mixed-stages`: a stage at a boundary between device types takes its DP replicas
from both, where tp x dp divides the world but not every type's count. No torch."""

import pytest
import yaml

from memx_launch.cli import main
from memx_launch.planning.estimate import evaluate_plan, plan_training
from memx_launch.planning.layouts import MIXED_SEPARATOR, enumerate_layouts
from memx_launch.planning.search import SearchSpace, search
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

# Six fast, small devices and two slow, big ones: dp = 4 fits neither count alone.
CLUSTER_DICT = {
    "version": 1, "name": "six-and-two",
    "device_types": {"fast": {"vendor": "nvidia", "memory_gib": 24, "peak_tflops": 312},
                     "big": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 125}},
    "nodes": [{"devices": {"fast": 6, "big": 2}, "intra_node_gbps": 300}]}
CLUSTER = ClusterSpec.from_dict(CLUSTER_DICT)
MODEL = get_model("llama2-7b")
TRAINING = TrainingSpec(global_batch_size=64, seq_len=2048, setup="megatron")


def test_spanning_layouts_come_after_the_others_and_keep_tp_groups_inside_a_type():
    names = tuple(d.name for d in CLUSTER.device_types)
    plain = enumerate_layouts(MODEL, CLUSTER, names)
    both = enumerate_layouts(MODEL, CLUSTER, names, mixed_stages=True)
    assert len(both) > len(plain)
    extra = both[len(plain):]
    assert all(lay.mixed for lay in extra) and not any(lay.mixed for lay in plain)
    types = CLUSTER.rank_device_types()
    for lay in extra:
        assert sorted(r for stage in lay.stage_ranks for r in stage) == list(range(CLUSTER.world_size))
        for stage in lay.stage_ranks:
            assert len(stage) == lay.tp * lay.dp
            for j in range(0, len(stage), lay.tp):  # each TP group on one device type
                assert len({types[r] for r in stage[j:j + lay.tp]}) == 1


def test_search_finds_mixed_plans_that_estimate_again_to_the_same_numbers():
    space = SearchSpace(mixed_stages=True, micro_batch_sizes=(1, 2), schedules=("1f1b",))
    # The paper's profile ranks every feasible plan (the default bounds the pick to 5% of the fastest).
    result = search(MODEL, CLUSTER, TRAINING, space=space, top_k=200, objective="default")
    mixed = [p for p in result.plans if any(MIXED_SEPARATOR in s.device_type for s in p.stages)]
    assert mixed, "no plan with a stage on two device types"
    for plan in mixed[:3]:
        again = evaluate_plan(plan, CLUSTER, plan_training(plan))
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s, rel=1e-9)
        assert [s.predicted_peak_memory_gib for s in again.stages] == pytest.approx(
            [s.predicted_peak_memory_gib for s in plan.stages], rel=1e-6)
        # Every stage fits on each of its device types (the stage's peak is its fullest type's).
        assert all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in plan.stages)
    plain = search(MODEL, CLUSTER, TRAINING, space=SearchSpace(micro_batch_sizes=(1, 2), schedules=("1f1b",)),
                   top_k=200)
    assert not any(MIXED_SEPARATOR in s.device_type for p in plain.plans for s in p.stages)


def test_memx_plan_flag(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER_DICT))
    code = main(["plan", "--model", "llama2-7b", "--cluster", str(path), "--mixed-stages", "--setup", "megatron",
                 "--global-batch-size", "64", "--seq-len", "2048", "--micro-batch-sizes", "1",
                 "--schedules", "1f1b", "--quiet", "--top", "50", "--objective", "default", "--tp", "2", "--pp", "2"])
    out = capsys.readouterr().out
    # TP 2 x DP 2 stages on six fast and two big devices: one stage must take replicas of both.
    assert code == 0 and ("fast+big" in out or "big+fast" in out), out


def test_spanning_layouts_take_cp_degrees_with_each_replica_inside_a_type():
    names = tuple(d.name for d in CLUSTER.device_types)
    both = enumerate_layouts(MODEL, CLUSTER, names, mixed_stages=True, cps=(1, 2))
    spanning = [lay for lay in both if lay.mixed]
    assert {lay.cp for lay in spanning} == {1, 2}
    types = CLUSTER.rank_device_types()
    for lay in (lay for lay in spanning if lay.cp == 2):
        for stage in lay.stage_ranks:
            width = lay.tp * lay.cp
            assert len(stage) == width * lay.dp
            assert all(len({types[r] for r in stage[j:j + width]}) == 1 for j in range(0, len(stage), width))


def test_search_finds_mixed_cp_plans_that_estimate_again_to_the_same_numbers():
    # tp x cp must divide both counts (six and two): CP 2 at TP 1, so a model that fits there.
    small = ModelSpec("llama-1b", 16, 2048, 16, 16, 5504, 32000, 2048)
    space = SearchSpace(mixed_stages=True, micro_batch_sizes=(1,), schedules=("1f1b",), cp_degrees=(2,))
    result = search(small, CLUSTER, TRAINING, space=space, top_k=200, objective="default")
    mixed = [p for p in result.plans if any(MIXED_SEPARATOR in s.device_type for s in p.stages)]
    assert mixed and all(p.cp == 2 for p in result.plans)
    for plan in mixed[:2]:
        again = evaluate_plan(plan, CLUSTER, plan_training(plan))
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s, rel=1e-9)
        assert [s.predicted_peak_memory_gib for s in again.stages] == pytest.approx(
            [s.predicted_peak_memory_gib for s in plan.stages], rel=1e-6)
