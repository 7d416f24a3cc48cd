"""Re-planning from a pressure event: correction, then keep / recompute / move layers / search."""

import math

import pytest

from memx_launch.errors import NoFeasiblePlanError
from memx_launch.planning.replan import GIB, ReplanEvent, memory_correction, replan
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.specs.catalog import get_model

MODEL = get_model("llama-tiny")
TRAINING = TrainingSpec(global_batch_size=8, seq_len=64, dtype="fp32")
CLUSTER = ClusterSpec.from_dict({
    "version": 1, "name": "emu",
    "device_types": {"big": {"vendor": "cpu", "memory_gib": 0.08, "peak_tflops": 1.0},
                     "small": {"vendor": "cpu", "memory_gib": 0.03, "peak_tflops": 0.5}},
    "nodes": [{"devices": {"big": 2, "small": 2}, "intra_node_gbps": 10}],
    "emulation": {"slowdown": {"small": 2.0}}})
CAPACITY = [0.08, 0.08, 0.03, 0.03]
HEADROOM = 0.10


@pytest.fixture(scope="module")
def plan():
    return evaluate_layout(MODEL, CLUSTER, TRAINING, tp=1, pp=4, dp=1, micro_batch_size=1,
                           layers_per_stage=[2, 2, 2, 2], recompute=["none"] * 4, references=(1, 1, 1))


def _event(plan, ballast_gib, rank=2, scale=1.0, reason="headroom"):
    observed = [s.predicted_peak_memory_gib * scale for s in plan.stages]
    observed[rank] += ballast_gib
    return ReplanEvent(9, reason, rank, rank, plan.stages[rank].device_type, "test", observed, list(CAPACITY))


def _fits(decision):
    return all(s.predicted_peak_memory_gib <= (1 - HEADROOM) * s.memory_capacity_gib + 1e-9
               for s in decision.plan.stages)


def test_correction_blames_the_type_for_shared_error_and_the_rank_for_the_rest(plan):
    predicted = [s.predicted_peak_memory_gib * GIB for s in plan.stages]
    event = _event(plan, 0.01, scale=1.2)
    c = memory_correction(event, plan, predicted)
    assert c.ratio["big"] == pytest.approx(1.2) and c.ratio["small"] == pytest.approx(1.2)
    assert c.extra_bytes[2] == pytest.approx(0.01 * GIB)
    assert [c.extra_bytes[r] for r in (0, 1, 3)] == pytest.approx([0, 0, 0], abs=1.0)
    # conservative both ways: a smaller stage keeps the fixed extra, a larger one scales
    assert c.corrected(2, "small", 0.5 * predicted[2]) == pytest.approx(0.5 * predicted[2] + 0.2 * predicted[2] + 0.01 * GIB)
    assert c.corrected(3, "small", 2 * predicted[3]) == pytest.approx(2.4 * predicted[3])


def test_fitting_corrected_prediction_keeps_the_plan(plan):
    decision = replan(_event(plan, 0.005, reason="above_prediction"), plan, MODEL, CLUSTER, TRAINING)
    assert decision.action == "keep" and not decision.needs_restart
    assert [s.num_layers for s in decision.plan.stages] == [2, 2, 2, 2]
    # the kept plan's predictions now include what was observed, so the monitor does not fire again
    assert decision.plan.stages[2].predicted_peak_memory_gib >= plan.stages[2].predicted_peak_memory_gib + 0.005 - 1e-4


def test_moderate_pressure_raises_recompute_on_that_stage_only(plan):
    decision = replan(_event(plan, 0.020), plan, MODEL, CLUSTER, TRAINING, min_headroom=HEADROOM)
    assert decision.action == "recompute", decision.why
    stages = decision.plan.stages
    assert [s.num_layers for s in stages] == [2, 2, 2, 2]
    assert [s.recompute for s in stages][:2] + [stages[3].recompute] == ["none"] * 3
    assert stages[2].recompute in ("selective", "full")
    assert _fits(decision)
    assert "recompute none ->" in decision.why and "rank 2" in decision.why


@pytest.mark.parametrize("some", ["full:1", "full:every2"])
def test_a_stage_recomputing_some_layers_recomputes_them_all_under_pressure(some):
    """One of 2 layers on stage 2 (the first, or every other): the next step up is full on both,
    the other stages keep theirs."""
    partial = evaluate_layout(MODEL, CLUSTER, TRAINING, tp=1, pp=4, dp=1, micro_batch_size=1,
                              layers_per_stage=[2, 2, 2, 2], recompute=[some, "none", some, "none"],
                              references=(1, 1, 1))
    assert [s.recompute for s in partial.stages] == [some, "none", some, "none"]
    whole = evaluate_layout(MODEL, CLUSTER, TRAINING, tp=1, pp=4, dp=1, micro_batch_size=1,
                            layers_per_stage=[2, 2, 2, 2], recompute=[some, "none", "full", "none"],
                            references=(1, 1, 1))
    room, partial_room = whole.stages[2].predicted_peak_memory_gib, partial.stages[2].predicted_peak_memory_gib
    assert partial_room > room
    ballast = (1 - HEADROOM) * CAPACITY[2] - (room + partial_room) / 2  # fits only once stage 2 recomputes both
    decision = replan(_event(partial, ballast), partial, MODEL, CLUSTER, TRAINING, min_headroom=HEADROOM)
    assert decision.action == "recompute", decision.why
    assert [s.recompute for s in decision.plan.stages] == [some, "none", "full", "none"]
    assert f"recompute {some} -> full on stage 2" in decision.why
    assert _fits(decision)


def test_when_recompute_is_not_enough_layers_move_off_the_stage(plan):
    decision = replan(_event(plan, 0.022), plan, MODEL, CLUSTER, TRAINING, min_headroom=HEADROOM)
    assert decision.action == "move_layers", decision.why
    layers = [s.num_layers for s in decision.plan.stages]
    assert layers[2] < 2 and sum(layers) == MODEL.num_layers
    assert _fits(decision)


def test_last_resort_is_a_safety_first_search(plan):
    decision = replan(_event(plan, 0.024), plan, MODEL, CLUSTER, TRAINING, min_headroom=HEADROOM)
    assert decision.action == "search", decision.why
    assert decision.plan.objective.profile == "safety"
    assert _fits(decision)
    assert all(s.memory_capacity_gib in (0.08, 0.03) for s in decision.plan.stages)  # real capacities


def test_the_last_resort_search_keeps_memx_run_s_restrictions(plan):
    """The search's plan needs TP 2; with memx-run's --tp 1 nothing else fits, and it says so."""
    free = replan(_event(plan, 0.024), plan, MODEL, CLUSTER, TRAINING, min_headroom=HEADROOM)
    assert free.action == "search" and free.plan.tp == 2
    with pytest.raises(NoFeasiblePlanError, match="No plan fits"):
        replan(_event(plan, 0.024), plan, MODEL, CLUSTER, TRAINING, min_headroom=HEADROOM,
               restrictions={"tp_degrees": (1,)})


def test_no_room_at_all_is_a_clear_error(plan):
    with pytest.raises(NoFeasiblePlanError, match="small"):
        replan(_event(plan, 0.029), plan, MODEL, CLUSTER, TRAINING)


def test_event_round_trips_through_json(tmp_path, plan):
    event = _event(plan, 0.01, reason="oom")
    event.observed_gib[0] = math.nan
    path = tmp_path / "event.json"
    event.save(str(path))
    back = ReplanEvent.load(str(path))
    assert math.isnan(back.observed_gib[0]) and back.observed_gib[1:] == event.observed_gib[1:]
    assert (back.reason, back.rank, back.step) == ("oom", 2, 9)


def test_replan_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, memx_launch.planning.replan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
