"""Validated interpolation (paper section 3.2.2): more training points from sparse measurements.

Along each line of measurements that differ in one numeric parameter only, each metric (time,
memory) is checked against a linear fit, classified, and interpolated by the rule its class
allows:

| trend | test | rule |
|---|---|---|
| constant | (max - min) / mean < 5% | fixed value: the mean at every value in range |
| linear | R^2 >= 0.99 | large steps: the global linear fit at every value in range |
| approximately linear | 0.95 <= R^2 < 0.99 | small steps: split at the measured points, piecewise linear |
| superlinear | R^2 < 0.95, monotone | shrink: only between neighbouring measured points, as a power law (straight in log-log), never the global fit |
| non-monotone | direction changes | skip: no point added |

The superlinear rule follows the paper's "nonlinear cases need nonlinear interpolation":
TP, sequence length and attention scale as powers, so each interval between two measured
neighbours is bridged by the power law through them. A point is added only where every
measured metric of the line may be interpolated, at the values of the profile space
strictly between measured ones.
No torch import here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from memx_launch.profiling.profiledb import Measurement

INTERPOLATED_PARAMETERS = ("micro_batch_size", "seq_len", "tp", "num_kv_heads")
METRICS = ("time_s", "peak_memory_bytes")
CONSTANT_CHANGE = 0.05
LINEAR_R2 = 0.99
APPROX_LINEAR_R2 = 0.95
REFINE_ERROR = 0.10
"""An interior point of a measured line further than this (relative) from the straight line
through its two neighbours is a kink that the profiler measures around: the same margin over
repeat-to-repeat noise as the profiler's impact threshold, so noise alone does not buy points."""
NOISE_MARGIN = 2.0
"""A kink must stand this many times above the interquartile spread of the repeats."""
RULES = {"constant": "fixed value", "linear": "large steps", "approximately linear": "small steps (split)",
         "superlinear": "shrink (neighbours, power law)", "non-monotone": "skip"}


@dataclass
class TrendCheck:
    parameter: str
    metric: str
    values: list
    r2: float
    trend: str
    rule: str
    points_added: int = 0


@dataclass
class Augmentation:
    points: list[Measurement]
    checks: list[TrendCheck]

    def summary(self) -> str:
        """Rules applied per parameter-metric pair, with counts."""
        table: dict[tuple, list[TrendCheck]] = {}
        for c in self.checks:
            table.setdefault((c.parameter, c.metric, c.trend), []).append(c)
        lines = [f"interpolation: {len(self.points)} points added from {len(self.checks)} checked lines"]
        for (param, metric, trend), checks in sorted(table.items()):
            r2 = np.mean([c.r2 for c in checks])
            lines.append(f"  {param:<17} -> {metric:<17} {trend:<21} mean R^2 {r2:5.3f}  rule: {RULES[trend]:<29}"
                         f" lines {len(checks):>3}  points {sum(c.points_added for c in checks):>4}")
        return "\n".join(lines)


def parameter_value(record: Measurement, name: str):
    return record.block_shape["num_kv_heads"] if name == "num_kv_heads" else getattr(record, name)


def _with_value(record: Measurement, name: str, value) -> Measurement:
    if name == "num_kv_heads":
        return replace(record, block_shape={**record.block_shape, "num_kv_heads": int(value)})
    return replace(record, **{name: int(value)})


def _line_key(record: Measurement, name: str) -> str:
    fields = {"device_type": record.device_type, "device": record.device, "model": record.model_signature,
              "shape": {k: v for k, v in record.block_shape.items() if k != name}, "dtype": record.dtype,
              "software": record.software, "blocks": record.num_blocks, "slowdown": record.emulation_slowdown,
              "link": record.tp_link_gbps if name != "tp" else None}
    for p in ("tp", "micro_batch_size", "seq_len", "recompute"):
        if p != name:
            fields[p] = getattr(record, p)
    return json.dumps(fields, sort_keys=True)


MONOTONE_TIMES = ("time_s", "embedding_time_s", "head_time_s")


def monotone_in_micro_batch(records: Sequence[Measurement]) -> tuple[list[Measurement], int]:
    """The records (in their order) with every time that exceeds a larger micro-batch's on the
    same line capped at the least of those: more samples through the same block are no less
    work, so such a time is the measurement's own (a warm-up, a first collective's setup) and
    would be learned as slow plans. Sailor's OPT-350 profile on GH200 times micro-batch 1 at TP 4
    35% above micro-batch 2 (block, embedding and head alike). Returns the records and how many
    times were capped."""
    out, capped = list(records), 0
    lines: dict[str, list[int]] = {}
    for i, r in enumerate(out):
        if r.feasible and r.time_s:
            lines.setdefault(_line_key(r, "micro_batch_size"), []).append(i)
    for line in lines.values():
        by_size: dict[int, list[int]] = {}
        for i in line:
            by_size.setdefault(out[i].micro_batch_size, []).append(i)
        for metric in MONOTONE_TIMES:
            least = float("inf")  # over strictly larger micro-batches: repeats of one are not capped by each other
            for size in sorted(by_size, reverse=True):
                values = [(i, getattr(out[i], metric)) for i in by_size[size]]
                for i, value in values:
                    if value is not None and value > least:
                        out[i] = replace(out[i], **{metric: least})
                        capped += 1
                least = min([least] + [v for _, v in values if v is not None])
    return out, capped


def classify_trend(x: np.ndarray, y: np.ndarray) -> tuple[str, float]:
    """(trend, R^2 of the linear fit)."""
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = ((y - y.mean()) ** 2).sum()
    r2 = float(1.0 - (residual**2).sum() / total) if total > 0 else 1.0
    if (y.max() - y.min()) / abs(y.mean()) < CONSTANT_CHANGE:
        return "constant", r2
    if r2 >= LINEAR_R2:
        return "linear", r2
    if r2 >= APPROX_LINEAR_R2:
        return "approximately linear", r2
    steps = np.sign(np.diff(y))
    if np.all(steps >= 0) or np.all(steps <= 0):
        return "superlinear", r2
    return "non-monotone", r2


def interior_errors(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative error of each interior point against the straight line through its two
    neighbours (``x`` increasing); what interpolating that point would have got wrong."""
    t = (x[1:-1] - x[:-2]) / (x[2:] - x[:-2])
    predicted = y[:-2] + t * (y[2:] - y[:-2])
    return np.abs(predicted / y[1:-1] - 1.0)


def line_kinks(x: np.ndarray, y: np.ndarray, noise: np.ndarray | None = None
               ) -> tuple[list[int], str, float, float]:
    """(kinks, trend, R^2, worst interior error) of a measured line.

    Kinks are interior points (indices into ``x``, worst first) where the line is not linear
    enough to interpolate: those off their neighbours' line by more than :data:`REFINE_ERROR`,
    or, when the validator calls the whole line superlinear or non-monotone (R^2 < 0.95, not
    constant), at least its worst interior point. ``noise`` (relative spread of each point's
    repeats) raises the bar to :data:`NOISE_MARGIN` times the noisiest of the three points, so
    that a noisy machine does not spend the budget on its own jitter."""
    trend, r2 = classify_trend(x, y)
    errors = interior_errors(x, y)
    jitter = np.zeros(errors.shape)
    if noise is not None and errors.size:
        jitter = NOISE_MARGIN * np.maximum(np.maximum(noise[:-2], noise[1:-1]), noise[2:])
    order = np.argsort(-errors, kind="stable")
    bad = [int(i) + 1 for i in order if errors[i] > max(REFINE_ERROR, jitter[i])]
    if not bad and trend in ("superlinear", "non-monotone") and errors.size and errors[order[0]] > jitter[order[0]]:
        bad = [int(order[0]) + 1]
    return bad, trend, r2, float(errors.max(initial=0.0))


def _interpolate(x: np.ndarray, y: np.ndarray, new_x: np.ndarray) -> tuple[str, float, np.ndarray]:
    """(trend, R^2, values at new_x); NaN everywhere when the rule is skip."""
    trend, r2 = classify_trend(x, y)
    if trend == "constant":
        return trend, r2, np.full(new_x.shape, y.mean())
    if trend == "linear":
        slope, intercept = np.polyfit(x, y, 1)
        return trend, r2, slope * new_x + intercept
    if trend == "approximately linear":
        return trend, r2, np.interp(new_x, x, y)
    if trend == "superlinear":
        return trend, r2, np.exp(np.interp(np.log(new_x), np.log(x), np.log(y)))
    return trend, r2, np.full(new_x.shape, np.nan)


def augment_measurements(records: Iterable[Measurement], space_values: dict[str, Sequence] | None = None,
                         min_points: int = 3) -> Augmentation:
    """Interpolated records along every line of at least ``min_points`` measured values.

    ``space_values`` gives, per parameter, the values a point may be added at; by default the
    powers of two between the measured extremes (for KV heads, those dividing the head count).
    """
    feasible = [r for r in records if r.feasible and r.time_s]
    measured_keys = {r.key for r in feasible}
    points: list[Measurement] = []
    checks: list[TrendCheck] = []
    for name in INTERPOLATED_PARAMETERS:
        lines: dict[str, list[Measurement]] = {}
        for r in feasible:
            lines.setdefault(_line_key(r, name), []).append(r)
        for line in lines.values():
            by_value = {parameter_value(r, name): r for r in line}
            if len(by_value) < min_points:
                continue
            x = np.array(sorted(by_value), dtype=np.float64)
            rows = [by_value[v] for v in sorted(by_value)]
            candidates = _candidate_values(name, x, space_values, rows[0].block_shape["num_heads"])
            line_checks, interpolated = [], {}
            for metric in METRICS:
                y = np.array([getattr(r, metric) or np.nan for r in rows], dtype=np.float64)
                if not np.all(np.isfinite(y)) or np.any(y <= 0):
                    continue  # not measured on this line (e.g. time-only public profiles)
                trend, r2, values = _interpolate(x, y, candidates)
                line_checks.append(TrendCheck(name, metric, x.tolist(), r2, trend, RULES[trend]))
                interpolated[metric] = values
            checks += line_checks
            if not interpolated:
                continue
            allowed = np.all([np.isfinite(v) for v in interpolated.values()], axis=0)
            added = 0
            for i, value in enumerate(candidates):
                if not allowed[i]:
                    continue  # some metric of this line may not be interpolated here
                point = _with_value(rows[0], name, value)
                point = replace(point, source=f"interpolated:{name}", time_spread_s=None,
                                **{m: float(v[i]) for m, v in interpolated.items()})
                if point.key not in measured_keys:
                    measured_keys.add(point.key)
                    points.append(point)
                    added += 1
            for c in line_checks:
                c.points_added = added
    return Augmentation(points, checks)


def _candidate_values(name: str, x: np.ndarray, space_values: dict[str, Sequence] | None,
                      num_heads: int) -> np.ndarray:
    lo, hi = x[0], x[-1]
    if space_values and name in space_values:
        values = np.array(sorted(space_values[name]), dtype=np.float64)
    else:
        values = 2.0 ** np.arange(np.floor(np.log2(lo)), np.ceil(np.log2(hi)) + 1)
    keep = (values > lo) & (values < hi) & ~np.isin(values, x)
    if name == "num_kv_heads":  # a KV-head count must divide the query heads
        keep &= num_heads % values == 0
    return values[keep]
