"""memx-run's metrics file read back as measurement rows for ``memx evaluate``: how far the plans
memx-run ran under were from what their runs measured.

The file (``<run dir>/metrics.jsonl``, written by memx_launch/runtime/metrics_file.py) holds a
line per step: its ``generation`` (the plan it ran under), ``step_time_s`` and the plan's
``predicted_step_time_s``, and per stage the measured ``peak_memory_gib`` and the plan's
``predicted_peak_memory_gib`` (null where not measured). A generation becomes one row: the median
step time after its first step (which allocates, connects and warms up; a generation of one step
keeps it) against the plan's, the fullest stage's measured peak against the plan's fullest,
where every stage of every step measured one, and each stage's median compute per micro-batch
over those steps against the plan's (``stage_compute_over_predicted``), where every one measured
it (``microbatch_compute_s``), and in a job across communication domains the median bytes its
ranks sent over the bridge a step against the plan's count (``measured_bridge_bytes``,
``predicted_bridge_bytes``).
"""

from __future__ import annotations

import json
import math
import os
import warnings

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning.costmodel import GIB
from memx_launch.specs.inputs import parse_json, read_text

METRICS_FILE = "metrics.jsonl"
RECORD_KEYS = ("step", "generation", "step_time_s", "predicted_step_time_s", "stages")


def is_run_metrics(text: str) -> bool:
    """Whether ``text``'s first line is a memx-run metrics record."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and all(key in record for key in RECORD_KEYS)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _measured(value) -> bool:
    """A measurement: a number, or null where memx-run could not measure it."""
    return value is None or _number(value)


def _well_formed(record: dict) -> bool:
    generation, stages = record["generation"], record["stages"]
    return (_number(record["predicted_step_time_s"]) and record["predicted_step_time_s"] > 0
            and isinstance(generation, int) and not isinstance(generation, bool)
            and _measured(record["step_time_s"])
            and isinstance(stages, list) and len(stages) > 0
            and all(isinstance(s, dict) and _number(s.get("predicted_peak_memory_gib"))
                    and _measured(s.get("peak_memory_gib")) for s in stages))


def _record(line: str, where: str, fix: str) -> dict:
    record = parse_json(line, "--measurements", where, fix)
    if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
        raise ConfigError("--measurements", f"{where} is not a memx-run metrics record "
                          f"(it needs {', '.join(RECORD_KEYS)})", fix)
    if not _well_formed(record):
        raise ConfigError("--measurements", f"{where}: a field is missing or not a number",
                          "pass the metrics.jsonl memx-run wrote, unedited")
    return record


def _generation_rows(text: str, path: str, name: str, fix: str) -> list[dict]:
    generations: dict[int, list[dict]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            record = _record(line, f"{path} line {n}", fix)
            generations.setdefault(record["generation"], []).append(record)
    rows, unmeasured = [], 0
    for generation, records in sorted(generations.items()):
        steps = records[1:] or records
        times = [r["step_time_s"] for r in steps if r["step_time_s"] is not None and r["step_time_s"] > 0]
        if not times:
            unmeasured += 1
            continue
        row = {"config": f"{name} gen {generation}", "generation": generation,
               "predicted_time_s": records[-1]["predicted_step_time_s"], "measured_time_s": float(np.median(times))}
        measured = [s["peak_memory_gib"] for r in records for s in r["stages"]]
        if all(m is not None for m in measured):
            row["measured_memory_bytes"] = max(measured) * GIB
            row["predicted_memory_bytes"] = max(s["predicted_peak_memory_gib"] for s in records[-1]["stages"]) * GIB
        per_step = [[s.get("microbatch_compute_s") for s in r["stages"]] for r in steps]
        planned = [s.get("predicted_microbatch_s") for s in records[-1]["stages"]]
        if all(_number(v) for v in planned + [c for step in per_step for c in step]) and all(p > 0 for p in planned):
            row["stage_compute_over_predicted"] = [float(np.median(stage)) / p for stage, p in zip(zip(*per_step), planned)]
        sent, bridge_plan = [r.get("bridge_bytes") for r in steps], records[-1].get("planned_bridge_bytes")
        if _number(bridge_plan) and bridge_plan > 0 and all(_number(b) for b in sent):
            row["measured_bridge_bytes"], row["predicted_bridge_bytes"] = float(np.median(sent)), float(bridge_plan)
        rows.append(row)
    if unmeasured:
        warnings.warn(f"{path}: {unmeasured} generations without a measured step time left out")
    return rows


def _pairs_in_every_row_or_none(rows: list[dict], path: str) -> list[dict]:
    """Memory and bridge bytes kept where every row measured them, else left out with a warning."""
    for what, key in (("memory", "_memory_bytes"), ("bridge bytes", "_bridge_bytes")):
        measured = sum(f"measured{key}" in r for r in rows)
        if 0 < measured < len(rows):
            warnings.warn(f"{path}: {what} left out: {len(rows) - measured} of {len(rows)} generations measured none")
            rows = [{k: v for k, v in r.items() if not k.endswith(key)} for r in rows]
    return rows


def run_rows(text: str, path: str, name: str, fix: str) -> list[dict]:
    """The rows of one metrics file ``path`` (its text), each named ``<name> gen N``."""
    return _pairs_in_every_row_or_none(_generation_rows(text, path, name, fix), path)


def run_directory_rows(path: str, fix: str) -> list[dict]:
    """The rows of a run directory's metrics file, or of each run directory in ``path``."""
    if os.path.isfile(os.path.join(path, METRICS_FILE)):
        runs = [path]
    else:
        runs = sorted(os.path.join(path, d) for d in os.listdir(path)
                      if os.path.isfile(os.path.join(path, d, METRICS_FILE)))
    if not runs:
        raise ConfigError("--measurements", f"{path} holds no {METRICS_FILE}",
                          "pass a memx-run run directory, a directory of them, or a measurements file")
    rows = []
    for run in runs:
        file = os.path.join(run, METRICS_FILE)
        rows += _generation_rows(read_text(file, "--measurements", fix=fix), file,
                                 os.path.basename(os.path.abspath(run)), fix)
    return _pairs_in_every_row_or_none(rows, path)
