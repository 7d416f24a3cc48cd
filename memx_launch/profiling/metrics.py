"""Accuracy of predictions against measurements: errors and ranking agreement.

Measurements file (``memx evaluate --measurements PATH``), CSV with a header or JSON (a list
of row objects, or ``{"rows": [...]}``), one row per configuration:

| column | required | meaning |
|---|---|---|
| ``config`` | yes | a name for the configuration (e.g. ``tp2-pp4-dp1-mbs2``) |
| ``predicted_time_s``, ``measured_time_s`` | yes | iteration (or block) time |
| ``predicted_memory_bytes``, ``measured_memory_bytes`` | no | peak memory |
| ``predicted_phi``, ``measured_phi`` | no | objective value (lower is better) |
| ``predicted_bridge_bytes``, ``measured_bridge_bytes`` | no | bytes sent between communication domains a step |

``memx estimate --cases``'s output (``.jsonl``) is read too: each row's ``iteration_time_s``,
``peak_memory_gib`` and ``phi`` against the ``measured_time_s`` and ``measured_peak_memory_gib``
it echoes, named by its ``id`` (else its row number); rows without a measured time or with an
error are left out, with a warning that counts them.

So is memx-run's ``metrics.jsonl``, or a run directory holding one, or a directory of run
directories: a row per generation of each run (the plan it ran under), its median step time
after the generation's first step (which allocates, connects and warms up) against the plan's,
its fullest stage's measured peak against the plan's fullest (where every stage measured
one) and, in a job across domains, the median bytes its ranks sent over the bridge a step
against the plan's count, named ``<run> gen N``.

A top-k hit rate is 1 when the configuration that is best by measurement is among the k best
by prediction (lower time or Phi is better), else 0. No torch import here.
"""

from __future__ import annotations

import csv
import io
import os
import warnings

import numpy as np
from scipy.stats import kendalltau, spearmanr

from memx_launch.errors import ConfigError
from memx_launch.planning.costmodel import GIB
from memx_launch.profiling.run_metrics import is_run_metrics, run_directory_rows, run_rows
from memx_launch.specs.inputs import MAX_NUMBER_CHARS, parse_json, parse_number, read_text

PAIRS = {"time": ("predicted_time_s", "measured_time_s"),
         "memory": ("predicted_memory_bytes", "measured_memory_bytes"),
         "phi": ("predicted_phi", "measured_phi"),
         "bridge": ("predicted_bridge_bytes", "measured_bridge_bytes")}
TOP_K = (1, 3, 5, 10)


def percentage_errors(predicted, measured) -> np.ndarray:
    """|predicted - measured| / measured, in percent."""
    predicted = np.asarray(predicted, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    return 100.0 * np.abs(predicted - measured) / np.abs(measured)


def error_summary(predicted, measured) -> dict:
    """MAPE, share of rows under 20% and over 50% error, and the largest error (percent)."""
    err = percentage_errors(predicted, measured)
    if err.size == 0:
        return {"n": 0}
    return {"n": int(err.size), "mape_pct": float(err.mean()), "under_20pct_share": float((err < 20).mean()),
            "over_50pct_share": float((err > 50).mean()), "max_error_pct": float(err.max())}


def ranking_summary(predicted, measured) -> dict:
    """Spearman and Kendall correlations and top-k hit rates (lower is better)."""
    predicted = np.asarray(predicted, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    out: dict = {"n": int(predicted.size)}
    if predicted.size >= 2:
        out["spearman"] = float(spearmanr(predicted, measured).statistic)
        out["kendall"] = float(kendalltau(predicted, measured).statistic)
    if predicted.size:
        best = int(np.argmin(measured))
        rank_of_best = int(np.sum(predicted < predicted[best]))
        out.update({f"top{k}_hit": float(rank_of_best < k) for k in TOP_K})
    return out


def evaluate(columns: dict[str, np.ndarray]) -> dict:
    """Errors for time and memory, rankings for time and Phi, for whichever pairs are present."""
    report = {}
    for metric, (pred, meas) in PAIRS.items():
        if pred in columns and meas in columns:
            entry = {}
            if metric != "phi":
                entry.update(error_summary(columns[pred], columns[meas]))
            if metric in ("time", "phi"):  # what a search ranks by
                entry["ranking"] = ranking_summary(columns[pred], columns[meas])
            report[metric] = entry
    return report


def load_measurements(path: str) -> dict[str, np.ndarray]:
    """Read a measurements file (format in this module's docstring) into numeric columns."""
    fix = "pass a CSV or JSON file of predicted vs measured values, or memx-run's run directories"
    rows = run_directory_rows(path, fix) if os.path.isdir(path) else _file_rows(path, fix)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ConfigError("--measurements", f"{path} holds no rows",
                          "give one row per configuration with predicted_time_s and measured_time_s")
    columns: dict[str, np.ndarray] = {"config": np.array([str(r.get("config", i)) for i, r in enumerate(rows)])}
    for pred, meas in PAIRS.values():
        for name in (pred, meas):
            if any(r.get(name) not in (None, "") for r in rows):
                try:  # float() takes '１.５' and 5,000 digits
                    if any(isinstance(r[name], str) and (not r[name].isascii() or len(r[name]) > MAX_NUMBER_CHARS)
                           for r in rows):
                        raise ValueError
                    columns[name] = np.array([float(r[name]) for r in rows])
                except (KeyError, TypeError, ValueError):
                    raise ConfigError(f"--measurements {path}: {name}", "missing or not a number in some rows",
                                      "fill the column in every row or drop it") from None
                if not np.isfinite(columns[name]).all():
                    raise ConfigError(f"--measurements {path}: {name}", "NaN or infinite in some rows",
                                      "give finite numbers")
    for name in PAIRS["time"]:
        if name not in columns:
            raise ConfigError(f"--measurements {path}", f"no {name} column",
                              "add predicted_time_s and measured_time_s (see docs/profiler.md)")
    if np.any(columns["measured_time_s"] <= 0):
        raise ConfigError(f"--measurements {path}: measured_time_s", "must be positive in every row")
    return columns


def _file_rows(path: str, fix: str):
    """The rows of one file, by its kind: memx-run's metrics, estimate output, JSON or CSV."""
    text = read_text(path, "--measurements", fix=fix)
    if path.endswith(".jsonl") and is_run_metrics(text):
        return run_rows(text, path, os.path.basename(os.path.dirname(os.path.abspath(path))), fix)
    if path.endswith(".jsonl"):
        return _estimate_rows(text, path, fix)
    if path.endswith(".json"):
        data = parse_json(text, "--measurements", path, fix)
        return data.get("rows") if isinstance(data, dict) else data
    try:
        return list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise ConfigError("--measurements", f"{path} is not valid CSV ({exc})", fix) from None


def _estimate_rows(text: str, path: str, fix: str) -> list[dict]:
    """``memx estimate --cases`` output as measurement rows: the estimate's values against the
    measured ones each row echoes."""
    rows, left_out = [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        estimate = parse_json(line, "--measurements", f"{path} line {n}", fix)
        if not isinstance(estimate, dict):
            raise ConfigError("--measurements", f"{path} line {n} is not a JSON object", fix)
        if "error" in estimate or estimate.get("measured_time_s") in (None, ""):
            left_out += 1
            continue
        row = {"config": str(estimate.get("id", f"row {estimate.get('row', n)}")),
               "predicted_time_s": estimate.get("iteration_time_s"), "measured_time_s": estimate["measured_time_s"],
               "predicted_phi": estimate.get("phi")}
        measured_gib = estimate.get("measured_peak_memory_gib")
        if measured_gib not in (None, ""):
            if isinstance(measured_gib, str):
                measured_gib = parse_number(measured_gib.strip(), float, f"--measurements {path} line {n}",
                                            "give measured_peak_memory_gib as a number")
            row["measured_memory_bytes"] = float(measured_gib) * GIB
            row["predicted_memory_bytes"] = float(estimate["peak_memory_gib"]) * GIB
        rows.append(row)
    if left_out:
        warnings.warn(f"{path}: {left_out} rows without measured_time_s or with an error left out")
    return rows


def format_report(report: dict) -> str:
    """The accuracy table `memx evaluate` prints."""
    lines = [f"{'metric':<8} {'n':>4} {'MAPE%':>7} {'<20%':>6} {'>50%':>6} {'max%':>7} "
             f"{'spearman':>8} {'kendall':>8}  top-1/3/5/10"]
    for metric, entry in report.items():
        rank = entry.get("ranking", {})
        n = entry.get("n", rank.get("n", 0))

        def fmt(key, src, scale=1.0, width=7, digits=2):
            return f"{src[key] * scale:>{width}.{digits}f}" if key in src else f"{'-':>{width}}"

        tops = "/".join(f"{int(rank[f'top{k}_hit'])}" for k in TOP_K) if "top1_hit" in rank else "-"
        lines.append(f"{metric:<8} {n:>4} {fmt('mape_pct', entry)} {fmt('under_20pct_share', entry, 100, 6, 0)}"
                     f" {fmt('over_50pct_share', entry, 100, 6, 0)} {fmt('max_error_pct', entry)}"
                     f" {fmt('spearman', rank, 1, 8, 3)} {fmt('kendall', rank, 1, 8, 3)}  {tops}")
    return "\n".join(lines)
