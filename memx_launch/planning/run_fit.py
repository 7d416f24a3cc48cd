"""A cluster file fitted to measured runs (``memx cluster fit``): each device type's matmul
efficiency from the iteration times its layouts measured, its memory overhead from their peaks.
No torch import.

The analytical model takes one number per device type that no datasheet gives: the share of
the peak its training matmuls sustain (``efficiency``). The rest it derives: memory-bound work,
collectives, the pipeline's bubbles, the host's issue time. A few measured steps of any layouts
on the user's own cluster pin that number: per device type, the efficiency that minimises the
squared log error of the predicted iteration times against the measured ones, with a weak pull
towards the file's value (:func:`fit_efficiencies`). A type whose rows' times do not move with
it (host- or link-bound rows) keeps its efficiency. The fit is the analytical model's: a type
planned with a profile DB computes as it was profiled.

Memory: a type's ``memory_overhead_gib`` (context and allocator reserve above the tensors)
moves by the median of measured minus predicted peak over the rows whose fullest stage runs on
it alone, never below the CUDA/HIP context.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import yaml

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.cases import CaseRunner, read_cases
from memx_launch.planning.peaks import matmul_peak_tflops, training_tflops
from memx_launch.specs.cluster import CONTEXT_GIB, DEFAULT_MEMORY_OVERHEAD_GIB, ClusterSpec, DeviceType
from memx_launch.specs.inputs import load_yaml, parse_number

MEASURED_TIME, MEASURED_PEAK = "measured_time_s", "measured_peak_memory_gib"
# Efficiencies the search spans: a share of the datasheet peak.
EFFICIENCY_RANGE = (0.02, 1.0)
# Golden-section steps per search: the interval shrinks to 0.618^20 of ln(50), 0.03% of an efficiency.
GOLDEN_STEPS = 20
# Sweeps over the directions at most, and the relative move below which an efficiency has settled.
MAX_SWEEPS, SETTLED = 8, 1e-3
# The least relative change of a row's time across EFFICIENCY_RANGE that lets the row inform a type.
SENSITIVE = 1e-3
# The pull towards a type's efficiency before the fit, per squared log of its move, against the
# rows' mean squared log error: where the rows barely tell a type's efficiency (its stages are
# seldom the slowest), it stays near the value it had; where they do, it moves (every row 1% off
# weighs as much as a move by a third, e^0.32).
PRIOR_WEIGHT = 1e-3
# Rows the command names as still furthest off after the fit.
WORST_ROWS = 3


def golden_minimum(f: Callable[[float], float], lo: float, hi: float, steps: int = GOLDEN_STEPS) -> float:
    """Where ``f`` is least on [lo, hi], for an ``f`` with one minimum there."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo + (1 - ratio) * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(steps):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - ratio) * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = f(b)
    return (a + b) / 2.0


def fit_efficiencies(predict: Callable[[dict], np.ndarray], measured, start: dict[str, float]) -> dict[str, float]:
    """The efficiency of each type of ``start`` (its value now) that minimises the squared log
    error of ``predict(efficiencies)``, the predicted times of the measured rows, against
    ``measured``, plus a weak pull towards ``start`` (:data:`PRIOR_WEIGHT`); a type no row's
    time moves with keeps its ``start``.

    Coordinate descent, each move a golden-section search along one direction: all types'
    efficiencies scaled together, then each type's alone, until none moves. The joint move is
    what frees a pipeline whose stages on two types are both its slowest: one type alone
    cannot speed it up.
    """
    def times_move(name: str) -> bool:
        ends = [np.asarray(predict({**start, name: e}), dtype=np.float64) for e in EFFICIENCY_RANGE]
        return bool(np.any(np.abs(ends[0] / ends[1] - 1.0) > SENSITIVE))

    free = [name for name in start if times_move(name)]
    log_measured = np.log(np.asarray(measured, dtype=np.float64))
    log_start = {name: math.log(e) for name, e in start.items()}
    fitted = dict(start)

    def loss(efficiencies: dict) -> float:
        predicted = np.asarray(predict(efficiencies), dtype=np.float64)
        return float(np.mean((np.log(predicted) - log_measured) ** 2)
                     + PRIOR_WEIGHT * sum((math.log(efficiencies[n]) - log_start[n]) ** 2 for n in free))

    directions = ([free] if len(free) > 1 else []) + [[name] for name in free]
    for _ in range(MAX_SWEEPS):
        moved = False
        for names in directions:
            factor = math.exp(golden_minimum(
                lambda x: loss({**fitted, **{n: fitted[n] * math.exp(x) for n in names}}),
                max(math.log(EFFICIENCY_RANGE[0] / fitted[n]) for n in names),
                min(math.log(EFFICIENCY_RANGE[1] / fitted[n]) for n in names)))
            moved |= abs(factor - 1.0) > SETTLED
            fitted.update({n: fitted[n] * factor for n in names})
        if not moved:
            break
    return fitted


def share_of_peak(device: DeviceType, training) -> float:
    """The efficiency ``device``'s predictions of ``training`` use now (given, or the default at
    its clock), as a share of the peak its matmuls run at (:mod:`~memx_launch.planning.peaks`)."""
    return training_tflops(device, training) / matmul_peak_tflops(device, training)


def fitted_overhead_gib(device: DeviceType, residuals_gib) -> float:
    """``device``'s fixed memory overhead moved by the median of its rows' measured minus
    predicted peaks; never below the context an accelerator's process always holds
    (:data:`~memx_launch.specs.cluster.CONTEXT_GIB`), nor above the device's memory."""
    floor = min(CONTEXT_GIB, DEFAULT_MEMORY_OVERHEAD_GIB.get(device.vendor, DEFAULT_MEMORY_OVERHEAD_GIB["unknown"]))
    moved = device.overhead_bytes / cm.GIB + float(np.median(residuals_gib))
    return float(min(max(moved, floor), device.memory_gib))


def _mape_pct(predicted, measured) -> float:
    predicted, measured = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return float(100.0 * np.mean(np.abs(predicted / measured - 1.0))) if len(measured) else math.nan


@dataclass(frozen=True)
class TypeFit:
    """One device type's fit: the rows that informed it and its numbers before and after."""
    device_type: str
    time_rows: int
    efficiency_before: float
    efficiency: float
    memory_rows: int
    overhead_before_gib: float
    overhead_gib: float


@dataclass(frozen=True)
class ClusterFit:
    """The fitted cluster file (``data``, the input file's mapping with the fitted fields), each
    type's fit and the rows' errors before and after (in-sample)."""
    data: dict
    types: tuple[TypeFit, ...]
    rows: int
    furthest_rows: tuple[tuple[int, str | None, float], ...]
    """(row number, its id, predicted over measured time after the fit) of the rows still furthest off."""
    time_mape_pct: tuple[float, float]
    memory_mape_pct: tuple[float, float]

    def errors(self) -> str:
        """The rows' MAPE before and after the fit, of what they measured."""
        parts = [f"{what} {before:.1f}% -> {after:.1f}%" for what, (before, after) in
                 (("iteration time", self.time_mape_pct), ("peak memory", self.memory_mape_pct))
                 if not math.isnan(before)]
        return f"in-sample MAPE over {self.rows} rows: " + ", ".join(parts)

    def furthest(self) -> str:
        """The rows the fitted model still misses most, predicted over measured time."""
        return "furthest off after the fit (predicted / measured time): " + ", ".join(
            f"row {n}{f' ({row_id})' if row_id not in (None, '') else ''} {ratio:.2f}x"
            for n, row_id, ratio in self.furthest_rows)

    def yaml_text(self, cases_path: str) -> str:
        header = (f"# Fitted by memx cluster fit to {self.rows} measured runs ({os.path.basename(cases_path)}): "
                  "efficiency from iteration times, memory_overhead_gib from peaks.\n"
                  f"# {self.errors()}.\n")
        return header + yaml.safe_dump(self.data, sort_keys=False)


def fit_cluster(cases_path: str, cluster_path: str, defaults: dict | None = None) -> ClusterFit:
    """``cluster_path`` fitted to the measured rows of ``cases_path`` (``memx estimate --cases``
    rows with ``measured_time_s`` and/or ``measured_peak_memory_gib``); ``defaults`` fill empty
    cells as ``memx estimate``'s flags do. Any bad row is an error: a fit over part of the file
    would move the cluster by the rows that happened to parse."""
    data = load_yaml(cluster_path, "--cluster", fix="pass a cluster YAML file (see examples/clusters/)")
    cluster = ClusterSpec.from_dict(data, default_name=os.path.splitext(os.path.basename(cluster_path))[0])
    base_dir = os.path.dirname(os.path.abspath(cases_path))
    rows = _measured_rows(cases_path, cluster_path, base_dir)
    runner = CaseRunner(base_dir, defaults, cluster=cluster)
    scored = [(n, row, *_scored(runner, n, row)) for n, row in rows]
    timed = [(n, row, scorer) for n, row, _, scorer in scored if MEASURED_TIME in row]
    if len({_on_cuda_cores(scorer.training) for _, _, scorer in timed}) > 1:
        raise ConfigError(MEASURED_TIME, "rows train both in fp32 on CUDA cores and in 16-bit or TF32: an "
                          "efficiency is a share of one peak or the other", "fit each kind in a file of its own")
    names = [d.name for d in cluster.device_types]

    def variant(efficiencies: dict) -> ClusterSpec:
        return dataclasses.replace(cluster, device_types=tuple(
            dataclasses.replace(d, efficiency=efficiencies.get(d.name, d.efficiency)) for d in cluster.device_types))

    def predict(efficiencies: dict) -> np.ndarray:
        again = CaseRunner(base_dir, defaults, cluster=variant(efficiencies))
        return np.array([float(again.score(row)[0].T[0]) for _, row, _ in timed])

    row_types = [{names[i] for i in np.unique(result.layout.replica_device)} for _, _, result, _ in scored]
    used = sorted(set().union(*row_types))
    training = (timed[0][2] if timed else scored[0][3]).training  # the timed rows' efficiency is one kind
    start = {name: share_of_peak(cluster.device_type(name), training) for name in used}
    efficiencies = fit_efficiencies(predict, [row[MEASURED_TIME] for _, row, _ in timed], start) if timed else start
    for name, efficiency in efficiencies.items():
        for bound, ran in zip(EFFICIENCY_RANGE, ("slower", "faster")):
            if efficiency != start[name] and abs(math.log(efficiency / bound)) < 0.01:
                warnings.warn(f"{name}: efficiency {efficiency:.3f} at the end of its range: the rows ran {ran} "
                              "than memx's model of them allows at any efficiency; check their options (dtype, "
                              "tf32, flash_attention, recompute, ...) against what the runs did")

    residuals: dict[str, list[float]] = {name: [] for name in used}
    for _, row, result, _ in scored:
        fullest = _fullest_type(result, names)
        if MEASURED_PEAK in row and fullest:
            residuals[fullest].append(row[MEASURED_PEAK] - float(result.memory[0].max()) / cm.GIB)
    overheads = {name: cluster.device_type(name).overhead_bytes / cm.GIB for name in used}
    fitted_overheads = {name: fitted_overhead_gib(cluster.device_type(name), residuals[name])
                        if residuals[name] else overheads[name] for name in used}

    time_rows = {name: sum(name in kinds for kinds, (_, row, _, _) in zip(row_types, scored) if MEASURED_TIME in row)
                 for name in used}
    types = tuple(TypeFit(name, time_rows[name], start[name], efficiencies[name], len(residuals[name]),
                          overheads[name], fitted_overheads[name]) for name in used)
    out = {**data, "device_types": {k: dict(v) for k, v in data["device_types"].items()}}
    for fit in types:
        entry = out["device_types"][fit.device_type]
        if fit.time_rows and fit.efficiency != fit.efficiency_before:
            entry["efficiency"] = round(fit.efficiency, 4)
        if fit.memory_rows:
            entry["memory_overhead_gib"] = round(fit.overhead_gib, 3)
    fitted = ClusterSpec.from_dict(out, default_name=cluster.name)
    after = CaseRunner(base_dir, defaults, cluster=fitted)
    rescored = [after.score(row)[0] for _, row, _, _ in scored]
    time_pairs = [(float(s[2].T[0]), float(r.T[0]), s[1][MEASURED_TIME], s[0], s[1].get("id"))
                  for s, r in zip(scored, rescored) if MEASURED_TIME in s[1]]
    # The rows the fitted model still misses most: where a row's options may not be the run's.
    furthest = sorted(time_pairs, key=lambda p: -abs(math.log(p[1] / p[2])))[:WORST_ROWS]
    peak_pairs = [(float(s[2].memory[0].max()) / cm.GIB, float(r.memory[0].max()) / cm.GIB, s[1][MEASURED_PEAK])
                  for s, r in zip(scored, rescored) if MEASURED_PEAK in s[1]]
    return ClusterFit(out, types, len(rows), tuple((n, row_id, after / measured) for _, after, measured, n, row_id in furthest),
                      tuple(_mape_pct([p[i] for p in time_pairs], [p[2] for p in time_pairs]) for i in (0, 1)),
                      tuple(_mape_pct([p[i] for p in peak_pairs], [p[2] for p in peak_pairs]) for i in (0, 1)))


def _measured_rows(cases_path: str, cluster_path: str, base_dir: str) -> list[tuple[int, dict]]:
    """The rows, each with its measured values as numbers; a row without one, with a bad one or
    naming another cluster file is an error."""
    rows = []
    for n, row in read_cases(cases_path):
        if isinstance(row, ConfigError):
            raise ConfigError(f"{cases_path} row {n}", f"{row.field}: {row.problem}", row.fix)
        cell = row.get("cluster")
        if cell not in (None, "") and os.path.realpath(os.path.join(base_dir, str(cell))) != os.path.realpath(cluster_path):
            raise ConfigError(f"{cases_path} row {n}", f"cluster {cell} is not --cluster {cluster_path}",
                              "fit one cluster file at a time: leave the column empty or name --cluster's file")
        measured = {}
        for column in (MEASURED_TIME, MEASURED_PEAK):
            if row.get(column) not in (None, ""):
                measured[column] = _positive(row[column], f"{cases_path} row {n}", column)
        if not measured:
            raise ConfigError(f"{cases_path} row {n}", f"no {MEASURED_TIME} nor {MEASURED_PEAK}",
                              "give what a real run of the row's layout measured")
        rows.append((n, {**row, **measured}))
    if not rows:
        raise ConfigError("--cases", f"{cases_path} holds no rows", "give one measured layout per row")
    return rows


def _positive(value, where: str, column: str) -> float:
    """A measured cell as a positive number, else one error naming the row and the column."""
    number = value
    if isinstance(value, str):
        try:
            number = parse_number(value.strip(), float, column, "write a number")
        except ConfigError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number < math.inf:
        shown = repr(value) if len(str(value)) <= 40 else repr(str(value)[:40]) + "..."
        raise ConfigError(where, f"{column} {shown} is not a positive number",
                          "give seconds per iteration and GiB per device")
    return float(number)


def _scored(runner: CaseRunner, n: int, row: dict):
    try:
        return runner.score(row)
    except ConfigError as exc:
        raise ConfigError(f"row {n}", f"{exc.field}: {exc.problem}", exc.fix) from None


def _on_cuda_cores(training) -> bool:
    """fp32 matmuls on CUDA cores, whose efficiency is a share of the fp32 peak."""
    return training.dtype == "fp32" and not training.tf32


def _fullest_type(result, names: list[str]) -> str | None:
    """The device type of the stage with the largest peak (a run's measured peak is its largest
    rank's), when the stage runs on one type."""
    stage = int(np.argmax(result.memory[0]))
    types = np.unique(result.layout.replica_device[:, stage])
    return names[int(types[0])] if len(types) == 1 else None
