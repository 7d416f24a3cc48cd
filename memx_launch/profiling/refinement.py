"""Refinement of the design: where a design line's ratio to the analytical model is not linear
(the interpolation validator's test), the intervals around the kink are bisected with extra
measurements, within a refinement budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from memx_launch.profiling.interpolation import INTERPOLATED_PARAMETERS, line_kinks
from memx_launch.profiling.profiledb import Measurement
from memx_launch.profiling.space import ProfileSpace, Sample


@dataclass
class Refinement:
    """One configuration measured because its line was not linear."""

    parameter: str
    value: object
    line: dict
    """The other design parameters' values along the line."""
    metric: str
    trend: str
    r2: float
    error: float
    """Worst relative error of an interior point against its neighbours' line, when chosen."""
    round: int


def analytical_log_ratios(record: Measurement) -> tuple[float, float]:
    """log(measured / analytical) of time and memory (NaN without a memory measurement): the
    targets the predictor learns, so a line is judged on what the predictor must interpolate."""
    from memx_launch.profiling.features import training_rows

    ts = training_rows([record])
    return float(ts.Y[0, 0]), float(ts.Y[0, 1]) if ts.has_memory[0] else math.nan


def refine_design(space: ProfileSpace, measured: dict[Sample, Measurement], parameters: Sequence[str],
                  measure: Callable[[list[Sample]], list[Measurement]], budget: int) -> list[Refinement]:
    """Bisect the intervals around each kink of the measured lines, in rounds, within ``budget``.

    A line is the feasible measurements that differ only in one design parameter; its time and
    memory ratios to the analytical model are checked against log2 of the parameter's value by
    :func:`augment.line_kinks`. Per line and round the worst kink with an untested value
    beside it gets the untested value halfway in index into each interval on either side (the
    kink lies in one of them, which one is unknown). Candidates are taken worst line first until
    the budget is spent; rounds repeat until no kink has an untested neighbour. Adds the new
    measurements to ``measured``.
    """
    ratios: dict[Sample, tuple[float, float]] = {}
    done: list[Refinement] = []
    round_no = 0
    while len(done) < budget:
        round_no += 1
        candidates: dict[Sample, tuple[float, int, Refinement]] = {}
        for name in parameters:
            if name not in INTERPOLATED_PARAMETERS:
                continue  # recompute levels are categories, not points on a line
            values = list(space.values[name])
            lines: dict[Sample, list[Sample]] = {}
            for s, m in measured.items():
                if m.feasible and m.time_s:
                    lines.setdefault(replace(s, **{name: getattr(space.default, name)}), []).append(s)
            for base, line in lines.items():
                if len(line) < 3:
                    continue
                line.sort(key=lambda s: getattr(s, name))
                for s in line:
                    if s not in ratios:
                        ratios[s] = analytical_log_ratios(measured[s])
                x = np.log2([getattr(s, name) for s in line])
                for k, metric in enumerate(("time", "memory")):
                    y = np.exp([ratios[s][k] for s in line])
                    if not np.all(np.isfinite(y)):
                        continue
                    noise = (np.array([(measured[s].time_spread_s or 0.0) / measured[s].time_s for s in line])
                             if metric == "time" else None)
                    kinks, trend, r2, worst = line_kinks(x, y, noise)
                    for i in kinks:
                        picks = [p for p in (_bisect(space, measured, base, name, values, line[j], line[j + 1])
                                             for j in (i - 1, i)) if p]
                        for sample, untested in picks:
                            ref = Refinement(name, getattr(sample, name),
                                             {p: getattr(base, p) for p in parameters if p != name},
                                             metric, trend, r2, worst, round_no)
                            if sample not in candidates or candidates[sample][0] < worst:
                                candidates[sample] = (worst, untested, ref)
                        if picks:
                            break
        if not candidates:
            break
        # Worst lines first; within a kink, the interval with more untested values first.
        chosen = sorted(candidates.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:budget - len(done)]
        new = [sample for sample, _ in chosen]
        measured.update(zip(new, measure(new)))
        done += [ref for _, (_, _, ref) in chosen]
    return done


def _bisect(space: ProfileSpace, measured: dict[Sample, Measurement], base: Sample, name: str, values: list,
            lo: Sample, hi: Sample) -> tuple[Sample, int] | None:
    """(the untested value of ``name`` nearest the middle index between ``lo`` and ``hi``, how
    many untested values lie between), or None when every value between was measured."""
    a, b = values.index(getattr(lo, name)), values.index(getattr(hi, name))
    untested = [i for i in range(a + 1, b) if replace(base, **{name: values[i]}) not in measured]
    if not untested:
        return None
    mid = min(untested, key=lambda i: abs(i - (a + b) / 2))
    return replace(base, **{name: values[mid]}), len(untested)
