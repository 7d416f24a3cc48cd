"""Memory-aware search over parallel layouts (paper section 3.1).

The space: TP x PP x CP x DP = world size (CP 1 unless asked, :mod:`context_parallel`) with
TP, CP and DP groups inside one stage and one device type, the order of device types along
the pipeline, micro-batch size, sequence length,
schedule (1F1B, interleaved with v virtual stages) and a recompute level per device type.
Each candidate gets an uneven layer split that balances predicted stage time under every
stage's memory, then a per-stage hard rule (the lowest recompute level that fits the layers
it got), then the score Phi (:mod:`scoring`, :mod:`objective`).

Per-layer costs come from one :class:`~memx_launch.planning.costmodel.LayerCostModel` call over
every distinct (device type, TP, micro-batch, seq len, recompute) signature of the space; every
later lookup is a cache hit. No torch import.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from memx_launch.planning import context_parallel, costmodel as cm, experts, hybrid_sharding, mamba
from memx_launch.errors import ConfigError, NoFeasiblePlanError
from memx_launch.planning.plan import Objective, Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.planning.layouts import Layout, enumerate_layouts, tp_text
from memx_launch.planning.layout_training import cost_model_of_training, layout_sharded_stages, tied_ends_sharded_alike
from memx_launch.planning.mixed_sharding import MixedShardingEvaluator
from memx_launch.planning.objective import WEIGHT_PROFILES, choose_profile, phi
from memx_launch.planning.search_space import SearchSpace
from memx_launch.planning.scored_plan import to_plan
from memx_launch.planning.cost_table import CostTable
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.scoring import Evaluator


INTERLEAVE_MAX_HETEROGENEITY = 0.25  # strong heterogeneity enforces 1F1B


SELECTIVE_MIN_SAVING = 0.10   # selective must save this share of what full saves, else binary


@dataclass
class SearchStats:
    enumerated: int = 0
    evaluated: int = 0
    feasible: int = 0
    pruned_memory: int = 0
    pruned_time: int = 0
    pruned_schedule: int = 0
    pruned_batch: int = 0
    pruned_too_few_microbatches: int = 0
    """Of ``pruned_batch``: candidates with fewer micro-batches than stages, where the space
    refuses them (``fewer_microbatches_than_stages=False``, memx-run's searches)."""
    cache_hits: int = 0
    cache_misses: int = 0
    seconds: float = 0.0
    budget_exhausted: bool = False
    binary_recompute_types: list[str] = field(default_factory=list)
    interleaving_allowed: bool = True

    @property
    def configs_per_second(self) -> float:
        return self.enumerated / self.seconds if self.seconds else float("inf")

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["configs_per_second"] = self.configs_per_second
        return out


@dataclass
class SearchResult:
    plans: list[Plan]
    """Ranked by Phi among the candidates within ``max_slowdown`` of the fastest."""
    pareto: list[Plan]
    stats: SearchStats
    profile: str
    weights: tuple[float, float, float]
    reason: str
    fastest: Plan
    """The feasible plan of least predicted time (per token): what the winner's trade is against."""
    unbounded: Plan
    """Phi's pick over every feasible candidate: the winner when no bound applies."""
    max_slowdown: float | None = None

    @property
    def best(self) -> Plan:
        return self.plans[0]


def search(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
           cost_model: cm.LayerCostModel | None = None, space: SearchSpace | None = None,
           objective: str | None = None, weights: tuple[float, float, float] | None = None,
           time_budget_s: float | None = None, top_k: int = 10,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Rank every candidate of the space by Phi; raise NoFeasiblePlanError when none fits."""
    start = time.perf_counter()
    space = (space or SearchSpace()).searched_for(training)
    space.check(model)
    seqs = tuple(space.seq_lens or (training.seq_len,))
    # A mixture of experts is searched at each expert-parallel and expert-tensor-parallel degree of
    # the space, each pair with its own analytical cost model (a given cost model keeps the training's).
    searched = (space.expert_degrees or space.expert_tensor_degrees) and cost_model is None
    trainings = [dataclasses.replace(training, expert_parallel=ep, expert_tensor_parallel=etp)
                 for ep in space.expert_degrees or (training.expert_parallel,)
                 for etp in space.expert_tensor_degrees or (training.expert_tensor_parallel,)] \
        if searched else [training]
    # Hybrid sharding's degrees (memx plan --shard-degrees) besides the training's own.
    trainings = [dataclasses.replace(tr, shard_degree=s) for tr in trainings
                 for s in dict.fromkeys((tr.shard_degree, *(space.shard_degrees or ())))]
    # A layer's costs depend on the expert degrees, not on the shard degree: one cost model (and table) per pair.
    models_of: dict = {}
    for tr in trainings:
        if (tr.expert_parallel, tr.expert_tensor_parallel) not in models_of:
            models_of[tr.expert_parallel, tr.expert_tensor_parallel] = cost_model or cm.AnalyticalCostModel(model,
                                                                                                        cluster, tr)
    cost_models = [models_of[tr.expert_parallel, tr.expert_tensor_parallel] for tr in trainings]
    names = tuple(cost_models[0].device_names)
    cps = _cp_degrees(model, training, space, seqs)
    layouts_of = _expert_layouts(_layouts(model, cluster, names, space, cps), model, trainings, cluster)
    layouts_of = _tied_ends_alike(layouts_of, model, trainings, space)
    layouts = [lay for lays in layouts_of for lay in lays]
    check_batch(layouts, space, training)
    tps = sorted({int(t) for lay in layouts for t in set(lay.stage_tp.tolist())})
    rank_seqs = sorted({s // cp for s in seqs for cp in cps[s]})
    # Stages of fewer replicas than the layout's largest DP degree run larger local micro-batches.
    local_mbss = sorted({int(local) for lay in layouts for m in space.micro_batch_sizes
                         for local in np.atleast_1d(lay.local_micro_batch(m))})
    tables_of = {id(cmod): CostTable(cmod, len(names), tps, local_mbss, rank_seqs) for cmod in cost_models}
    tables = [tables_of[id(cmod)] for cmod in cost_models]
    evaluators = [Evaluator(model, cluster, tr, cmod, table, space.memory_headroom, space.recompute_levels,
                            space.recompute_some_layers) for tr, cmod, table in zip(trainings, cost_models, tables)]
    fully_sharded: dict[int, Evaluator] = {}  # by training: where layout_training shards stages of a layout
    mixed: dict[int, MixedShardingEvaluator] = {}  # by training: where it shards some stages only

    def evaluator_for(k: int, layout: Layout) -> Evaluator:
        stages = layout_sharded_stages(trainings[k], layout)
        if not stages.any():
            return evaluators[k]
        if k not in fully_sharded:
            runs = dataclasses.replace(trainings[k], fully_sharded=True)
            cmod = cost_model_of_training(cost_models[k], model, cluster, runs)
            table = CostTable(cmod, len(names), tps, local_mbss, rank_seqs)
            fully_sharded[k] = Evaluator(model, cluster, runs, cmod, table, space.memory_headroom,
                                         space.recompute_levels, space.recompute_some_layers)
        if stages.all():
            return fully_sharded[k]
        if k not in mixed:
            mixed[k] = MixedShardingEvaluator(evaluators[k], fully_sharded[k])
        return mixed[k]
    stats = SearchStats()
    level_options, stats.binary_recompute_types = recompute_options(tables[0], names, space)
    stats.interleaving_allowed = cluster.heterogeneity_index() <= INTERLEAVE_MAX_HETEROGENEITY
    schedules = [("1f1b", 1)] + [("interleaved", v) for v in space.virtual_stages if "interleaved" in space.schedules]
    if "1f1b" not in space.schedules:
        schedules = schedules[1:]

    groups = []
    for k, layout in ((k, layout) for k, lays in enumerate(layouts_of) for layout in lays):
        policies = _policy_rows(layout, level_options)
        evaluator = evaluator_for(k, layout)
        for mbs, seq in itertools.product(space.micro_batch_sizes, seqs):
            if layout.cp not in cps[seq]:
                continue
            for schedule, v in schedules:
                stats.enumerated += len(policies)
                if training.global_batch_size % (layout.dp * mbs):
                    stats.pruned_batch += len(policies)
                    continue
                g = training.global_batch_size // (layout.dp * mbs)
                if g < layout.pp and not space.fewer_microbatches_than_stages:
                    stats.pruned_batch += len(policies)
                    stats.pruned_too_few_microbatches += len(policies)
                    continue
                if schedule == "interleaved" and (not stats.interleaving_allowed or g % layout.pp
                                                  or layout.pp * v > model.num_layers or layout.pp < 2):
                    stats.pruned_schedule += len(policies)
                    continue
                groups.append((min(_time_lower_bound(table, layout, mbs, seq, g, model.num_layers)
                                   for table in evaluator.tables),
                               layout, mbs, seq, schedule, v, policies, evaluator))
    groups.sort(key=lambda item: item[0])

    results: list[GroupResult] = []
    closest: list[tuple[float, str]] = []
    best_time = math.inf
    report_every = max(1, len(groups) // 10)
    for i, (lower_bound, layout, mbs, seq, schedule, v, policies, evaluator) in enumerate(groups):
        # The budget counts from the start (layouts, the cost table); one group is always scored.
        if time_budget_s is not None and i and time.perf_counter() - start > time_budget_s:
            stats.budget_exhausted = True
            stats.pruned_time += sum(len(item[-2]) for item in groups[i:])
            break
        if lower_bound > space.time_prune_factor * best_time:
            stats.pruned_time += len(policies)
            continue
        # Memory lower bound: the strongest allowed recompute everywhere is the least memory a group can use.
        if not evaluator.fits_with_full_recompute(layout, mbs, seq, schedule, v):
            stats.pruned_memory += len(policies)
            full = np.full((1, layout.pp), evaluator.allowed_levels[-1])
            closest.append(_shortfall(evaluator.score(layout, mbs, seq, schedule, v, full), names))
            continue
        result = evaluator.score(layout, mbs, seq, schedule, v, policies)
        stats.evaluated += len(policies)
        stats.feasible += int(result.feasible.sum())
        if result.feasible.any():
            best_time = min(best_time, result.T[result.feasible].min())
            results.append(result)
        if progress and (i + 1) % report_every == 0:
            progress(f"search: {i + 1}/{len(groups)} groups, {stats.feasible} feasible, "
                     f"{time.perf_counter() - start:.1f}s")
    tables = [*tables_of.values(), *(e.table for e in fully_sharded.values())]
    stats.cache_hits, stats.cache_misses = sum(t.hits for t in tables), sum(t.misses for t in tables)

    if not results:
        closest.sort()
        stats.seconds = time.perf_counter() - start
        if stats.budget_exhausted:
            raise NoFeasiblePlanError(
                f"the search budget of {time_budget_s:g}s ran out before any feasible plan was found "
                f"({stats.evaluated} of {stats.enumerated} evaluated); raise --search-budget-s", [])
        raise NoFeasiblePlanError(
            f"no candidate fits in memory ({stats.enumerated} enumerated, {stats.pruned_memory} over capacity"
            + (f" less the {space.memory_headroom:.0%} asked to stay free" if space.memory_headroom else "") +
            f" even with {cm.RECOMPUTE_LEVELS[evaluator.allowed_levels[-1]]} recompute); use more devices, a shorter --seq-len or a smaller model",
            [text for _, text in closest[:5]])

    bound = space.bound(objective, weights)
    plans, pareto, profile, chosen, reason, fastest, unbounded = _rank(
        results, cluster, model, training, objective, weights, bound, top_k)
    stats.seconds = time.perf_counter() - start
    return SearchResult(plans, pareto, stats, profile, chosen, reason, fastest, unbounded, bound)


def _layouts(model, cluster, device_names, space: SearchSpace, cps: dict) -> list[Layout]:
    """The space's layouts at the CP degrees ``cps`` gives per sequence length."""
    degrees = tuple(sorted({cp for options in cps.values() for cp in options}))
    layouts = enumerate_layouts(model, cluster, device_names, list(space.tp_degrees or []) or None,
                                per_type_tp=space.per_type_tp, mixed_stages=space.mixed_stages, cps=degrees,
                                per_type_dp=space.per_type_dp)
    if space.pipeline_degrees:
        layouts = [lay for lay in layouts if lay.pp in space.pipeline_degrees]
        if not layouts:
            raise ConfigError("--pp", f"no layout of {cluster.world_size} devices has pp in "
                              f"{list(space.pipeline_degrees)} (with the TP degrees allowed)",
                              "pp must divide the device count of every type; drop --pp to see all")
    if not layouts:
        raise ConfigError("cluster", f"no TP x PP x DP layout fits {cluster.world_size} devices of counts "
                          f"{cluster.type_counts()} with at most {model.num_layers} stages",
                          "give each device type a count that shares a common divisor with the others")
    return layouts


def _expert_layouts(layouts: list[Layout], model: ModelSpec, trainings: list[TrainingSpec],
                    cluster: ClusterSpec) -> list[list[Layout]]:
    """For each training (expert-parallel and expert-tensor-parallel degrees), the layouts whose
    stages split into whole EP x ETP groups (all of a dense model's) and hybrid sharding's shard groups."""
    for training in trainings:
        experts.check(model, training)
    kept = [[lay for lay in layouts if experts.divides(lay, training)] for training in trainings]
    if not any(kept):
        degrees = ",".join(str(t.expert_parallel) + f" x ETP {t.expert_tensor_parallel}" * (t.expert_tensor_parallel > 1)
                           for t in trainings)
        raise ConfigError("--expert-parallel", f"{degrees} divides no layout's TP x CP x DP ranks per stage",
                          "use smaller expert-parallel (x expert-tensor-parallel) degrees")
    return hybrid_sharding.sharded_layouts(cluster, kept, trainings)


def _tied_ends_alike(layouts_of: list[list[Layout]], model: ModelSpec, trainings: list[TrainingSpec],
                     space: SearchSpace) -> list[list[Layout]]:
    """The layouts whose first and last stage memx-run would shard alike (or that tie nothing):
    the others' tied gradients cannot be summed. Only stages of several TP degrees or DP groups
    both within and across domains shard differently."""
    kept = [[lay for lay in lays if tied_ends_sharded_alike(model, tr, lay)] for tr, lays in zip(trainings, layouts_of)]
    if any(layouts_of) and not any(kept):
        raise ConfigError("--mixed-stages" if space.mixed_stages else "--per-type-tp",
                          "every layout has one end of the tied embeddings fully sharded and the other whole "
                          "under memx-run, which cannot sum a shard with a whole gradient",
                          "allow TP 1 or other pipeline degrees, or drop the flag")
    return kept


def check_batch(layouts: list[Layout], space: SearchSpace, training: TrainingSpec) -> None:
    """Some layout and micro-batch size must split the global batch (into at least one micro-batch
    per stage where the space asks for it), or no candidate can ever be scored."""
    gbs = training.global_batch_size
    divides = [(lay, m) for lay in layouts for m in space.micro_batch_sizes if gbs % (lay.dp * m) == 0]
    if any(space.fewer_microbatches_than_stages or gbs // (lay.dp * m) >= lay.pp for lay, m in divides):
        return
    if divides:
        raise ConfigError("--global-batch-size", f"{gbs} gives fewer micro-batches than pipeline stages to every "
                          "candidate; memx-run's pipeline schedule (torch's Schedule1F1B) needs one per stage",
                          "raise the global batch size")
    raise ConfigError("--global-batch-size", f"{gbs} is not divisible by DP x micro-batch for any candidate "
                      f"(micro-batches {list(space.micro_batch_sizes)})",
                      "use a multiple of the data-parallel degree, e.g. a power of two")


def check_space(model: ModelSpec, cluster: ClusterSpec | None, training: TrainingSpec, space: SearchSpace) -> None:
    """What search() refuses before scoring anything, without a cost model: the restrictions, and
    on ``cluster`` (None: not known yet) its layouts and the batch. memx-run asks before any
    worker calibrates."""
    space.check(model)
    if cluster is not None:
        cps = _cp_degrees(model, training, space, tuple(space.seq_lens or (training.seq_len,)))
        layouts = _layouts(model, cluster, tuple(d.name for d in cluster.device_types), space, cps)
        check_batch([lay for lays in _expert_layouts(layouts, model, [training], cluster) for lay in lays], space,
                    training)


def _cp_degrees(model: ModelSpec, training: TrainingSpec, space: SearchSpace, seqs) -> dict[int, tuple[int, ...]]:
    """Per sequence length, the CP degrees the search tries (a hybrid model's: CP 1), checked."""
    cps = context_parallel.degrees_to_try(mamba.cp_degrees(model, space.cp_degrees), seqs, training)
    mamba.check(model, training, [cp for degrees in cps.values() for cp in degrees])
    return cps


def recompute_options(table: CostTable, device_names, space: SearchSpace) -> tuple[list[list[int]], list[str]]:
    """Levels each device type may use. Selective is dropped where it saves under 10% of what
    full recompute saves (its exchange rate rho = dT/dM is then no better than going binary)."""
    allowed = [cm.RECOMPUTE_LEVELS.index(name) for name in space.recompute_levels]
    options, binary = [], []
    for d, name in enumerate(device_names):
        act = table.act[d]
        saving_sel = act[..., cm.NONE] - act[..., cm.SELECTIVE]
        saving_full = act[..., cm.NONE] - act[..., cm.FULL]
        levels = list(allowed)
        if cm.SELECTIVE in levels and (saving_sel < SELECTIVE_MIN_SAVING * saving_full).all():
            levels.remove(cm.SELECTIVE)
            binary.append(name)
        options.append(levels)
    return options, binary


def _policy_rows(layout: Layout, level_options) -> np.ndarray:
    """One row per combination of levels for the device types in this layout."""
    types = sorted(set(layout.stage_device.tolist()))
    combos = list(itertools.product(*(level_options[t] for t in types)))
    rows = np.empty((len(combos), layout.pp), dtype=np.int64)
    for c, combo in enumerate(combos):
        mapping = dict(zip(types, combo))
        rows[c] = [mapping[d] for d in layout.stage_device]
    return rows


def _time_lower_bound(table: CostTable, layout: Layout, mbs, seq, g, num_layers) -> float:
    """All layers of every micro-batch on perfectly balanced stages of the fastest device, each
    layer at the fastest of its kinds (a mixture's expert or dense block, a hybrid model's kinds)."""
    tp_index = [table.tps.index(t) for t in layout.stage_tp.tolist()]
    seq_index = table.seqs.index(seq // layout.cp)
    mbs_index = [table.mbss.index(int(m)) for m in np.broadcast_to(layout.local_micro_batch(mbs), (layout.pp,))]
    t_min = min(t.time[layout.stage_device, tp_index, mbs_index, seq_index, cm.NONE].min()
                for t in (table, *table.kinds))
    return g * num_layers * t_min / layout.pp


def _shortfall(result: GroupResult, device_names) -> tuple[float, str]:
    over = (result.memory[0] - result.capacity[0]) / cm.GIB
    lay = result.layout
    parts = [f"{device_names[d]} short {o:.1f} GiB" for d, o in zip(lay.stage_device, over) if o > 0]
    cp = f" cp={lay.cp}" if lay.cp > 1 else ""
    ep, etp = result.experts
    cp += (f" ep={ep}" if ep > 1 else "") + (f" etp={etp}" if etp > 1 else "")
    cp += f" shard={result.shard_degree}" if result.shard_degree else ""
    text = (f"tp={tp_text(lay.stage_tp)} pp={lay.pp}{cp} dp={lay.dp} mbs={result.mbs} seq={result.seq} "
            f"{cm.RECOMPUTE_LEVELS[int(result.levels[0].max())]} recompute: "
            + ", ".join(dict.fromkeys(parts)))
    return float(over.max()), text


def _rank(results, cluster, model, training, objective, weights, bound, top_k):
    # Candidates with another sequence length are compared at equal tokens per iteration.
    T = np.concatenate([r.T[r.feasible] * training.seq_len / r.seq for r in results])
    M = np.concatenate([r.M[r.feasible] for r in results])
    V = np.concatenate([r.V[r.feasible] for r in results])
    index = [(gi, row) for gi, r in enumerate(results) for row in np.flatnonzero(r.feasible)]
    auto_profile, why = choose_profile(cluster, T, M)
    if weights is not None:
        profile, chosen = "custom", tuple(weights)
        why = "weights given with --weights"
    else:
        profile = objective or auto_profile
        if profile not in WEIGHT_PROFILES:
            raise ConfigError("--objective", f"unknown profile {profile!r}",
                              f"use one of {', '.join(WEIGHT_PROFILES)}")
        chosen = WEIGHT_PROFILES[profile]
        if objective:
            why = "profile given with --objective"
    score, (t_n, m_n, v_n) = phi(T, M, V, chosen)
    refs = {"T_ref": float(np.median(T)), "M_ref": float(np.median(M)), "V_ref": float(np.median(V))}

    def plan_of(k):
        gi, row = index[k]
        terms = {"T": float(t_n[k]), "M": float(m_n[k]), "V": float(v_n[k]), **refs}
        return to_plan(results[gi], row, model, cluster, training, Objective(float(score[k]), profile, chosen, terms))

    fastest = int(np.lexsort((score, T))[0])
    # Only candidates this close to the fastest may win; the relative slack absorbs rounding.
    allowed = np.ones(len(T), bool) if bound is None else T <= T[fastest] * (1 + bound) * (1 + 1e-12)
    if bound is not None:
        why += f"; at most {bound:.0%} slower than the fastest feasible plan (--max-slowdown)"
    order = np.argsort(np.where(allowed, score, np.inf), kind="stable")[:int(allowed.sum())]
    plans, seen = [], set()
    for k in order:
        gi, row = index[k]
        key = _plan_key(results[gi], row)
        if key in seen:
            continue
        seen.add(key)
        plans.append(plan_of(k))
        if len(plans) >= top_k:
            break
    pareto, best_v = [], math.inf
    for k in np.lexsort((V, T)):
        if V[k] < best_v:
            best_v = V[k]
            pareto.append(plan_of(k))
    unbounded = int(np.argmin(score))
    # The winner's own object where it is also the fastest or the unbounded pick (the report asks "is").
    return (plans, pareto, profile, chosen, why, plans[0] if fastest == order[0] else plan_of(fastest),
            plans[0] if unbounded == order[0] else plan_of(unbounded))


def _plan_key(result: GroupResult, row: int):
    lay = result.layout
    return (tuple(lay.stage_tp), lay.cp, tuple(lay.stage_dps), lay.order, result.mbs, result.seq, result.schedule, result.v,
            tuple(result.levels[row]), tuple(result.layers[row]), result.experts, result.shard_degree)


def progress_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_references(model, cluster, training, cost_model=None) -> tuple[float, float, float]:
    """T, M and V medians over the feasible candidates of the default space."""
    try:
        result = search(model, cluster, training, cost_model=cost_model, top_k=1)
    except (NoFeasiblePlanError, ConfigError):
        return (math.nan, math.nan, math.nan)
    refs = result.best.objective.terms
    return refs["T_ref"], refs["M_ref"], refs["V_ref"]
