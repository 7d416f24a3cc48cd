"""Minimal-set profiler (paper section 3.2.1): the calibration kernel and the sampling plan.

The kernel runs forward + backward of ``num_blocks`` LLaMA blocks of the model's shape on this
rank's device for one configuration, and measures the median time of several repeats and the
peak memory above the resting state (weights, gradients, input). Which configurations to
run is decided per device type: an ablation (one parameter at a time around the defaults)
classifies parameters as high or low impact, then a three-point design (min, mid, max) spans
the high-impact ones, within a measurement budget. Where a design line's ratio to the
analytical model is not linear (the interpolation validator's test), the intervals around the
kink are bisected with extra measurements, within a refinement budget.

torch is imported lazily inside the kernel, so the sampling plan stays importable anywhere.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence, TypeVar

import numpy as np

from memx_launch.augment import APPROX_LINEAR_R2, INTERPOLATED_PARAMETERS, REFINE_ERROR, line_kinks
from memx_launch.errors import ConfigError
from memx_launch.plan import RECOMPUTE_LEVELS
from memx_launch.profiledb import Measurement
from memx_launch.specs import DTYPE_BYTES, DeviceType, ModelSpec

PARAMETERS = ("tp", "micro_batch_size", "seq_len", "recompute", "num_kv_heads")
IMPACT_THRESHOLD = 0.10
"""A parameter is high impact when moving it from its smallest to its largest value (the
others at defaults) changes time or memory by more than 10% of the value at the defaults:
above typical repeat-to-repeat noise on a shared machine (a few percent), well below the
factor-of-two moves of micro-batch, sequence length or TP."""
REFINE_SHARE = 3
"""Default refinement budget: the design count divided by this, i.e. as many points as one more
value on every line of one design parameter (3^(k-1) for a 3^k design)."""


@dataclass(frozen=True)
class Sample:
    """One configuration to calibrate."""

    tp: int
    micro_batch_size: int
    seq_len: int
    recompute: str
    num_kv_heads: int

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ConfigError("recompute", f"unknown level {self.recompute!r}",
                              f"use one of {', '.join(RECOMPUTE_LEVELS)}")


@dataclass(frozen=True)
class ProfileSpace:
    """The values each profiled parameter may take, in increasing order, and the defaults
    (the centre of the ablation)."""

    values: dict[str, tuple]
    default: Sample

    def __post_init__(self):
        for name in PARAMETERS:
            vals = self.values.get(name)
            if not vals:
                raise ConfigError(f"profile_space.{name}", "no values", "give at least one value")
            if getattr(self.default, name) not in vals:
                raise ConfigError(f"profile_space.{name}", f"default {getattr(self.default, name)!r} is not "
                                  "among the values", "add it to the values")

    @property
    def full_grid_size(self) -> int:
        return math.prod(len(self.values[p]) for p in PARAMETERS)

    def three_points(self, name: str) -> tuple:
        """(min, mid, max) of a parameter, fewer when it has fewer values. The mid is the
        default when it lies strictly inside, so the ablation's points are design points too."""
        vals = self.values[name]
        default = getattr(self.default, name)
        mid = default if vals[0] != default != vals[-1] else vals[len(vals) // 2]
        return tuple(dict.fromkeys((vals[0], mid, vals[-1])))


def default_space(model: ModelSpec, *, tp_degrees: Sequence[int] = (1,), max_micro_batch: int = 8,
                  seq_lens: Sequence[int] | None = None) -> ProfileSpace:
    """Powers of two for micro-batch; sequence lengths up to the model's; every level of
    recompute; the KV-head counts (query groups) that divide the model's heads."""
    mbs = tuple(2**i for i in range(int(math.log2(max_micro_batch)) + 1))
    seqs = tuple(seq_lens) if seq_lens else tuple(sorted({max(16, model.seq_len // 4), max(16, model.seq_len // 2),
                                                          model.seq_len}))
    kv = tuple(k for k in range(1, model.num_heads + 1)
               if model.num_heads % k == 0 and all(k % t == 0 for t in tp_degrees))
    tps = tuple(sorted(tp_degrees))
    default = Sample(tp=tps[0], micro_batch_size=mbs[len(mbs) // 2], seq_len=seqs[len(seqs) // 2],
                     recompute="none", num_kv_heads=model.num_kv_heads if model.num_kv_heads in kv else kv[-1])
    return ProfileSpace({"tp": tps, "micro_batch_size": mbs, "seq_len": seqs, "recompute": RECOMPUTE_LEVELS,
                         "num_kv_heads": kv}, default)


# --------------------------------------------------------------------------- sampling plan


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


def analytical_log_ratios(record: Measurement) -> tuple[float, float]:
    """log(measured / analytical) of time and memory (NaN without a memory measurement): the
    targets the predictor learns, so a line is judged on what the predictor must interpolate."""
    from memx_launch.predictor import training_rows

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
    impact = classify_impact(space, measured, threshold)
    design_budget = None if budget is None else budget - len(ablation)
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


# --------------------------------------------------------------------------- calibration kernel


def software_versions() -> dict:
    import torch
    from importlib.metadata import PackageNotFoundError, version

    try:
        memx = version("memx")
    except PackageNotFoundError:
        memx = "unknown"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "memx": memx}


def detect_device_type(device: str = "cpu", name: str | None = None) -> DeviceType:
    """Descriptors of this machine's device: capacity from the OS or driver, compute from a
    short matmul run (what the analytical model should take as sustained TFLOPS)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        memory_gib, vendor = props.total_memory / 2**30, "amd" if torch.version.hip else "nvidia"
        default_name, dtype = props.name.replace(" ", "-"), torch.bfloat16
    else:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        vendor, default_name, dtype = "cpu", "cpu", torch.float32
    n = 1024 if dev.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    rates = []
    for _ in range(4):
        _sync(dev)
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        rates.append(2 * n**3 / (time.perf_counter() - t0) / 1e12)
    src, dst = torch.ones(64 * 2**20 // 4, device=dev), torch.zeros(64 * 2**20 // 4, device=dev)
    seconds = []
    for _ in range(3):  # the first copy also faults the pages in
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        seconds.append(time.perf_counter() - t0)
    bandwidth = 2 * src.numel() * 4 / min(seconds[1:]) / 1e9
    # Two significant digits, so reruns on the same machine give the same descriptors.
    return DeviceType(name=name or default_name, vendor=vendor, memory_gib=_round2(memory_gib),
                      peak_tflops=_round2(max(rates[1:])), efficiency=1.0,
                      memory_bandwidth_gbps=_round2(bandwidth), flash_attention=True)


def _round2(x: float) -> float:
    return float(f"{x:.2g}")


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _is_oom(exc: BaseException) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def calibrate(spec: ModelSpec, device_type: DeviceType, samples: Iterable[Sample], *, device: str = "cpu",
              tp_group=None, dtype: str = "fp32", num_blocks: int = 2, warmup: int = 1, repeats: int = 5,
              emulation_slowdown: float = 1.0, tp_link_gbps: float | None = None,
              progress: Callable[[Sample], None] | None = None) -> list[Measurement]:
    """Measure forward + backward of ``num_blocks`` blocks for each sample, on this rank.

    ``tp_group`` is a process group of same-type ranks for samples with tp > 1 (every rank of
    the group calls this with the same samples); samples whose TP does not match the group
    size are an error. ``emulation_slowdown`` multiplies measured time (CPU stand-ins for
    slower devices) and labels the records emulated. Out-of-memory samples come back with
    ``feasible=False``; so do samples whose peak exceeds an emulated device's capacity.
    """
    import torch

    if dtype not in DTYPE_BYTES:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
    samples = list(samples)
    group_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    for s in samples:
        if s.tp != group_size:
            raise ConfigError("tp", f"sample tp={s.tp} but this rank's TP group has {group_size} rank(s)",
                              "calibrate TP>1 samples inside a group of that many same-type ranks")
    software = software_versions()
    out = []
    for s in samples:
        shape = replace(spec, num_kv_heads=s.num_kv_heads)
        try:
            time_s, spread_s, peak, reserved = _run_sample(shape, s, torch.device(device), tp_group, dtype,
                                                           num_blocks, warmup, repeats)
            feasible = True
        except (RuntimeError, MemoryError) as exc:
            if not _is_oom(exc):
                raise
            time_s = spread_s = peak = reserved = None
            feasible = False
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        emulated = emulation_slowdown != 1.0
        if feasible and emulated and peak > device_type.memory_bytes:
            feasible = False
        out.append(Measurement(
            device_type=device_type.name,
            device={k: v for k, v in asdict(device_type).items() if k != "name"},
            model=spec.name, model_signature=spec.signature(),
            block_shape=shape.to_dict(),
            tp=s.tp, micro_batch_size=s.micro_batch_size, seq_len=s.seq_len, recompute=s.recompute,
            dtype=dtype, num_blocks=num_blocks, feasible=feasible,
            time_s=None if time_s is None else time_s * emulation_slowdown,
            time_spread_s=None if spread_s is None else spread_s * emulation_slowdown,
            peak_memory_bytes=peak, peak_reserved_bytes=reserved, tp_link_gbps=tp_link_gbps if s.tp > 1 else None,
            emulation_slowdown=emulation_slowdown, emulated=emulated, software=software))
        if progress is not None:
            progress(s)
    return out


def _run_sample(shape: ModelSpec, s: Sample, dev, tp_group, dtype: str, num_blocks: int, warmup: int,
                repeats: int) -> tuple[float, float, float, float | None]:
    """(median seconds per block, interquartile range per block, peak bytes above resting,
    peak bytes the caching allocator reserved above resting (GPUs; None on CPUs))."""
    import torch

    from memx_launch.llama import TransformerBlock, apply_tensor_parallel

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    torch.manual_seed(0)  # identical weights and input on every rank of a TP group
    blocks = torch.nn.Sequential(*[TransformerBlock(shape, s.recompute) for _ in range(num_blocks)])
    blocks = blocks.to(device=dev, dtype=torch_dtype)
    if s.tp > 1:
        from torch.distributed.device_mesh import DeviceMesh

        apply_tensor_parallel(blocks, DeviceMesh.from_group(tp_group, dev.type))
    x = torch.randn(s.micro_batch_size, s.seq_len, shape.hidden_size, device=dev, dtype=torch_dtype,
                    requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        blocks(x).backward(dy)

    # Warm-up also allocates the gradients, which stay: they belong to the resting state.
    for _ in range(max(1, warmup)):
        step()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    peak, reserved = _peak_memory_bytes(step, dev)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return statistics.median(times) / num_blocks, (quartiles[2] - quartiles[0]) / num_blocks, peak, reserved


def _peak_memory_bytes(step: Callable[[], None], dev) -> tuple[float, float | None]:
    """Peak bytes of live tensors above the state before ``step``, and on GPUs the peak the
    caching allocator reserved above it (what an out-of-memory error is about).

    GPU: max_memory_allocated and max_memory_reserved. CPU: the profiler's memory events,
    which see every tensor allocation and free (the process RSS does not: freed blocks stay
    mapped and large ones bypass it); there is no allocator reserve to read.
    """
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        # Blocks the timed repeats left cached would hide what this step has to reserve.
        torch.cuda.empty_cache()
        resting, resting_reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        return (float(torch.cuda.max_memory_allocated(dev) - resting),
                float(torch.cuda.max_memory_reserved(dev) - resting_reserved))
    # Kineto prints a line per profiler start and stop unless told otherwise (6: silent).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return float(peak), None


# --------------------------------------------------------------------------- memx profile


def profile_model(spec: ModelSpec, device_type: DeviceType, space: ProfileSpace, *, device: str = "cpu",
                  budget: int | None = None, dtype: str = "fp32", num_blocks: int = 2, repeats: int = 5,
                  emulation_slowdown: float = 1.0, tp_link_gbps: float | None = None,
                  refine_budget: int | None = None, show_progress: bool = True) -> MinimalSet:
    """The minimal-set profile of one device type on this process's device (TP 1), with a
    progress bar per phase on stderr."""
    from tqdm import tqdm

    phases = itertools.chain(("ablation", "design"), itertools.repeat("refinement"))

    def measure(samples: list[Sample]) -> list[Measurement]:
        with tqdm(total=len(samples), desc=f"memx profile {next(phases)}", unit="config", file=sys.stderr,
                  disable=not show_progress or not samples, leave=False) as bar:
            return calibrate(spec, device_type, samples, device=device, dtype=dtype, num_blocks=num_blocks,
                             repeats=repeats, emulation_slowdown=emulation_slowdown, tp_link_gbps=tp_link_gbps,
                             progress=lambda _sample: bar.update())

    return minimal_sample_set(space, measure, budget=budget, refine_budget=refine_budget)
