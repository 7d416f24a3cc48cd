"""memx evaluate reads memx-run's own metrics: a run directory, its metrics.jsonl, or a directory
of runs, each generation against the plan it ran under (profiling/run_metrics.py)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.profiling.metrics import load_measurements
from memx_launch.runtime.metrics_file import METRICS_FILE, MetricsFile
from memx_launch.runtime.step_stats import StepStats

GIB = 2**30


def _plan(step_s, peaks_gib, bridge_bytes=None):
    """A plan's fields the metrics file reads; ``bridge_bytes``: what it plans to send across domains."""
    return SimpleNamespace(predicted_iteration_time_s=step_s, stages=[
        SimpleNamespace(device_type=f"t{i}", predicted_peak_memory_gib=p, predicted_stage_time_s=0.1 * (i + 1))
        for i, p in enumerate(peaks_gib)], crossings=[] if bridge_bytes is None else ["a crossing"],
        bridge_bytes_per_step=bridge_bytes)


def _run(run_dir, generations, compute_s=0.1):
    """``generations``: (generation, plan, [(step, step seconds, [peak GiB per stage])]); every
    stage computes ``compute_s`` per micro-batch (stage i's plan predicts 0.1 x (i + 1) s)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for generation, plan, steps in generations:
        metrics = MetricsFile(str(run_dir), generation)
        for step, seconds, peaks in steps:
            metrics.append(StepStats(step, 2.0, seconds, 1000.0, peaks, [compute_s] * len(peaks)), plan)
    return run_dir


def _two_generations(run_dir):
    return _run(run_dir, [
        (1, _plan(1.0, [3.0, 2.0]), [(1, 9.0, [3.1, 2.0]), (2, 1.2, [3.3, 2.1]), (3, 1.1, [3.2, 2.2]),
                                     (4, 1.3, [3.3, 2.0])]),
        (2, _plan(2.0, [1.5, 1.75]), [(4, 5.0, [1.5, 1.9]), (5, 2.5, [1.6, 1.8])])])


def test_a_run_directory_gives_a_row_per_generation(tmp_path):
    run = _two_generations(tmp_path / "llama-2026")
    columns = load_measurements(str(run))
    assert list(columns["config"]) == ["llama-2026 gen 1", "llama-2026 gen 2"]
    assert columns["predicted_time_s"] == pytest.approx([1.0, 2.0])
    # The first step of each generation (allocation, warm-up) is left out; the median of the rest.
    assert columns["measured_time_s"] == pytest.approx([1.2, 2.5])
    # The fullest stage of any step against the plan's fullest stage.
    assert columns["measured_memory_bytes"] == pytest.approx([3.3 * GIB, 1.9 * GIB])
    assert columns["predicted_memory_bytes"] == pytest.approx([3.0 * GIB, 1.75 * GIB])
    same = load_measurements(str(run / METRICS_FILE))
    assert all(np.array_equal(same[k], columns[k]) for k in columns)


def test_each_stage_s_compute_is_held_against_its_plan_where_every_step_measured_it(tmp_path):
    from memx_launch.profiling.run_metrics import run_rows

    def rows(run):
        path = run / METRICS_FILE
        return run_rows(path.read_text(), str(path), run.name, "")

    measured = _run(tmp_path / "gpu", [(1, _plan(1.0, [3.0, 2.0]), [(1, 9.0, [3.1, 2.0]), (2, 1.2, [3.3, 2.1])])],
                    compute_s=0.15)
    assert rows(measured)[0]["stage_compute_over_predicted"] == pytest.approx([1.5, 0.75])
    unmeasured = _run(tmp_path / "cpu", [(1, _plan(1.0, [3.0]), [(1, 9.0, [3.1]), (2, 1.2, [3.3])])],
                      compute_s=float("nan"))  # written as null
    assert "stage_compute_over_predicted" not in rows(unmeasured)[0]


def test_a_directory_of_runs_names_each_run(tmp_path):
    _two_generations(tmp_path / "runs" / "b")
    _run(tmp_path / "runs" / "a", [(1, _plan(0.5, [1.0]), [(1, 0.6, [1.1])])])  # one step: kept
    (tmp_path / "runs" / "notes").mkdir()
    columns = load_measurements(str(tmp_path / "runs"))
    assert list(columns["config"]) == ["a gen 1", "b gen 1", "b gen 2"]
    assert columns["measured_time_s"][0] == pytest.approx(0.6)


def test_memory_is_left_out_where_a_generation_measured_none(tmp_path):
    run = _run(tmp_path / "cpu", [(1, _plan(1.0, [3.0]), [(1, 2.0, [float("nan")]), (2, 1.5, [float("nan")])]),
                                  (2, _plan(1.0, [3.0]), [(3, 1.4, [3.5])])])
    with pytest.warns(UserWarning, match="memory left out: 1 of 2 generations measured none"):
        columns = load_measurements(str(run))
    assert "measured_memory_bytes" not in columns
    assert columns["measured_time_s"] == pytest.approx([1.5, 1.4])


def test_memx_evaluate_scores_the_run(tmp_path, capsys):
    run = _two_generations(tmp_path / "run")
    assert main(["evaluate", "--measurements", str(run), "--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    # |1.0 - 1.2| / 1.2 and |2.0 - 2.5| / 2.5: 18.3%; memory |3.0 - 3.3| / 3.3 and |1.75 - 1.9| / 1.9.
    assert report["time"]["mape_pct"] == pytest.approx(100 * (0.2 / 1.2 + 0.5 / 2.5) / 2)
    assert report["memory"]["mape_pct"] == pytest.approx(100 * (0.3 / 3.3 + 0.15 / 1.9) / 2)
    assert "time" in capsys.readouterr().out


@pytest.mark.parametrize("edit, says", [
    (lambda r: {**r, "step_time_s": "1.5"}, "line 2: a field is missing or not a number"),
    (lambda r: {**r, "generation": True}, "line 2: a field is missing or not a number"),
    (lambda r: {k: v for k, v in r.items() if k != "stages"}, "line 2 is not a memx-run metrics record"),
    (lambda r: {**r, "stages": [{"peak_memory_gib": 1.0}]}, "line 2: a field is missing or not a number"),
])
def test_an_edited_metrics_line_is_named(tmp_path, edit, says):
    run = _two_generations(tmp_path / "run")
    path = run / METRICS_FILE
    lines = path.read_text().splitlines()
    lines[1] = json.dumps(edit(json.loads(lines[1])))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=says):
        load_measurements(str(run))


def test_a_directory_without_runs_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no metrics.jsonl"):
        load_measurements(str(tmp_path))


def test_memx_run_ends_a_run_with_how_its_plans_held(tmp_path):
    """memx-run's last line after a run that ended well: evaluate's rows of its run directory."""
    from memx_launch.runtime.runs import prediction_summary

    run = _two_generations(tmp_path / "llama-2026")
    assert prediction_summary(str(run)) == (
        "measured against the plan: gen 1: step 1.2 s against 1 s predicted (1.20x), fullest stage's peak 1.10x, "
        "stages' compute 0.50-1.00x; gen 2: step 2.5 s against 2 s predicted (1.25x), fullest stage's peak 1.09x, "
        f"stages' compute 0.50-1.00x (memx evaluate --measurements {run})")
    assert prediction_summary(str(tmp_path / "no-steps")) is None  # the script never stepped through memx
    (run / METRICS_FILE).write_text('{"step":\n')
    assert prediction_summary(str(run)) is None  # not whole: memx evaluate names the line, the job's end does not


def test_a_run_across_domains_holds_what_crossed_against_the_plan_s_count(tmp_path):
    from memx_launch.runtime.runs import prediction_summary

    run = tmp_path / "across"
    run.mkdir()
    metrics = MetricsFile(str(run), 1)
    plan = _plan(1.0, [1.0], bridge_bytes=4 * 2**20)
    for step, sent in ((1, 9 * 2**20), (2, 4 * 2**20), (3, 5 * 2**20), (4, 4 * 2**20)):
        stats = StepStats(step, 2.0, 1.0, 1000.0, [1.0], [0.1], bridge_messages=8, bridge_bytes=sent)
        metrics.append(stats, plan)
    record = json.loads((run / METRICS_FILE).read_text().splitlines()[0])
    assert (record["bridge_bytes"], record["planned_bridge_bytes"]) == (9 * 2**20, 4 * 2**20)
    # The median after the first step: 4 MiB of the 4 planned.
    assert "bytes over the bridge 1.00x" in prediction_summary(str(run))
    columns = load_measurements(str(run))
    assert (columns["measured_bridge_bytes"], columns["predicted_bridge_bytes"]) == ([4 * 2**20], [4 * 2**20])
    from memx_launch.profiling.metrics import evaluate
    assert evaluate(columns)["bridge"]["mape_pct"] == 0.0
    # A run of one domain beside it: its rows measured no bridge, so the bridge is left out, with a warning.
    assert "bridge" not in (_two_generations(tmp_path / "one-domain") / METRICS_FILE).read_text()
    with pytest.warns(UserWarning, match="bridge bytes left out: 2 of 3 generations"):
        both = load_measurements(str(tmp_path))
    assert "measured_bridge_bytes" not in both and len(both["config"]) == 3
