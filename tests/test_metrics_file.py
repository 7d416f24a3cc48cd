"""memx-run's metrics file (runtime/metrics_file.py): one whole JSON line per step, in the run directory."""

import json
from types import SimpleNamespace

from memx_launch.runtime.metrics_file import METRICS_FILE, MetricsFile
from memx_launch.runtime.step_stats import StepStats

PLAN = SimpleNamespace(predicted_iteration_time_s=1.5, crossings=[], stages=[
    SimpleNamespace(device_type="fast-small", predicted_peak_memory_gib=0.25, predicted_stage_time_s=0.1),
    SimpleNamespace(device_type="slow-big", predicted_peak_memory_gib=0.5, predicted_stage_time_s=0.2)])


def test_each_step_appends_one_line_with_measured_and_predicted_values_per_stage(tmp_path):
    metrics = MetricsFile(str(tmp_path), generation=1)
    metrics.append(StepStats(7, 2.5, 1.25, 800.0, [0.2, float("nan")], [0.09, float("nan")]), PLAN)
    metrics.append(StepStats(8, 2.25, 1.0, 1000.0, [0.21, 0.4], [0.1, 0.2]), PLAN)
    first, second = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert (first["step"], first["generation"], first["loss"], first["step_time_s"], first["tokens_per_s"]) == \
        (7, 1, 2.5, 1.25, 800.0)
    assert first["predicted_step_time_s"] == 1.5 and second["step"] == 8
    assert first["stages"][0] == {"stage": 0, "device_type": "fast-small", "peak_memory_gib": 0.2,
                                  "predicted_peak_memory_gib": 0.25, "microbatch_compute_s": 0.09,
                                  "predicted_microbatch_s": 0.1}
    assert first["stages"][1]["peak_memory_gib"] is None  # unmeasured: null, not NaN (valid JSON)
