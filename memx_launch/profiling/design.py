"""The minimal sample set (paper section 3.2.1): which configurations to measure.

An ablation (one parameter at a time around the defaults) classifies parameters as high or low
impact, then a three-point design (min, mid, max) spans the high-impact ones, within a
measurement budget; :mod:`refinement` then bisects lines that are not linear. A device type
joining a profiled fleet needs only :func:`new_type_design`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence, TypeVar


from memx_launch.profiling.interpolation import APPROX_LINEAR_R2, REFINE_ERROR
from memx_launch.errors import ConfigError, MemxError, NoFeasiblePlanError
from memx_launch.profiling.profiledb import Measurement
from memx_launch.profiling.refinement import Refinement, refine_design
from memx_launch.profiling.space import PARAMETERS, ProfileSpace, Sample


IMPACT_THRESHOLD = 0.10
"""A parameter is high impact when moving it from its smallest to its largest value (the
others at defaults) changes time or memory by more than 10% of the value at the defaults:
above typical repeat-to-repeat noise on a shared machine (a few percent), well below the
factor-of-two moves of micro-batch, sequence length or TP."""


REFINE_SHARE = 3
"""Default refinement budget: the design count divided by this, i.e. as many points as one more
value on every line of one design parameter (3^(k-1) for a 3^k design)."""


@dataclass
class ParameterImpact:
    name: str
    time_change: float
    """(max - min) / value at defaults, over the ablation line of this parameter."""
    memory_change: float
    high: bool
    single_value: bool = False
    """The space gives this parameter one value (e.g. TP on a single process): nothing to vary."""


@dataclass
class MinimalSet:
    """What the minimal-set profiler measured, and why."""

    measurements: list[Measurement]
    impact: list[ParameterImpact]
    design_parameters: list[str]
    """High-impact parameters spanned by the three-point design (within the budget)."""
    ablation_count: int
    design_count: int
    measured_count: int
    full_grid_size: int
    dropped_for_budget: list[str] = field(default_factory=list)
    refinement_budget: int = 0
    refinements: list["Refinement"] = field(default_factory=list)
    few_sample: bool = False
    """Measured by :func:`new_type_design` (a budget below the ablation): no ablation, no design."""

    def summary(self) -> str:
        if self.few_sample:
            configs = ", ".join(f"tp={m.tp} micro-batch={m.micro_batch_size}" for m in self.measurements)
            return (f"few-sample profile of a device type joining a profiled fleet: {configs}\n"
                    f"measured {self.measured_count} configurations of a full grid of {self.full_grid_size}; "
                    "fit the predictor on one profile holding the other types too (same --out file)")
        lines = [f"ablation (threshold {IMPACT_THRESHOLD:.0%} change of time or memory):"]
        for p in self.impact:
            if p.single_value:
                lines.append(f"  {p.name:<17} one value in the space: fixed")
                continue
            lines.append(f"  {p.name:<17} time {p.time_change:+7.1%}  memory {p.memory_change:+7.1%}  "
                         f"-> {'high' if p.high else 'low'} impact")
        if self.dropped_for_budget:
            lines.append(f"  fixed at defaults to fit the budget: {', '.join(self.dropped_for_budget)}")
        lines.append(f"three-point design over {', '.join(self.design_parameters) or 'nothing'}: "
                     f"{self.design_count} configurations")
        lines.append(f"refinement (ratio to the analytical model off the line through its neighbours by more "
                     f"than {REFINE_ERROR:.0%}, or R^2 < {APPROX_LINEAR_R2}; budget {self.refinement_budget}): "
                     f"{len(self.refinements)} configurations")
        for r in self.refinements:
            at = ", ".join(f"{k}={v}" for k, v in r.line.items()) or "defaults"
            lines.append(f"  round {r.round}: {r.parameter}={r.value} on the line {at} ({r.metric}: {r.trend}, "
                         f"R^2 {r.r2:.2f}, worst interior point off by {r.error:.0%})")
        lines.append(f"measured {self.measured_count} configurations ({self.ablation_count} ablation, "
                     f"{len(self.refinements)} refinement, the rest design) of a full grid of {self.full_grid_size}")
        return "\n".join(lines)


def ablation_samples(space: ProfileSpace) -> list[Sample]:
    """The defaults, then each parameter at its min and max with the others at defaults."""
    out = [space.default]
    for name in PARAMETERS:
        vals = space.values[name]
        for v in (vals[0], vals[-1]):
            s = replace(space.default, **{name: v})
            if s not in out:
                out.append(s)
    return out


def classify_impact(space: ProfileSpace, measurements: dict[Sample, Measurement],
                    threshold: float = IMPACT_THRESHOLD) -> list[ParameterImpact]:
    """Relative change of time and memory along each parameter's ablation line.

    An out-of-memory end of the line counts as high impact on memory: the parameter decides
    feasibility.
    """
    base = measurements[space.default]
    if not base.feasible:
        raise ConfigError("profile_space.default", "the default configuration ran out of memory",
                          "choose smaller defaults (micro-batch, sequence length)")
    out = []
    for name in PARAMETERS:
        vals = space.values[name]
        if len(vals) == 1:
            out.append(ParameterImpact(name, 0.0, 0.0, False, single_value=True))
            continue
        line = [measurements[replace(space.default, **{name: v})] for v in dict.fromkeys((vals[0], vals[-1]))]
        if any(not m.feasible for m in line):
            out.append(ParameterImpact(name, math.inf, math.inf, True))
            continue
        times = [m.time_s for m in line] + [base.time_s]
        mems = [m.peak_memory_bytes for m in line] + [base.peak_memory_bytes]
        dt = (max(times) - min(times)) / base.time_s
        # Time-only profiles (e.g. public ones) carry no memory.
        dm = (max(mems) - min(mems)) / base.peak_memory_bytes if all(mems) else 0.0
        out.append(ParameterImpact(name, dt, dm, max(dt, dm) > threshold))
    return out


def three_point_design(space: ProfileSpace, impact: list[ParameterImpact],
                       budget: int | None = None) -> tuple[list[Sample], list[str], list[str]]:
    """min/mid/max over the high-impact parameters, others at defaults.

    When the design exceeds ``budget``, the least impactful parameters are fixed at their
    defaults first; a single remaining parameter is cut to its extremes last.
    Returns (samples, design parameters, parameters dropped for the budget).
    """
    high = sorted((p for p in impact if p.high and len(space.values[p.name]) > 1),
                  key=lambda p: -max(p.time_change, p.memory_change))
    names = [p.name for p in high]
    dropped = []

    def grid(params):
        axes = [space.three_points(n) for n in params]
        return [replace(space.default, **dict(zip(params, combo))) for combo in itertools.product(*axes)]

    samples = grid(names)
    while budget is not None and len(samples) > budget and names:
        dropped.append(names.pop())
        samples = grid(names)
    if budget is not None and len(samples) > budget:
        samples = samples[:budget]
    return samples, names, dropped


C = TypeVar("C")


def new_type_design(candidates: Sequence[C], budget: int, *, levels: Callable[[C], Iterable],
                    centre: Callable[[C], float], position: Callable[[C], float],
                    group: Callable[[C], object] = lambda _c: None) -> list[C]:
    """At most ``budget`` of ``candidates`` for a device type joining a fleet already profiled.

    With a handful of samples the trees learned on the other types give the shape, and the
    samples must pin the new type's level wherever its level can differ (``predictor.Offsets``):
    first every level in ``levels(c)`` is covered (each TP degree, a communication path of its
    own; in a benchmark over several models, each model too), greedily by how many uncovered
    levels a candidate adds, nearest the defaults (smallest ``centre``) first; the rest of the
    budget goes to the candidate farthest in ``position`` (log2 micro-batch) from those already
    chosen in its ``group``, which pins the slope. Ties keep the order of ``candidates``.
    """
    chosen: list[C] = []
    while len(chosen) < min(budget, len(candidates)):
        covered = {level for c in chosen for level in levels(c)}

        def score(c, covered=covered):
            new = sum(level not in covered for level in levels(c))
            if new:
                return (-new, centre(c))
            nearest = min((abs(position(c) - position(o)) for o in chosen if group(o) == group(c)), default=0.0)
            return (0, -nearest)

        chosen.append(min((c for c in candidates if c not in chosen), key=score))
    return chosen


def nothing_fits(measurements: list[Measurement]) -> MemxError:
    """Every ablation sample, the leanest (smallest micro-batch, full recompute) included, ran out
    of memory: the device cannot hold the model at all, said as the planner says it (how much
    is short, when an emulated device measured its peak)."""
    leanest = min(measurements, key=lambda m: m.peak_memory_bytes or math.inf)
    capacity = (leanest.device.get("memory_gib") or 0) * 2**30
    what = f"{leanest.model} does not fit {leanest.device_type}"
    if leanest.peak_memory_bytes is None or not capacity:
        return ConfigError("profile", f"{what}: every profiled configuration of its block ran out of memory",
                           "use devices with more memory or a smaller model")
    return NoFeasiblePlanError(
        f"{what}: its leanest profiled configuration ({leanest.num_blocks} block(s), micro-batch "
        f"{leanest.micro_batch_size}, recompute {leanest.recompute}) peaked at {leanest.peak_memory_bytes / 2**20:.1f} "
        f"MiB of {capacity / 2**20:.1f} MiB: {leanest.device_type} short "
        f"{(leanest.peak_memory_bytes - capacity) / 2**20:.1f} MiB per device; use devices with more memory or a "
        "smaller model")


def recentred(space: ProfileSpace, measured: dict[Sample, Measurement]) -> ProfileSpace:
    """``space`` around the heaviest measured sample that fits, when its default did not."""
    fitting = [s for s, m in measured.items() if m.feasible]
    if not fitting:
        raise nothing_fits(list(measured.values()))
    return replace(space, default=max(fitting, key=lambda s: measured[s].peak_memory_bytes or 0.0))


def minimal_sample_set(space: ProfileSpace, measure: Callable[[list[Sample]], list[Measurement]], *,
                       budget: int | None = None, threshold: float = IMPACT_THRESHOLD,
                       refine_budget: int | None = None) -> MinimalSet:
    """Ablation, the three-point design, then refinement of non-linear lines; ``measure`` runs
    samples (e.g. :func:`calibrate`).

    ``budget`` bounds the total number of measurements, ablation and refinement included.
    ``refine_budget`` bounds the refinement alone (default: the design count // REFINE_SHARE).
    A budget below the ablation's size measures :func:`new_type_design` over TP and micro-batch
    instead: enough for a device type added to a fleet whose other types are profiled.
    """
    ablation = ablation_samples(space)
    if budget is not None and budget < len(ablation):
        if budget < 1:
            raise ConfigError("--budget", f"must be 1 or more, got {budget}", "e.g. --budget 5")
        default_mbs = math.log2(space.default.micro_batch_size)
        grid = [replace(space.default, tp=t, micro_batch_size=m)
                for t in space.values["tp"] for m in space.values["micro_batch_size"]]
        few = new_type_design(grid, budget, levels=lambda s: (s.tp,),
                              centre=lambda s: abs(math.log2(s.micro_batch_size) - default_mbs),
                              position=lambda s: math.log2(s.micro_batch_size))
        measured = measure(few)
        return MinimalSet(measured, impact=[], design_parameters=[], ablation_count=0, design_count=len(few),
                          measured_count=len(few), full_grid_size=space.full_grid_size, few_sample=True)
    measured = dict(zip(ablation, measure(ablation)))
    if not measured[space.default].feasible:  # a small device: centre the design on what fits
        space = recentred(space, measured)
        ablation = ablation_samples(space)
        new = [s for s in ablation if s not in measured]
        measured.update(zip(new, measure(new)))
    impact = classify_impact(space, measured, threshold)
    design_budget = None if budget is None else budget - len(measured)
    # Design points already measured in the ablation do not count against the budget.
    samples, names, dropped = three_point_design(space, impact, None)
    while design_budget is not None and len([s for s in samples if s not in measured]) > design_budget:
        samples, names, dropped = three_point_design(space, impact, len(samples) - 1)
    new = [s for s in samples if s not in measured]
    measured.update(zip(new, measure(new)))
    refine = len(samples) // REFINE_SHARE if refine_budget is None else refine_budget
    if budget is not None:
        refine = min(refine, budget - len(measured))
    refinements = refine_design(space, measured, names, measure, refine)
    return MinimalSet(list(measured.values()), impact, names, len(ablation), len(samples), len(measured),
                      space.full_grid_size, dropped, refine, refinements)
