"""`memx cluster fit`: each device type's efficiency and memory overhead fitted to measured runs."""

import csv
import json
import os
import shutil

import numpy as np
import pytest
import yaml

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning.cases import CaseRunner, read_cases
from memx_launch.planning.run_fit import fit_cluster, fit_efficiencies, fitted_overhead_gib, golden_minimum
from memx_launch.profiling.metrics import load_measurements
from memx_launch.specs.cluster import CONTEXT_GIB, ClusterSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
H100 = {"version": 1, "name": "h100-2x8",
        "device_types": {"h100": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "compute_capability": 9.0,
                                  "memory_bandwidth_gbps": 3350}},
        "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450} for _ in range(2)], "inter_node_gbps": 50}
LAYOUTS = [dict(tp=1, pp=1, micro_batch_size=1, recompute="full"), dict(tp=2, pp=2, micro_batch_size=1, recompute="none"),
           dict(tp=4, pp=2, micro_batch_size=4, recompute="none"), dict(tp=8, pp=1, micro_batch_size=2, recompute="selective")]


def _write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _measured(tmp_path, truth: dict, layouts=LAYOUTS, extra: dict | None = None, name="runs.csv") -> str:
    """A cases file of ``layouts`` whose measured columns are what memx predicts on ``truth``."""
    runner = CaseRunner(str(tmp_path), cluster=ClusterSpec.from_dict(truth))
    rows = []
    for layout in layouts:
        row = {"model": "llama2-7b", "global_batch_size": 64, **{k: str(v) for k, v in layout.items()}, **(extra or {})}
        result = runner.estimate(row)
        rows.append({**row, "measured_time_s": result["iteration_time_s"],
                     "measured_peak_memory_gib": result["peak_memory_gib"]})
    path = tmp_path / name
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def _truth(efficiency=0.45, overhead=3.0) -> dict:
    h100 = {**H100["device_types"]["h100"], "efficiency": efficiency, "memory_overhead_gib": overhead}
    return {**H100, "device_types": {"h100": h100}}


def test_golden_minimum_finds_a_parabola_minimum():
    assert golden_minimum(lambda x: (x - 0.3) ** 2, -2.0, 2.0) == pytest.approx(0.3, abs=1e-3)


def test_fit_recovers_the_efficiency_and_overhead_the_runs_measured(tmp_path):
    cluster = _write(tmp_path / "h100.yaml", H100)
    fit = fit_cluster(_measured(tmp_path, _truth()), cluster)
    (h100,) = fit.types
    assert h100.time_rows == h100.memory_rows == len(LAYOUTS)
    assert h100.efficiency_before == pytest.approx(0.58, abs=0.01)  # Hopper's default share
    assert h100.efficiency == pytest.approx(0.45, rel=2e-3)
    assert h100.overhead_gib == pytest.approx(3.0, abs=1e-3)
    assert fit.time_mape_pct[0] > 10 and fit.time_mape_pct[1] < 0.2
    assert fit.memory_mape_pct[1] < 0.01 < fit.memory_mape_pct[0]
    fitted = fit.data["device_types"]["h100"]
    assert fitted["efficiency"] == pytest.approx(0.45, rel=2e-3) and fitted["memory_overhead_gib"] == 3.0
    assert fitted["peak_tflops"] == 989  # the rest of the file as it was


def test_every_type_a_pipeline_runs_on_is_fitted_and_an_unseen_one_barely_moves(tmp_path):
    base = yaml.safe_load(open(os.path.join(CLUSTERS, "paper-20gpu.yaml")))
    truth = yaml.safe_load(open(os.path.join(CLUSTERS, "paper-20gpu.yaml")))
    for name, efficiency in (("a100-80gb", 0.6), ("vendor-b-32gb", 0.35), ("vendor-c-32gb", 0.25)):
        truth["device_types"][name]["efficiency"] = efficiency
    devices = "a100-80gb|vendor-b-32gb|vendor-b-32gb|vendor-c-32gb|vendor-c-32gb"
    layouts = [dict(tp=4, pp=5, dp=1, micro_batch_size=m, recompute="full", stage_devices=devices, layers_per_stage=s)
               for m, s in ((1, "12/8/6/3/3"), (2, "10/9/7/3/3"), (4, "6/7/7/6/6"))]
    fit = fit_cluster(_measured(tmp_path, truth, layouts), _write(tmp_path / "paper.yaml", base))
    fitted = {t.device_type: t.efficiency for t in fit.types}
    assert fitted["vendor-b-32gb"] == pytest.approx(0.35, rel=0.02)
    assert fitted["vendor-c-32gb"] == pytest.approx(0.25, rel=0.02)
    # The A100 stage is never the slowest: its rows barely tell its efficiency, which stays near
    # the file's 0.45 instead of running to a bound.
    assert fitted["a100-80gb"] == pytest.approx(0.45, rel=0.05)
    assert fit.time_mape_pct[1] < 0.5


def test_fit_efficiencies_keeps_a_type_no_time_moves_with():
    measured = np.array([2.0, 4.0])
    fitted = fit_efficiencies(lambda e: np.array([1.0, 2.0]) / e["a"], measured, {"a": 0.8, "idle": 0.3})
    assert fitted == {"a": pytest.approx(0.5, rel=1e-3), "idle": 0.3}


def test_an_overhead_never_falls_below_the_context():
    device = ClusterSpec.from_dict(H100).device_type("h100")
    assert fitted_overhead_gib(device, [-5.0, -4.0]) == CONTEXT_GIB
    assert fitted_overhead_gib(device, [1.0, 2.0, 30.0]) == pytest.approx(device.overhead_bytes / 2**30 + 2.0)


def test_the_fitted_file_predicts_what_was_measured(tmp_path, capsys):
    cluster = _write(tmp_path / "h100.yaml", H100)
    runs = _measured(tmp_path, _truth(0.5, 2.0))
    out = tmp_path / "fitted.yaml"
    assert main(["cluster", "fit", "--cases", runs, "--cluster", cluster, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0.580 -> 0.500" in printed and "1.25 -> 2.00" in printed and "in-sample MAPE over 4 rows" in printed
    assert out.read_text().startswith("# Fitted by memx cluster fit to 4 measured runs (runs.csv)")
    runner = CaseRunner(str(tmp_path), cluster=ClusterSpec.from_yaml(str(out)))
    for _, row in read_cases(runs):
        result = runner.estimate(row)
        assert result["iteration_time_s"] == pytest.approx(float(row["measured_time_s"]), rel=2e-3)
        assert result["peak_memory_gib"] == pytest.approx(float(row["measured_peak_memory_gib"]), abs=1e-3)
        assert result["measured_time_s"] == row["measured_time_s"]  # echoed beside the prediction
    before = out.read_text()
    assert main(["cluster", "fit", "--cases", runs, "--cluster", cluster, "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == before  # never overwritten without --force


@pytest.mark.parametrize("cell, problem", [
    ({"measured_time_s": "", "measured_peak_memory_gib": ""}, "no measured_time_s nor measured_peak_memory_gib"),
    ({"measured_time_s": "-1"}, "measured_time_s '-1' is not a positive number"),
    ({"measured_time_s": "fast"}, "measured_time_s"),
    ({"cluster": "other.yaml"}, "is not --cluster"),
    ({"tp": "3"}, "row 1"),
])
def test_a_bad_row_stops_the_fit_and_names_itself(tmp_path, cell, problem):
    cluster = _write(tmp_path / "h100.yaml", H100)
    shutil.copy(cluster, tmp_path / "other.yaml")
    runs = _measured(tmp_path, _truth(), LAYOUTS[:1])
    rows = list(csv.DictReader(open(runs)))
    rows[0].update(cell)
    with open(runs, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(ConfigError, match="row 1") as raised:
        fit_cluster(runs, cluster)
    assert problem in str(raised.value)
    out = tmp_path / "fitted.yaml"
    assert main(["cluster", "fit", "--cases", runs, "--cluster", cluster, "--out", str(out)]) == 2
    assert not out.exists()  # nothing half-fitted is written


def test_fp32_rows_and_16_bit_rows_are_not_fitted_as_one(tmp_path):
    cluster = _write(tmp_path / "h100.yaml", {**H100, "device_types": {"h100": {
        **H100["device_types"]["h100"], "peak_tflops_fp32": 67}}})
    bf16 = list(csv.DictReader(open(_measured(tmp_path, _truth(), LAYOUTS[:1], name="a.csv"))))
    fp32 = list(csv.DictReader(open(_measured(tmp_path, _truth(), LAYOUTS[1:2], {"dtype": "fp32"}, name="b.csv"))))
    runs = tmp_path / "mixed.csv"
    with open(runs, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fp32[0]))
        writer.writeheader()
        writer.writerows([{**bf16[0], "dtype": "bf16"}, fp32[0]])
    with pytest.raises(ConfigError, match="fp32 on CUDA cores and in 16-bit"):
        fit_cluster(str(runs), cluster)


def test_a_fit_of_nothing_is_refused(tmp_path):
    runs = tmp_path / "runs.csv"
    runs.write_text("model,tp,measured_time_s\n")
    with pytest.raises(ConfigError, match="holds no rows"):
        fit_cluster(str(runs), _write(tmp_path / "h100.yaml", H100))


def test_evaluate_reads_the_estimate_of_measured_rows(tmp_path, capsys):
    """memx estimate --cases on measured rows, then memx evaluate on its output: the estimate's
    values against the measured ones it echoes; a row that errs or measured nothing is counted out."""
    runs = _measured(tmp_path, _truth(0.5, 2.0))
    with open(runs, "a") as f:
        f.write("llama2-7b,64,3,1,1,none,,\n")  # tp 3: an error, and no measurement
    cluster = _write(tmp_path / "h100.yaml", H100)
    estimates = tmp_path / "estimates.jsonl"
    assert main(["estimate", "--cases", runs, "--cluster", cluster, "--out", str(estimates)]) == 0
    capsys.readouterr()
    with pytest.warns(UserWarning, match="1 rows without measured_time_s or with an error left out"):
        columns = load_measurements(str(estimates))
    assert list(columns["config"]) == ["row 1", "row 2", "row 3", "row 4"]
    rows = [json.loads(line) for line in estimates.read_text().splitlines()][:4]
    assert columns["predicted_time_s"] == pytest.approx([r["iteration_time_s"] for r in rows])
    assert columns["measured_time_s"] == pytest.approx([float(r["measured_time_s"]) for r in rows])
    assert columns["measured_memory_bytes"] == pytest.approx([float(r["measured_peak_memory_gib"]) * 2**30 for r in rows])
    assert main(["evaluate", "--measurements", str(estimates)]) == 0
    out, err = capsys.readouterr()
    assert "1 rows without measured_time_s or with an error left out" in err
    time_line = next(line for line in out.splitlines() if line.startswith("time"))
    assert float(time_line.split()[2]) > 5  # Hopper's default against runs at efficiency 0.5


def test_an_efficiency_run_to_the_end_of_its_range_is_said(tmp_path):
    """Runs slower than memx's model of them allows at any efficiency (options the rows do not
    say, a slow host): the fit ends at its bound and warns instead of passing it off as a fit."""
    runs = _measured(tmp_path, _truth(0.45))
    rows = list(csv.DictReader(open(runs)))
    for row in rows:
        row["measured_time_s"] = str(float(row["measured_time_s"]) * 100)
    with open(runs, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.warns(UserWarning, match="h100: efficiency 0.020 at the end of its range: the rows ran slower"):
        fit = fit_cluster(runs, _write(tmp_path / "h100.yaml", H100))
    assert fit.types[0].efficiency == pytest.approx(0.02, rel=0.01)


def test_the_rows_still_furthest_off_are_named(tmp_path, capsys):
    """A run whose options the row does not say (here: measured 1.5x slower) is the first the
    command names after the fit, with its id."""
    runs = _measured(tmp_path, _truth(0.45))
    rows = list(csv.DictReader(open(runs)))
    rows[2]["measured_time_s"] = str(float(rows[2]["measured_time_s"]) * 1.5)
    rows[2]["id"] = "slow"
    with open(runs, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) + ["id"])
        writer.writeheader()
        writer.writerows(rows)
    cluster = _write(tmp_path / "h100.yaml", H100)
    assert main(["cluster", "fit", "--cases", runs, "--cluster", cluster, "--out", str(tmp_path / "f.yaml")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("furthest off after the fit"))
    assert line.split(": ", 1)[1].startswith("row 3 (slow) 0.")  # predicted well under its measured time


def test_a_jsonl_file_of_runs_fits_as_its_csv_does(tmp_path):
    """The runs as JSON lines (numbers as numbers) give the CSV's fit; a boolean is no measurement."""
    cluster = _write(tmp_path / "h100.yaml", H100)
    runs = _measured(tmp_path, _truth(0.5, 2.0))
    lines = [{k: (float(v) if k.startswith("measured_") else v) for k, v in row.items()}
             for row in csv.DictReader(open(runs))]
    jsonl = tmp_path / "runs.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    from_csv, from_jsonl = fit_cluster(runs, cluster), fit_cluster(str(jsonl), cluster)
    assert from_jsonl.types == from_csv.types and from_jsonl.data == from_csv.data
    jsonl.write_text(json.dumps({**lines[0], "measured_time_s": True}) + "\n")
    with pytest.raises(ConfigError, match="measured_time_s True is not a positive number"):
        fit_cluster(str(jsonl), cluster)
