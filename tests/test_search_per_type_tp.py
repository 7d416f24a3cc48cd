"""`memx plan --per-type-tp`: each device type its own TP degree in the search. No torch."""

import os
from collections import Counter

import pytest

from memx_launch.cli import main
from memx_launch.planning.estimate import evaluate_plan, plan_training
from memx_launch.planning.layouts import enumerate_layouts
from memx_launch.planning.search import SearchSpace, search
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
TABLE1 = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
MODEL = get_model("llama2-7b")


def test_per_type_layouts_keep_one_degree_per_type_and_the_uniform_ones_first():
    names = tuple(d.name for d in TABLE1.device_types)
    uniform = enumerate_layouts(MODEL, TABLE1, names)
    both = enumerate_layouts(MODEL, TABLE1, names, per_type_tp=True)
    key = lambda lay: (tuple(lay.stage_tp), lay.dp, lay.order, tuple(map(tuple, lay.stage_ranks)))
    assert [key(x) for x in both[:len(uniform)]] == [key(x) for x in uniform]
    mixed = both[len(uniform):]
    assert mixed and all(not lay.uniform_tp for lay in mixed)
    ranks = TABLE1.rank_device_types()
    for lay in both:
        assert sum(lay.stage_tp) * lay.dp == TABLE1.world_size
        assert sorted(r for s in lay.stage_ranks for r in s) == list(range(TABLE1.world_size))
        degree_of = {}
        for stage, tp in zip(lay.stage_ranks, lay.stage_tp):
            assert len(stage) == tp * lay.dp and len({ranks[r] for r in stage}) == 1
            assert degree_of.setdefault(ranks[stage[0]], tp) == tp  # one degree per type
    # --tp keeps meaning "only these degrees".
    only = enumerate_layouts(MODEL, TABLE1, names, tps=[1, 2], per_type_tp=True)
    assert {int(t) for lay in only for t in lay.stage_tp} == {1, 2}
    assert any(not lay.uniform_tp for lay in only)


def test_search_ranks_per_type_tp_plans_that_estimate_again_to_the_same_numbers():
    space = SearchSpace(per_type_tp=True, micro_batch_sizes=(1, 2), schedules=("1f1b",))
    training = TrainingSpec(global_batch_size=64, seq_len=2048)
    result = search(MODEL, TABLE1, training, space=space, top_k=50)
    per_stage = [p for p in result.plans if p.stage_tp is not None]
    assert per_stage, "no plan with per-type TP among the top 50"
    for plan in per_stage[:3]:
        by_type = Counter((s.device_type, t) for s, t in zip(plan.stages, plan.stage_tp))
        assert len({d for d, _ in by_type}) == len(by_type)  # one degree per device type
        again = evaluate_plan(plan, TABLE1, plan_training(plan))
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s, rel=1e-9)
        assert [s.predicted_peak_memory_gib for s in again.stages] == pytest.approx(
            [s.predicted_peak_memory_gib for s in plan.stages], rel=1e-6)
    # Without the flag (memx-run's searches, and the default) every plan has one degree.
    plain = search(MODEL, TABLE1, training, space=SearchSpace(micro_batch_sizes=(1, 2), schedules=("1f1b",)),
                   top_k=50)
    assert all(p.stage_tp is None for p in plain.plans)
    # A larger space can only find a plan at least as good by time alone.
    fastest = lambda r: min(p.predicted_iteration_time_s for p in r.plans)
    t_space = SearchSpace(per_type_tp=True, micro_batch_sizes=(1, 2), schedules=("1f1b",))
    t_plain = SearchSpace(micro_batch_sizes=(1, 2), schedules=("1f1b",))
    assert fastest(search(MODEL, TABLE1, training, space=t_space, weights=(1, 0, 0), top_k=1)) <= fastest(
        search(MODEL, TABLE1, training, space=t_plain, weights=(1, 0, 0), top_k=1)) * (1 + 1e-12)


def test_memx_plan_flag(capsys):
    code = main(["plan", "--model", "llama2-7b", "--cluster", os.path.join(CLUSTERS, "table1-2vendor.yaml"),
                 "--per-type-tp", "--tp", "2,4", "--micro-batch-sizes", "1", "--schedules", "1f1b", "--quiet",
                 "--top", "20"])
    out = capsys.readouterr().out
    assert code == 0 and "tp=" in out
    degrees = {t for line in out.splitlines() if " tp=" in line for t in line.split("tp=")[1].split()[0].split("|")}
    assert degrees <= {"2", "4"}
