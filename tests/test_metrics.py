import json

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.profiling.metrics import error_summary, evaluate, format_report, load_measurements, ranking_summary


def test_error_summary():
    s = error_summary([1.1, 0.5, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    assert s["mape_pct"] == pytest.approx((10 + 50 + 200 + 0) / 4)
    assert s["under_20pct_share"] == 0.5
    assert s["over_50pct_share"] == 0.25
    assert s["max_error_pct"] == pytest.approx(200)


def test_ranking_top_k_hits():
    measured = np.array([5.0, 1.0, 3.0, 4.0, 2.0])
    perfect = ranking_summary(measured * 2, measured)
    assert perfect["spearman"] == pytest.approx(1.0) and perfect["kendall"] == pytest.approx(1.0)
    assert perfect["top1_hit"] == 1.0
    # The truly best (index 1) is predicted third best: a top-3 hit but not top-1.
    r = ranking_summary([1.0, 3.0, 2.0, 5.0, 4.0], measured)
    assert (r["top1_hit"], r["top3_hit"], r["top5_hit"]) == (0.0, 1.0, 1.0)


def test_csv_and_json_measurement_files(tmp_path):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("config,predicted_time_s,measured_time_s,predicted_phi,measured_phi\n"
                        "a,1.0,1.1,0.9,1.0\nb,2.0,1.9,1.2,1.3\nc,3.0,3.3,0.8,0.7\n")
    report = evaluate(load_measurements(str(csv_path)))
    assert set(report) == {"time", "phi"}
    assert report["phi"]["ranking"]["top1_hit"] == 1.0
    json_path = tmp_path / "m.json"
    json_path.write_text(json.dumps({"rows": [
        {"config": "a", "predicted_time_s": 1, "measured_time_s": 1, "predicted_memory_bytes": 10,
         "measured_memory_bytes": 11}]}))
    report = evaluate(load_measurements(str(json_path)))
    assert report["memory"]["mape_pct"] == pytest.approx(100 / 11)
    assert "MAPE%" in format_report(report)


def test_missing_time_column_is_a_clear_error(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("config,predicted_time_s\na,1.0\n")
    with pytest.raises(ConfigError, match="no measured_time_s column"):
        load_measurements(str(path))


def test_memx_evaluate_prints_the_table(tmp_path, capsys):
    from memx_launch.cli import main

    path = tmp_path / "m.csv"
    path.write_text("config,predicted_time_s,measured_time_s\na,1.0,1.1\nb,2.0,2.2\nc,3.0,2.5\n")
    assert main(["evaluate", "--measurements", str(path), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "MAPE%" in out and "time" in out
    assert json.loads((tmp_path / "r.json").read_text())["time"]["n"] == 3
