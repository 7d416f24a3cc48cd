"""Heterogeneous stages in `memx estimate`: each stage its own TP degree, and a stage whose DP
replicas sit on several device types. No torch."""

import json

import numpy as np
import pytest

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.layouts import layout_from_stage_devices, parse_stage_devices
from memx_launch.planning.plan import Plan
from memx_launch.runtime.layout import process_rank, rank_layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
TYPES = {"x": {"memory_gib": 32, "peak_tflops": 300, "efficiency": 0.25, "flash_attention": False},
         "y": {"memory_gib": 64, "peak_tflops": 256, "efficiency": 0.35}}


def cluster(x: int, y: int) -> ClusterSpec:
    """x devices of type x on one node, y of type y on another (8 per node at most)."""
    return ClusterSpec.from_dict({"version": 1, "name": f"x{x}y{y}", "device_types": TYPES,
                                  "nodes": [{"name": "xn", "devices": {"x": x}, "intra_node_gbps": 64},
                                            {"name": "yn", "devices": {"y": y}, "intra_node_gbps": 56}],
                                  "inter_node_gbps": 25})


def estimate(c, layers=(16, 16), recompute="full", mbs=1, **kwargs):
    training = TrainingSpec(global_batch_size=64, seq_len=MODEL.seq_len)
    return evaluate_layout(MODEL, c, training, micro_batch_size=mbs, layers_per_stage=list(layers),
                           recompute=recompute, references=(1.0, 1.0, 1.0), **kwargs)


def stage_numbers(plan, i):
    s = plan.stages[i]
    return s.predicted_peak_memory_gib, s.predicted_stage_time_s


def test_equal_stage_tp_is_exactly_the_uniform_estimate():
    c = cluster(8, 8)
    uniform = estimate(c, tp=2, pp=2, dp=4)
    per_stage = estimate(c, tp=None, stage_tp=[2, 2], pp=2, dp=4)
    assert per_stage.tp == 2 and per_stage.stage_tp is None
    assert per_stage.predicted_iteration_time_s == pytest.approx(uniform.predicted_iteration_time_s, rel=1e-9)
    for a, b in zip(uniform.stages, per_stage.stages):
        assert b.predicted_peak_memory_gib == pytest.approx(a.predicted_peak_memory_gib, rel=1e-9)
        assert b.predicted_stage_time_s == pytest.approx(a.predicted_stage_time_s, rel=1e-9)


def test_each_stage_is_costed_at_its_own_tp():
    """Stage 0 at TP 4 and stage 1 at TP 2 (dp 2, 12 devices) cost what the same stage costs
    in a uniform layout of its degree (same dp, split and device type)."""
    mixed = estimate(cluster(8, 4), tp=None, stage_tp=[4, 2], pp=2, dp=2)
    tp4 = estimate(cluster(8, 8), tp=4, pp=2, dp=2)
    tp2 = estimate(cluster(4, 4), tp=2, pp=2, dp=2)
    assert mixed.stage_tp == [4, 2] and mixed.tp is None and mixed.world_size == 12
    assert [len(s.ranks) for s in mixed.stages] == [8, 4]
    assert stage_numbers(mixed, 0) == pytest.approx(stage_numbers(tp4, 0), rel=1e-9)
    assert stage_numbers(mixed, 1) == pytest.approx(stage_numbers(tp2, 1), rel=1e-9)
    # The larger TP degree holds less model state and takes a different time per layer.
    assert mixed.stages[0].predicted_peak_memory_gib < tp2.stages[0].predicted_peak_memory_gib
    assert mixed.stages[0].predicted_stage_time_s != pytest.approx(tp2.stages[0].predicted_stage_time_s)
    # The iteration is no faster than its slowest stage allows.
    g = mixed.num_microbatches
    assert mixed.predicted_iteration_time_s >= g * max(s.predicted_stage_time_s for s in mixed.stages)


def test_stage_tp_that_does_not_use_the_cluster_is_one_line():
    with pytest.raises(ConfigError, match=r"--stage-tp/--dp: sum\(stage_tp\)\*dp = 24 but the cluster has 16"):
        estimate(cluster(8, 8), tp=None, stage_tp=[4, 2], pp=2, dp=4)
    with pytest.raises(ConfigError, match="--stage-tp: 3 degrees for pp=2"):
        estimate(cluster(8, 8), tp=None, stage_tp=[4, 2, 2], pp=2, dp=2)
    with pytest.raises(ConfigError, match="--stage-tp: 3 does not divide"):
        estimate(cluster(8, 4), tp=None, stage_tp=[3, 3], pp=2, dp=2)


def test_a_stage_on_two_device_types_runs_at_the_slower_and_fits_only_on_both():
    c = cluster(8, 8)
    both = ["x+y", "x+y"]
    mixed = estimate(c, tp=4, pp=2, dp=2, stage_devices=both)
    on_x = estimate(c, tp=4, pp=2, dp=2, stage_devices=["x", "y"])
    on_y = estimate(c, tp=4, pp=2, dp=2, stage_devices=["y", "x"])
    assert [s.device_type for s in mixed.stages] == both
    assert mixed.stages[0].ranks == [0, 1, 2, 3, 8, 9, 10, 11]
    slowest = max(on_x.stages[0].predicted_stage_time_s, on_y.stages[0].predicted_stage_time_s)
    assert mixed.stages[0].predicted_stage_time_s == pytest.approx(slowest, rel=1e-9)
    # Memory: the type nearest its capacity (x, 32 GiB) is the one reported.
    assert mixed.stages[0].memory_capacity_gib == 32
    assert mixed.stages[0].predicted_peak_memory_gib == pytest.approx(on_x.stages[0].predicted_peak_memory_gib)
    # Its DP all-reduce crosses nodes: never faster than the single-type layouts.
    assert mixed.predicted_iteration_time_s >= max(on_x.predicted_iteration_time_s, on_y.predicted_iteration_time_s)
    layout = layout_from_stage_devices(MODEL, c, ("x", "y"), 4, 2, 2, both)
    assert layout.mixed and list(layout.dp_gbps) == [25, 25]
    # The order its replicas are listed in changes nothing: each is costed on its own type.
    flipped = estimate(c, tp=4, pp=2, dp=2, stage_devices=["y+x", "x+y"])
    for i in range(2):
        assert stage_numbers(flipped, i) == pytest.approx(stage_numbers(mixed, i), rel=1e-12)

    # Large micro-batches without recompute: stage 0 fits the 64 GiB type only; spread, it does not fit.
    big = dict(tp=4, pp=2, dp=2, mbs=4, recompute="none")
    fits_y = estimate(c, stage_devices=["y", "x"], **big).stages[0]
    fits_x = estimate(c, stage_devices=["x", "y"], **big).stages[0]
    spread = estimate(c, stage_devices=both, **big).stages[0]
    assert fits_y.predicted_peak_memory_gib <= 64 and fits_x.predicted_peak_memory_gib > 32
    assert spread.predicted_peak_memory_gib > spread.memory_capacity_gib == 32


def test_stage_devices_syntax():
    known = ("a", "b", "c+d")
    assert parse_stage_devices("a", known, 4, "f") == [("a", 4)]
    assert parse_stage_devices("a+b", known, 4, "f") == [("a", 2), ("b", 2)]
    assert parse_stage_devices("a*3+b*1", known, 4, "f") == [("a", 3), ("b", 1)]
    assert parse_stage_devices("c+d", known, 4, "f") == [("c+d", 4)]  # a type whose name holds '+'
    for text, problem in (("a+b", "cannot split evenly"), ("a*2+b*2", "must add up to dp=3"),
                          ("a+a", "twice"), ("a*x+b", "replica count"), ("e+a", "unknown device type")):
        with pytest.raises(ConfigError, match=problem):
            parse_stage_devices(text, known, 3, "f")
    c = cluster(8, 8)
    uneven = estimate(c, tp=2, pp=2, dp=4, stage_devices=["x*3+y*1", "x*1+y*3"])
    assert [s.device_type for s in uneven.stages] == ["x*3+y*1", "x*1+y*3"]
    assert uneven.stages[0].ranks == [0, 1, 2, 3, 4, 5, 8, 9]


def test_plan_files_state_per_stage_tp_and_old_files_load(tmp_path, capsys):
    c = cluster(8, 4)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"version": 1, "name": "x8y4", "device_types": TYPES, "inter_node_gbps": 25,
                                "nodes": [{"name": "xn", "devices": {"x": 8}, "intra_node_gbps": 64},
                                          {"name": "yn", "devices": {"y": 4}, "intra_node_gbps": 56}]}))
    plan_path = tmp_path / "plan.json"
    code = main(["estimate", "--model", "llama2-7b", "--cluster", str(path), "--stage-tp", "4,2", "--pp", "2",
                 "--dp", "2", "--micro-batch-size", "1", "--global-batch-size", "64", "--recompute", "full",
                 "--json", str(plan_path)])
    out = capsys.readouterr().out
    assert code == 0 and "tp=4|2 pp=2 dp=2" in out
    data = json.loads(plan_path.read_text())
    assert data["tp"] is None and data["stage_tp"] == [4, 2] and data["world_size"] == 12
    plan = Plan.load(str(plan_path))
    assert plan.stage_tps == [4, 2] and plan.stage_of_rank(9) == (1, 0, 1)
    again = estimate(c, tp=None, stage_tp=[4, 2], pp=2, dp=2)
    assert plan.predicted_iteration_time_s == pytest.approx(again.predicted_iteration_time_s)
    # memx estimate --plan predicts it again; memx export refuses it in one line, memx-run lays it out.
    assert main(["estimate", "--plan", str(plan_path), "--cluster", str(path)]) == 0
    assert "tp=4|2" in capsys.readouterr().out
    assert main(["estimate", "--model", "llama2-7b", "--cluster", str(path), "--tp", "2", "--pp", "2", "--dp", "3",
                 "--micro-batch-size", "1", "--global-batch-size", "63", "--recompute", "full",
                 "--stage-devices", "x*2+y*1,x*2+y*1"]) == 0
    out = capsys.readouterr().out
    assert "x*2+y*1" in out and "stage 0: replicas on x, y; memory shown on x (nearest its capacity" in out
    # Behind a slow host, each type of a mixed stage is named where the host sets its layers' time.
    assert main(["estimate", "--model", "llama2-7b", "--cluster", str(path), "--tp", "2", "--pp", "2", "--dp", "3",
                 "--micro-batch-size", "1", "--global-batch-size", "63", "--recompute", "full",
                 "--stage-devices", "x*2+y*1,x*2+y*1", "--host-ms-per-layer", "900"]) == 0
    out = capsys.readouterr().out
    assert all(f"host bound: stage {i} ({t}): 16 of its 16 layers take the host 1350.0 ms" in out
               for i in (0, 1) for t in "xy")
    assert main(["export", "--plan", str(plan_path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["memx: error: plan.stage_tp: stages have different TP degrees [4, 2], which Megatron-LM (one "
                   "--tensor-model-parallel-size for all stages) cannot run; plan or estimate one TP degree for "
                   "every stage (--tp)"]
    # stage 0: 2 replicas of TP 4 (processes 0-7), stage 1: 2 of TP 2 (8-11); lanes take TP index mod degree
    assert sorted(process_rank(plan, r) for r in range(plan.world_size)) == list(range(12))
    layout = rank_layout(plan, plan.stages[0].ranks[7])
    assert (layout.stage, layout.dp_index, layout.tp_index) == (0, 1, 3)
    assert layout.pp_ranks == (plan.stages[0].ranks[7], plan.stages[1].ranks[3])
    # A plan file from before stage_tp (no key) loads as uniform TP.
    data = json.loads(plan_path.read_text())
    old = estimate(cluster(8, 8), tp=4, pp=2, dp=2, stage_devices=["x+y", "x+y"]).to_dict()
    del old["stage_tp"]
    loaded = Plan.from_dict(json.loads(json.dumps(old)))
    assert loaded.tp == 4 and loaded.stage_tps == [4, 4]
    data["stage_tp"] = [2, 2]
    with pytest.raises(ConfigError, match="stage_tp: every stage has the same degree"):
        Plan.from_dict(data)


def test_cost_table_looks_up_one_degree_per_stage():
    from memx_launch.planning import costmodel as cm
    from memx_launch.planning.cost_table import CostTable
    c = cluster(8, 8)
    model = cm.AnalyticalCostModel(MODEL, c, TrainingSpec())
    table = CostTable(model, 2, [1, 2, 4], [1], [4096])
    per_stage, _, _ = table.lookup(np.array([0, 1]), np.array([4, 2]), 1, 4096, np.array([0, 0]))
    assert per_stage[0] == table.lookup(0, 4, 1, 4096, 0)[0] and per_stage[1] == table.lookup(1, 2, 1, 4096, 0)[0]


def test_memx_run_takes_a_per_stage_tp_plan(tmp_path, capsys):
    import os
    from memx_launch.runtime.launcher import main as memx_run
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cpu = os.path.join(repo, "examples", "clusters", "cpu-emulated.yaml")
    plan_path = tmp_path / "plan.json"
    assert main(["estimate", "--model", "llama-tiny", "--cluster", cpu, "--stage-tp", "2,1,1", "--pp", "3",
                 "--dp", "1", "--micro-batch-size", "1", "--global-batch-size", "8", "--json", str(plan_path)]) == 0
    capsys.readouterr()
    assert memx_run(["--nproc-per-node", "4", "--cluster", cpu, "--dry-run", "--plan", str(plan_path),
                     os.path.join(repo, "examples", "train.py"), "--model", "llama-tiny"]) == 0
    assert "error" not in capsys.readouterr().err


def test_random_heterogeneous_layouts_keep_the_pipeline_invariants():
    """Random per-stage TP and mixed stages on a two-type cluster: every micro-batch passes the
    slowest stage, the plan file round-trips, and predicting the file again gives its numbers."""
    rng = np.random.default_rng(7)
    c = cluster(8, 8)
    training = TrainingSpec(global_batch_size=64, seq_len=2048)
    checked = 0
    for _ in range(40):
        dp = int(rng.choice([1, 2]))
        stage_tp, left = [], 16 // dp
        while left:
            stage_tp.append(int(rng.choice([t for t in (1, 2, 4) if t <= left])))
            left -= stage_tp[-1]
        pp = len(stage_tp)
        if pp < 2 or len(set(stage_tp)) < 2:
            continue
        devices, free = [], {"x": 8, "y": 8}
        for t in stage_tp:
            need = t * dp
            if dp == 2 and free["x"] >= t and free["y"] >= t and rng.random() < 0.5:
                devices.append("x+y")
                free["x"] -= t
                free["y"] -= t
            else:
                name = "x" if free["x"] >= need else "y"
                devices.append(name)
                free[name] -= need
        if min(free.values()) < 0:
            continue
        plan = evaluate_layout(MODEL, c, training, tp=None, stage_tp=stage_tp, pp=pp, dp=dp, micro_batch_size=1,
                               stage_devices=devices, recompute="full", references=(1.0, 1.0, 1.0))
        g = plan.num_microbatches
        assert plan.predicted_iteration_time_s >= g * max(s.predicted_stage_time_s for s in plan.stages)
        assert [len(s.ranks) for s in plan.stages] == [t * dp for t in stage_tp]
        loaded = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert loaded.stage_tps == stage_tp and loaded.world_size == 16
        again = evaluate_layout(MODEL, c, training, tp=loaded.tp, stage_tp=loaded.stage_tp, pp=pp, dp=dp,
                                micro_batch_size=1, stage_devices=[s.device_type for s in loaded.stages],
                                recompute="full", references=(1.0, 1.0, 1.0))
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s, rel=1e-12)
        checked += 1
    assert checked >= 20
