"""Memory pressure -> the cheapest plan change the cost model says is enough. No torch import.

The monitor (monitor.py) hands over a :class:`ReplanEvent`: what every rank observed, the rank
and stage under pressure, and why. :func:`replan` then

1. feeds the observation back as a :class:`MemoryCorrection`: per device type, the ratio
   observed/predicted that the type's ranks share (the model error; the smallest ratio of the
   type, so that one rank's outlier is not blamed on the type), and per rank the bytes that
   ratio does not explain (another process, a leak, an injected ballast). A plan change is
   judged by the larger of the two readings, ``max(ratio * M + extra, M + observed - predicted)``,
   so it is conservative whether the error scales with the stage's memory or is a fixed amount;
2. takes the first fix that brings every stage under ``(1 - min_headroom)`` of its capacity:
   keep the plan (the corrected prediction still fits) -> more recompute on the stage under
   pressure (same layout) -> fewer layers on it (moved to the other stages) -> a new search
   with the safety-first weights on capacities reduced by the correction, bounded like memx
   plan's default (at most ``--max-slowdown``, 5%, slower than the fastest plan that fits).

Among the candidates of one rung it picks the one with the least predicted iteration time.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from memx_launch.planning import costmodel as cm
from memx_launch.errors import ConfigError, NoFeasiblePlanError
from memx_launch.planning.plan import Plan
from memx_launch.files import write_json_atomic
from memx_launch.planning.cost_table import CostTable
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.scoring import Evaluator
from memx_launch.planning.estimate import recompute_rows
from memx_launch.planning.layouts import make_layout
from memx_launch.planning.objective import DEFAULT_MAX_SLOWDOWN
from memx_launch.planning.search import SearchSpace, search
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.inputs import load_json
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

GIB = 2**30
REASONS = ("headroom", "oom", "above_prediction")
DEFAULT_MIN_HEADROOM = 0.10
# Bounds the layer-move candidates scored at once (compositions of the moved layers).
MAX_MOVE_CANDIDATES = 20_000


@dataclass
class ReplanEvent:
    """A re-plan decision every rank agrees on (monitor.py builds it from gathered samples)."""

    step: int
    """The training step after which the pressure was seen; training resumes at step + 1."""
    reason: str
    """One of REASONS."""
    rank: int
    stage: int
    device_type: str
    message: str
    observed_gib: list[float]
    """Peak memory per global rank (NaN where unknown, e.g. ranks stuck behind an OOM)."""
    capacity_gib: list[float]
    """Memory each rank may use (device total less other processes' memory)."""

    def to_dict(self) -> dict:
        return {k: [None if math.isnan(x) else x for x in v] if isinstance(v, list) else v
                for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "ReplanEvent":
        try:
            event = cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise ConfigError("replan event", f"malformed ({exc})", "delete the event file to start afresh") from None
        try:
            event.observed_gib = [math.nan if x is None else float(x) for x in event.observed_gib]
            event.capacity_gib = [math.nan if x is None else float(x) for x in event.capacity_gib]
        except (TypeError, ValueError):
            raise ConfigError("replan event", "memory readings are not numbers", "delete the event file to start afresh") from None
        if event.reason not in REASONS:
            raise ConfigError("replan event.reason", f"unknown reason {event.reason!r}", f"use one of {', '.join(REASONS)}")
        return event

    def save(self, path: str) -> None:
        write_json_atomic(path, self.to_dict(), overwrite=True)

    @classmethod
    def load(cls, path: str) -> "ReplanEvent":
        return cls.from_dict(load_json(path, "replan event", fix="delete the event file to start afresh"))


@dataclass
class MemoryCorrection:
    """What the observation says about the cost model's memory predictions."""

    ratio: dict[str, float]
    """Device type -> observed / predicted shared by its ranks."""
    extra_bytes: list[float]
    """Per rank: observed bytes the type's ratio does not explain."""
    delta_bytes: list[float]
    """Per rank: observed - predicted bytes."""

    def corrected(self, rank: int, device_type: str, predicted_bytes):
        """Memory a rank will really use when the model predicts ``predicted_bytes``."""
        r = self.ratio.get(device_type, 1.0)
        return np.maximum(r * np.asarray(predicted_bytes) + self.extra_bytes[rank],
                          np.asarray(predicted_bytes) + self.delta_bytes[rank])

    def budget(self, rank: int, device_type: str, usable_bytes: float) -> float:
        """Largest model-predicted memory whose corrected value stays within ``usable_bytes``."""
        r = self.ratio.get(device_type, 1.0)
        return min((usable_bytes - self.extra_bytes[rank]) / r, usable_bytes - self.delta_bytes[rank])

    def summary(self) -> str:
        ratios = ", ".join(f"{t} x{r:.2f}" for t, r in sorted(self.ratio.items()))
        extras = ", ".join(f"rank {i} +{e / GIB:.4f} GiB" for i, e in enumerate(self.extra_bytes) if e > 0)
        return f"observed/predicted per device type: {ratios}" + (f"; unexplained: {extras}" if extras else "")


@dataclass
class ReplanDecision:
    action: str
    """"keep", "recompute", "move_layers" or "search"."""
    plan: Plan
    """The plan to run; its stage predictions include the correction."""
    why: str
    correction: MemoryCorrection = field(repr=False)

    @property
    def needs_restart(self) -> bool:
        return self.action != "keep"


class _PlanScorer:
    """Scores variants (layers, recompute levels) of one plan's layout with the cost model."""

    def __init__(self, plan: Plan, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, cost_model):
        self.plan = plan
        self.cost_model = cost_model or cm.AnalyticalCostModel(model, cluster, training)
        names = tuple(self.cost_model.device_names)
        order = tuple(dict.fromkeys(s.device_type for s in plan.stages))
        self.layout = make_layout(cluster, names, plan.tp, plan.dp, order, [list(s.ranks) for s in plan.stages])
        table = CostTable(self.cost_model, len(names), [plan.tp], [plan.micro_batch_size], [plan.seq_len])
        self.evaluator = Evaluator(model, cluster, training, self.cost_model, table)
        self.v = plan.virtual_stages if plan.schedule == "interleaved" else 1

    def score(self, layers: np.ndarray, levels: np.ndarray, recompute: tuple[np.ndarray, np.ndarray]) -> GroupResult:
        """``recompute``: how many of each stage's first layers recompute at its level, and where
        positive, every how many layers they do instead (``full:everyN``)."""
        counts, every = (np.asarray(x, dtype=np.int64) for x in recompute)
        return self.evaluator.score(self.layout, self.plan.micro_batch_size, self.plan.seq_len, self.plan.schedule,
                                    self.v, np.asarray(levels, dtype=np.int64), np.asarray(layers, dtype=np.int64),
                                    counts, every)


def memory_correction(event: ReplanEvent, plan: Plan, predicted_stage_bytes: np.ndarray) -> MemoryCorrection:
    """Per device type ratio and per rank unexplained bytes, from what each rank observed."""
    world = plan.world_size
    if len(event.observed_gib) != world:
        raise ConfigError("replan event.observed_gib", f"{len(event.observed_gib)} ranks, the plan has {world}",
                          "re-plan with the plan the event was observed under")
    predicted = np.empty(world)
    types = [""] * world
    for s, stage in enumerate(plan.stages):
        for r in stage.ranks:
            predicted[r], types[r] = predicted_stage_bytes[s], stage.device_type
    observed = np.array([predicted[r] if math.isnan(x) else x * GIB for r, x in enumerate(event.observed_gib)])
    ratio = {t: float(min(observed[r] / predicted[r] for r in range(world) if types[r] == t))
             for t in dict.fromkeys(types)}
    extra = [max(0.0, float(observed[r] - ratio[types[r]] * predicted[r])) for r in range(world)]
    delta = [float(observed[r] - predicted[r]) for r in range(world)]
    return MemoryCorrection(ratio, extra, delta)


def replan(event: ReplanEvent, plan: Plan, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
           cost_model: cm.LayerCostModel | None = None, *, min_headroom: float = DEFAULT_MIN_HEADROOM,
           search_budget_s: float | None = None, restrictions: dict | None = None) -> ReplanDecision:
    """The cheapest change of ``plan`` that the corrected cost model says fits; see the module doc.
    ``restrictions``: SearchSpace fields the last-resort search keeps to (memx-run's --tp, ...)."""
    if not 0 <= min_headroom < 1:
        raise ConfigError("min_headroom", f"must be in [0, 1), got {min_headroom!r}", "e.g. 0.10 for 10% free")
    scorer = _PlanScorer(plan, model, cluster, training, cost_model)
    layers = np.array([[s.num_layers for s in plan.stages]])
    levels, counts, every = recompute_rows([s.recompute for s in plan.stages], layers, "plan.stages.recompute")
    current = scorer.score(layers, levels, (counts, every))
    correction = memory_correction(event, plan, current.memory[0])
    usable = [(1 - min_headroom) * (c * GIB if not math.isnan(c) else cluster.device_type(t).memory_bytes)
              for c, t in zip(event.capacity_gib, cluster.rank_device_types())]
    budgets = np.array([min(correction.budget(r, s.device_type, usable[r]) for r in s.ranks) for s in plan.stages])
    head = (f"step {event.step}: {event.reason} on rank {event.rank} (stage {event.stage}, {event.device_type}): "
            f"{event.message}. {correction.summary()}.")

    if (current.memory[0] <= budgets).all():
        return ReplanDecision("keep", _with_predictions(plan, current, 0, correction), head +
                              " The corrected prediction of the current plan still leaves "
                              f"{min_headroom:.0%} free: no change.", correction)
    s = event.stage
    # A stage recomputing K of its layers gets stronger by recomputing all of them; the stage
    # changed recomputes every layer at its new level, the others keep their counts.
    level_s = int(levels[0, s]) - int(counts[0, s] < layers[0, s])
    stronger = list(range(level_s + 1, len(cm.RECOMPUTE_LEVELS)))
    if stronger:
        rows = np.repeat(levels, len(stronger), axis=0)
        rows[:, s] = stronger
        result = scorer.score(np.repeat(layers, len(stronger), axis=0), rows, _whole(counts, every, s, len(stronger)))
        best = _best_fitting(result, budgets)
        if best is not None:
            return ReplanDecision("recompute", _with_predictions(plan, result, best, correction), head + (
                f" Fix: recompute {plan.stages[s].recompute} -> {result.stage_recompute(best, s)} on stage {s}"
                f"{_change_text(current, result, best, s, budgets)}."), correction)

    min_layers = scorer.v
    move_layers, move_levels = _layer_moves(layers[0], levels[0], s, min_layers)
    if len(move_layers):
        result = scorer.score(move_layers, move_levels, _whole(counts, every, s, len(move_layers)))
        best = _best_fitting(result, budgets)
        if best is not None:
            moved = int(layers[0, s] - move_layers[best, s])
            return ReplanDecision("move_layers", _with_predictions(plan, result, best, correction), head + (
                f" Fix: move {moved} layer(s) off stage {s} (layers {layers[0].tolist()} -> "
                f"{move_layers[best].tolist()}, recompute {result.stage_recompute(best, s)} on stage {s})"
                f"{_change_text(current, result, best, s, budgets)}."), correction)

    reduced = _reduced_cluster(cluster, plan, budgets)
    try:
        # memx-run's Schedule1F1B needs G >= P; the bound is memx-run's --max-slowdown, else the default.
        space = SearchSpace(fewer_microbatches_than_stages=False,
                            **{"max_slowdown": DEFAULT_MAX_SLOWDOWN, **(restrictions or {})})
        found = search(model, reduced, training, cost_model=scorer.cost_model, objective="safety",
                       time_budget_s=search_budget_s, top_k=1, space=space)
    except NoFeasiblePlanError as exc:
        raise NoFeasiblePlanError(f"{head} No plan fits the corrected memory ({exc}); free memory on the "
                                  f"device(s) of rank {event.rank} or add devices", exc.closest) from None
    new = found.best
    for stage in new.stages:
        stage.memory_capacity_gib = cluster.device_type(stage.device_type).memory_gib
        stage.predicted_peak_memory_gib = float(max(
            correction.corrected(r, stage.device_type, stage.predicted_peak_memory_gib * GIB) for r in stage.ranks)) / GIB
    _refresh_fraction(new)
    t_old = current.T[0]
    return ReplanDecision("search", new, head + (
        " Neither more recompute nor fewer layers on stage "
        f"{s} fits; new search with the safety-first weights on capacities reduced by the correction "
        f"(at most {found.max_slowdown:.0%} slower than its fastest plan): "
        f"pp={new.pp} dp={new.dp} tp={new.tp}, layers {[st.num_layers for st in new.stages]}, recompute "
        f"{[st.recompute for st in new.stages]}, predicted iteration time "
        f"{new.predicted_iteration_time_s / t_old - 1:+.0%}."), correction)


def _whole(counts: np.ndarray, every: np.ndarray, s: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` copies of the plan's recompute (counts, every) with stage ``s`` recomputing every layer."""
    counts, every = np.repeat(counts, rows, axis=0), np.repeat(every, rows, axis=0)
    counts[:, s], every[:, s] = np.iinfo(np.int64).max, 0
    return counts, every


def _best_fitting(result: GroupResult, budgets: np.ndarray) -> int | None:
    fits = (result.memory <= budgets).all(axis=1) & (result.layers >= 1).all(axis=1)
    if not fits.any():
        return None
    return int(np.flatnonzero(fits)[np.argmin(result.T[fits])])


def _layer_moves(layers: np.ndarray, levels: np.ndarray, s: int, min_layers: int):
    """Rows that take k >= 1 layers off stage s (giving them to the others in every way) at every
    recompute level of stage s from its current one up; k grows until the row cap is reached."""
    others = [i for i in range(len(layers)) if i != s]
    out_layers, out_levels = [], []
    for k in range(1, int(layers[s]) - min_layers + 1):
        splits = list(_compositions(k, len(others)))
        n_levels = len(cm.RECOMPUTE_LEVELS) - int(levels[s])
        if len(out_layers) + len(splits) * n_levels > MAX_MOVE_CANDIDATES:
            break
        for split in splits:
            row = layers.copy()
            row[s] -= k
            row[others] += split
            for level in range(int(levels[s]), len(cm.RECOMPUTE_LEVELS)):
                lv = levels.copy()
                lv[s] = level
                out_layers.append(row)
                out_levels.append(lv)
    return np.array(out_layers, dtype=np.int64), np.array(out_levels, dtype=np.int64)


def _compositions(total: int, parts: int):
    """All ways to write ``total`` as an ordered sum of ``parts`` non-negative integers."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        bounds = (-1,) + cuts + (total + parts - 1,)
        yield np.array([bounds[i + 1] - bounds[i] - 1 for i in range(parts)])


def _with_predictions(plan: Plan, result: GroupResult, row: int, correction: MemoryCorrection) -> Plan:
    new = copy.deepcopy(plan)
    for i, stage in enumerate(new.stages):
        stage.num_layers = int(result.layers[row, i])
        stage.recompute = result.stage_recompute(row, i)
        stage.predicted_peak_memory_gib = float(max(
            correction.corrected(r, stage.device_type, result.memory[row, i]) for r in stage.ranks)) / GIB
        stage.predicted_stage_time_s = float(result.stage_time[row, i])
    new.predicted_iteration_time_s = float(result.T[row])
    _refresh_fraction(new)
    new.validate("replanned plan")
    return new


def _change_text(current: GroupResult, result: GroupResult, row: int, s: int, budgets: np.ndarray) -> str:
    return (f": model memory of stage {s} {current.memory[0, s] / GIB:.4f} -> {result.memory[row, s] / GIB:.4f} GiB "
            f"(budget {budgets[s] / GIB:.4f} GiB after the correction), predicted iteration time "
            f"{result.T[row] / current.T[0] - 1:+.0%}")


def _reduced_cluster(cluster: ClusterSpec, plan: Plan, budgets: np.ndarray) -> ClusterSpec:
    """The cluster with each device type's memory cut to the smallest budget among its stages,
    so that any stage the search puts on that type fits whatever rank it lands on."""
    by_type: dict[str, float] = {}
    for stage, budget in zip(plan.stages, budgets):
        by_type[stage.device_type] = min(by_type.get(stage.device_type, math.inf), budget)
    types = []
    for d in cluster.device_types:
        memory = by_type.get(d.name, d.memory_bytes)
        if memory <= 0:
            raise NoFeasiblePlanError(f"device type {d.name}: the observed memory leaves nothing for the model; "
                                      "free memory on those devices or add devices")
        types.append(DeviceType(**{**asdict(d), "memory_gib": memory / GIB}))
    return replace(cluster, device_types=tuple(types))


def _refresh_fraction(plan: Plan) -> None:
    fractions = [s.predicted_peak_memory_gib / s.memory_capacity_gib for s in plan.stages if s.memory_capacity_gib > 0]
    if fractions:
        plan.predicted_peak_memory_fraction = max(fractions)
