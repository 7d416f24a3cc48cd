"""The run's metrics file: ``<run dir>/metrics.jsonl``, one JSON line per optimizer step, which
memx-run's rank 0 appends to (Runtime.step) whatever the script prints.

Each line: ``step``, ``generation`` (the workers' start: a step run again after an out-of-memory
restart appears again with the next generation), ``time`` (Unix seconds), ``loss``,
``step_time_s``, ``predicted_step_time_s``, ``tokens_per_s`` and ``stages``, per pipeline stage
its ``device_type``, ``peak_memory_gib`` measured (max over the stage's ranks; on a GPU the device
memory the process held at its peak, context and NCCL's buffers too, as the monitor reads it and
the plan predicts it: runtime/monitor.py) and
``predicted_peak_memory_gib``, and ``microbatch_compute_s`` (the stage's chunks and loss as its
device ran them, runtime/stage_clock.py) with ``predicted_microbatch_s``. A job across
communication domains adds ``bridge_bytes``, what all its ranks sent over the bridge in the step,
and ``planned_bridge_bytes``, what the plan's crossings count (null in a plan that does not count
its senders). A value memx could not measure (memory on a CPU that is not emulated) is ``null``.
"""

from __future__ import annotations

import json
import math
import os
import time

from memx_launch.profiling.run_metrics import METRICS_FILE


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def metrics_record(stats, plan, generation: int) -> dict:
    """One step's line (``stats``: a step_stats.StepStats; ``plan``: the plan it ran under)."""
    stages = [{"stage": i, "device_type": stage.device_type,
               "peak_memory_gib": _number(stats.stage_peak_gib[i]),
               "predicted_peak_memory_gib": stage.predicted_peak_memory_gib,
               "microbatch_compute_s": _number(stats.stage_compute_s[i]),
               "predicted_microbatch_s": stage.predicted_stage_time_s}
              for i, stage in enumerate(plan.stages)]
    record = {"step": stats.step, "generation": generation, "time": round(time.time(), 3),
              "loss": _number(stats.loss), "step_time_s": _number(stats.step_time_s),
              "predicted_step_time_s": plan.predicted_iteration_time_s, "tokens_per_s": _number(stats.tokens_per_s),
              "stages": stages}
    if plan.crossings:
        record.update(bridge_bytes=stats.bridge_bytes, planned_bridge_bytes=plan.bridge_bytes_per_step)
    return record


class MetricsFile:
    """Appends whole lines (one write each, O_APPEND): a reader never sees half a line."""

    def __init__(self, run_dir: str, generation: int):
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.generation = generation

    def append(self, stats, plan) -> None:
        line = json.dumps(metrics_record(stats, plan, self.generation), allow_nan=False) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
