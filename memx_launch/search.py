"""Memory-aware search over parallel layouts (paper section 3.1).

The space: TP x PP x DP = world size with TP and DP groups inside one stage and one device
type, the order of device types along the pipeline, micro-batch size, sequence length,
schedule (1F1B, interleaved with v virtual stages) and a recompute level per device type.
Each candidate gets an uneven layer split that balances predicted stage time under every
stage's memory, then a per-stage hard rule (the lowest recompute level that fits the layers
it got), then the score Phi. Candidates are scored a group at a time: one group shares a
layout and hyper-parameters and holds every recompute policy as rows of numpy arrays.

Per-layer costs come from one :class:`~memx_launch.costmodel.LayerCostModel` call over every
distinct (device type, TP, micro-batch, seq len, recompute) signature of the space; every
later lookup is a cache hit. No torch import.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from memx_launch import costmodel as cm
from memx_launch.errors import ConfigError, NoFeasiblePlanError
from memx_launch.plan import Objective, Plan, StagePlan
from memx_launch.specs import ClusterSpec, ModelSpec, TrainingSpec

WEIGHT_PROFILES = {
    "default": (0.4, 0.2, 0.4),
    "safety": (0.3, 0.5, 0.2),
    "throughput": (0.7, 0.2, 0.1),
}
SAFETY_MARGIN = 0.10          # if no candidate leaves this much memory free: safety profile
WEAK_HETEROGENEITY = 0.10     # compute CV below this counts as (nearly) homogeneous
INTERLEAVE_MAX_HETEROGENEITY = 0.25  # strong heterogeneity enforces 1F1B
SELECTIVE_MIN_SAVING = 0.10   # selective must save this share of what full saves, else binary
EPS_V_FRACTION = 0.05         # eps_V as a fraction of V_ref
_BISECTION_STEPS = 30


@dataclass
class SearchSpace:
    """What may vary. ``None`` means derived from the model, cluster and training spec."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    seq_lens: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    virtual_stages: tuple[int, ...] = (2, 4)
    recompute_levels: tuple[str, ...] = cm.RECOMPUTE_LEVELS
    time_prune_factor: float = 2.0
    """Skip a group whose iteration-time lower bound exceeds this multiple of the best time."""
    memory_headroom: float = 0.0
    """Share of every device's memory a plan must leave free (memx-run: the monitor's threshold)."""


@dataclass
class SearchStats:
    enumerated: int = 0
    evaluated: int = 0
    feasible: int = 0
    pruned_memory: int = 0
    pruned_time: int = 0
    pruned_schedule: int = 0
    pruned_batch: int = 0
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
    pareto: list[Plan]
    stats: SearchStats
    profile: str
    weights: tuple[float, float, float]
    reason: str

    @property
    def best(self) -> Plan:
        return self.plans[0]


# --------------------------------------------------------------------------- layouts


@dataclass
class Layout:
    """One (TP, DP, device-type order): which ranks form each pipeline stage."""

    tp: int
    dp: int
    order: tuple[str, ...]
    stage_device: np.ndarray          # (P,) index into the cost model's device names
    stage_ranks: list[list[int]]
    capacity: np.ndarray              # (P,) bytes
    next_stage_gbps: np.ndarray       # (P,) link to the next stage, inf for the last
    dp_gbps: np.ndarray               # (P,) slowest link of the stage's DP groups

    @property
    def pp(self) -> int:
        return len(self.stage_ranks)


def tp_degrees(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Powers of two that divide the heads and fit inside one node for every device type."""
    per_node = min(n for node in cluster.nodes for _, n in node.devices)
    out, tp = [], 1
    while tp <= min(8, per_node):
        if model.num_heads % tp == 0 and model.num_kv_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, device_names: tuple[str, ...],
                      tps: list[int] | None = None, max_orders: int = 24) -> list[Layout]:
    rank_types = cluster.rank_device_types()
    counts = cluster.type_counts()
    ranks_of = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in counts}
    gcd = math.gcd(*counts.values())
    layouts = []
    for tp in tps or tp_degrees(model, cluster):
        for group in (g for g in range(tp, gcd + 1, tp) if gcd % g == 0):
            dp = group // tp
            pp = cluster.world_size // group
            if pp > model.num_layers:
                continue
            for order in itertools.islice(itertools.permutations(counts), max_orders):
                stage_ranks = [ranks_of[t][i:i + group] for t in order
                               for i in range(0, counts[t], group)]
                layouts.append(_make_layout(cluster, device_names, tp, dp, order, stage_ranks))
    return layouts


def _make_layout(cluster, device_names, tp, dp, order, stage_ranks) -> Layout:
    rank_types = cluster.rank_device_types()
    types = [rank_types[ranks[0]] for ranks in stage_ranks]
    next_gbps = [min(cluster.link_gbps(a, b) for a, b in zip(cur, nxt))
                 for cur, nxt in zip(stage_ranks, stage_ranks[1:])] + [math.inf]
    # A DP group is every tp-th rank of the stage; its ring's slowest hop decides.
    dp_gbps = [min([cluster.group_gbps(ranks[j::tp]) for j in range(tp)]) for ranks in stage_ranks]
    return Layout(tp, dp, tuple(order), np.array([device_names.index(t) for t in types]),
                  [list(r) for r in stage_ranks],
                  np.array([cluster.device_type(t).memory_bytes for t in types]),
                  np.array(next_gbps, dtype=float), np.array(dp_gbps, dtype=float))


def layout_from_stage_devices(model, cluster, device_names, tp, pp, dp, stage_devices) -> Layout:
    """A user-given layout: stage i on the next free ranks of ``stage_devices[i]``."""
    if tp * pp * dp != cluster.world_size:
        raise ConfigError("--tp/--pp/--dp", f"tp*pp*dp = {tp * pp * dp} but the cluster has "
                          f"{cluster.world_size} devices", "choose degrees whose product is the world size")
    rank_types = cluster.rank_device_types()
    free = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in cluster.type_counts()}
    if stage_devices is None:
        stage_devices = [rank_types[i * tp * dp] for i in range(pp)]
    if len(stage_devices) != pp:
        raise ConfigError("--stage-devices", f"{len(stage_devices)} entries for pp={pp}", "give one device type per stage")
    stage_ranks = []
    for i, t in enumerate(stage_devices):
        if t not in free:
            raise ConfigError(f"--stage-devices[{i}]", f"unknown device type {t!r}",
                              f"use one of {', '.join(free)}")
        if len(free[t]) < tp * dp:
            raise ConfigError(f"--stage-devices[{i}]", f"not enough {t} devices left for a stage of "
                              f"tp*dp={tp * dp}", "assign stages to device types by their counts")
        stage_ranks.append(free[t][:tp * dp])
        free[t] = free[t][tp * dp:]
    return _make_layout(cluster, device_names, tp, dp, tuple(dict.fromkeys(stage_devices)), stage_ranks)


# --------------------------------------------------------------------------- the cost table


class CostTable:
    """Per-layer costs of every signature in the space, from one cost-model call."""

    def __init__(self, cost_model: cm.LayerCostModel, n_devices: int, tps, mbss, seqs):
        self.tps, self.mbss, self.seqs = list(tps), list(mbss), list(seqs)
        grid = np.meshgrid(np.arange(n_devices), self.tps, self.mbss, self.seqs, [0, 1, 2], indexing="ij")
        shape = grid[0].shape
        cost = cost_model.layer_costs(*(g.ravel() for g in grid))
        self.time = np.asarray(cost.time_s, dtype=float).reshape(shape)
        self.act = np.asarray(cost.activation_bytes, dtype=float).reshape(shape)
        self.work = np.asarray(cost.working_bytes, dtype=float).reshape(shape)
        self.misses = self.time.size
        self.hits = 0

    def lookup(self, device, tp, mbs, seq, level):
        """Index arrays broadcast together; counts every element served as a hit."""
        key = (device, self.tps.index(tp), self.mbss.index(mbs), self.seqs.index(seq), level)
        t, a, w = self.time[key], self.act[key], self.work[key]
        self.hits += np.size(t)
        return t, a, w


# --------------------------------------------------------------------------- scoring one group


@dataclass
class GroupResult:
    """All recompute policies of one (layout, micro-batch, seq, schedule, v): rows are policies."""

    layout: Layout
    mbs: int
    seq: int
    schedule: str
    v: int
    levels: np.ndarray      # (C, P) recompute level per stage
    layers: np.ndarray      # (C, P)
    memory: np.ndarray      # (C, P) bytes
    stage_time: np.ndarray  # (C, P) seconds per micro-batch
    T: np.ndarray           # (C,)
    M: np.ndarray           # (C,) max memory fraction
    V: np.ndarray           # (C,) variance of per-device memory, GiB^2
    feasible: np.ndarray    # (C,)


class Evaluator:
    """Scores groups of candidates for one model, cluster and training spec."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 cost_model: cm.LayerCostModel, analytical: cm.AnalyticalCostModel, table: CostTable,
                 memory_headroom: float = 0.0):
        self.model, self.cluster, self.training = model, cluster, training
        self.memory_headroom = memory_headroom
        self.cost_model, self.analytical, self.table = cost_model, analytical, table
        self.device_types = [cluster.device_type(n) for n in cost_model.device_names]

    def usable(self, layout: Layout) -> np.ndarray:
        """Bytes a stage may plan for: its capacity less the headroom kept free."""
        return layout.capacity * (1.0 - self.memory_headroom)

    def split_inputs(self, layout: Layout, mbs: int, seq: int, v: int, levels: np.ndarray):
        """Per-stage per-layer bytes, fixed bytes, layer time and fixed time for each row."""
        m, tr = self.model, self.training
        pp, tp, dp = layout.pp, layout.tp, layout.dp
        g = tr.global_batch_size // (dp * mbs)
        dev = np.broadcast_to(layout.stage_device, levels.shape)
        t_layer, act, work = self.table.lookup(dev, tp, mbs, seq, levels)
        bpp = cm.model_state_bytes_per_param(tr, dp)
        inflight = cm.inflight_microbatches(np.arange(pp), pp, g, v)
        per_layer = m.layer_params / tp * bpp + inflight * act
        fixed = work + self._edge_bytes(layout, mbs, seq, inflight)
        return per_layer, fixed, t_layer, self._edge_time(layout, mbs, seq), g

    def _edge_bytes(self, layout, mbs, seq, inflight) -> np.ndarray:
        m, tr = self.model, self.training
        tp, pp = layout.tp, layout.pp
        bpp = cm.model_state_bytes_per_param(tr, layout.dp)
        out = np.zeros(pp)
        out[0] += m.embedding_params / tp * bpp + inflight[0] * mbs * seq * m.hidden_size * tr.dtype_bytes
        out[-1] += m.head_params / tp * bpp + cm.logits_bytes(m, mbs, seq, tp)
        return out

    def _edge_time(self, layout, mbs, seq) -> np.ndarray:
        out = np.zeros(layout.pp)
        out[0] += self.analytical.embedding_time(layout.stage_device[0], layout.tp, mbs, seq)
        out[-1] += self.analytical.head_time(layout.stage_device[-1], layout.tp, mbs, seq)
        return out

    def score(self, layout: Layout, mbs: int, seq: int, schedule: str, v: int,
              levels: np.ndarray, layers: np.ndarray | None = None) -> GroupResult:
        """Split layers (unless given), apply the per-stage hard rule, and score every row."""
        L = self.model.num_layers
        min_layers = v if schedule == "interleaved" else 1
        per_layer, fixed, t_layer, edge_t, g = self.split_inputs(layout, mbs, seq, v, levels)
        cap, usable = layout.capacity, self.usable(layout)
        if layers is None:
            max_layers = np.floor((usable - fixed) / per_layer)
            layers, feasible = balance_layers(t_layer, edge_t, max_layers, L, min_layers)
            levels = self.lowest_fitting_levels(layout, mbs, seq, v, levels, layers)
            per_layer, fixed, t_layer, _, _ = self.split_inputs(layout, mbs, seq, v, levels)
        memory = layers * per_layer + fixed
        feasible = (memory <= usable).all(axis=1) & (layers >= min_layers).all(axis=1) & (layers.sum(axis=1) == L)
        stage_time = layers * t_layer + edge_t
        T = self.iteration_time(layout, mbs, seq, schedule, v, g, stage_time, layers)
        # M: the fullest device, as a fraction of its capacity (devices of different sizes
        # compare); V: the variance of the devices' memory use in GiB^2, as the paper's
        # (its Table 10 reports 9.13e5 MB^2), so that balance means equal use, not equal shares.
        return GroupResult(layout, mbs, seq, schedule, v, levels, layers, memory, stage_time,
                           T, (memory / cap).max(axis=1), (memory / cm.GIB).var(axis=1), feasible)

    def fits_with_full_recompute(self, layout, mbs, seq, schedule, v) -> bool:
        """Memory lower bound: can the stages hold every layer even when all recompute fully?"""
        full = np.full((1, layout.pp), cm.FULL)
        per_layer, fixed, *_ = self.split_inputs(layout, mbs, seq, v, full)
        max_layers = np.floor((self.usable(layout) - fixed) / per_layer)
        min_layers = v if schedule == "interleaved" else 1
        return bool((max_layers >= min_layers).all() and max_layers.sum() >= self.model.num_layers)

    def lowest_fitting_levels(self, layout, mbs, seq, v, levels, layers) -> np.ndarray:
        """Hard rule per stage: keep no recompute where it fits, else the lightest level that does."""
        best = levels.copy()
        for level in (cm.FULL, cm.SELECTIVE, cm.NONE):
            trial = np.full_like(levels, level)
            per_layer, fixed, *_ = self.split_inputs(layout, mbs, seq, v, trial)
            fits = layers * per_layer + fixed <= self.usable(layout)
            best = np.where(fits & (level < best), level, best)
        return best

    def iteration_time(self, layout, mbs, seq, schedule, v, g, stage_time, layers) -> np.ndarray:
        m, tr = self.model, self.training
        hidden_bytes = mbs * seq * m.hidden_size * tr.dtype_bytes
        transfer = np.where(np.isinf(layout.next_stage_gbps), 0.0,
                            hidden_bytes / (layout.next_stage_gbps * 1e9))
        stage_params = layers * m.layer_params / layout.tp
        stage_params[:, 0] += m.embedding_params / layout.tp
        stage_params[:, -1] += m.head_params / layout.tp
        t_dp = cm.allreduce_time(stage_params * 4.0, layout.dp, layout.dp_gbps).max(axis=1)
        t_fix = np.max([cm.optimizer_step_time(stage_params[:, i], tr, self.device_types[d], layout.dp)
                        for i, d in enumerate(layout.stage_device)], axis=0)
        if schedule == "interleaved":
            return cm.iteration_time_interleaved(stage_time, transfer, g, v, t_fix, t_dp)
        return cm.iteration_time_1f1b(stage_time, transfer, g, t_fix, t_dp)


def balance_layers(t_layer, edge_t, max_layers, num_layers, min_layers=1):
    """Uneven split minimising the slowest stage under each stage's memory limit.

    Bisection on the bottleneck time T: stage i can take min(max_layers_i, (T - edge_i)/t_i)
    layers; the smallest T whose capacities add up to ``num_layers`` wins, then the surplus
    is taken back from the slowest stages. Rows are independent candidates.
    Returns (layers (C, P) int, feasible (C,) bool).
    """
    max_layers = np.minimum(np.maximum(max_layers, 0), num_layers)
    feasible = (max_layers >= min_layers).all(axis=1) & (max_layers.sum(axis=1) >= num_layers)
    inv_t = 1.0 / t_layer
    offset = edge_t * inv_t
    upper = np.maximum(max_layers, min_layers)
    lo = np.zeros((t_layer.shape[0], 1))
    hi = (num_layers * t_layer + edge_t).max(axis=1, keepdims=True) + 1e-12
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) * 0.5
        take = np.minimum(np.maximum(np.floor(mid * inv_t - offset), min_layers), upper)
        enough = take.sum(axis=1, keepdims=True) >= num_layers
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid)
    layers = np.minimum(np.maximum(np.floor(hi * inv_t - offset), min_layers), upper)
    surplus = layers.sum(axis=1) - num_layers
    rows = np.arange(len(layers))
    while (surplus > 0).any():
        active = surplus > 0
        time_now = np.where(layers > min_layers, layers * t_layer + edge_t, -np.inf)
        worst = time_now.argmax(axis=1)
        layers[rows[active], worst[active]] -= 1
        surplus = surplus - active
    # Infeasible rows: spread the layers by memory room, so the shortfall can be reported.
    room = np.maximum(max_layers, 0) + 1e-9
    spread = np.floor(room / room.sum(axis=1, keepdims=True) * num_layers)
    spread[:, 0] += num_layers - spread.sum(axis=1)
    layers = np.where(feasible[:, None], layers, np.maximum(spread, min_layers))
    return layers.astype(np.int64), feasible


# --------------------------------------------------------------------------- objective


def objective_terms(T, M, V, references=None):
    """Reference values are medians over the feasible candidates (paper section 3.1.2)."""
    t_ref, m_ref, v_ref = references or (np.median(T), np.median(M), np.median(V))
    eps = EPS_V_FRACTION * v_ref if v_ref > 0 else 1e-12
    return T / t_ref, M / m_ref, (V + eps) / (v_ref + eps)


def phi(T, M, V, weights, references=None):
    """Phi = T^wT * M^wM * V^wV on the normalised terms; returns (phi, (t, m, v))."""
    t, m, v = objective_terms(T, M, V, references)
    w_t, w_m, w_v = weights
    return t**w_t * m**w_m * v**w_v, (t, m, v)


def choose_profile(cluster: ClusterSpec, T, M) -> tuple[str, str]:
    """Safety when memory is tight for this model on this cluster: even the leanest feasible
    candidate leaves under 10% free. Throughput for (nearly) homogeneous clusters; the
    heterogeneous default otherwise."""
    margin = 1.0 - float(np.min(M))
    het = cluster.heterogeneity_index()
    if margin < SAFETY_MARGIN:
        return "safety", f"even the leanest feasible plan leaves only {margin:.0%} memory free (< {SAFETY_MARGIN:.0%})"
    if het < WEAK_HETEROGENEITY:
        return "throughput", f"compute heterogeneity index {het:.2f} < {WEAK_HETEROGENEITY}"
    return "default", f"heterogeneous cluster (compute CV {het:.2f}), up to {margin:.0%} memory free"


def parse_weights(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError("--weights", f"expected three non-negative numbers wT,wM,wV, got {text!r}",
                          "e.g. --weights 0.4,0.2,0.4")
    total = sum(values)
    return tuple(v / total for v in values)


# --------------------------------------------------------------------------- search


def search(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
           cost_model: cm.LayerCostModel | None = None, space: SearchSpace | None = None,
           objective: str | None = None, weights: tuple[float, float, float] | None = None,
           time_budget_s: float | None = None, top_k: int = 10,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Rank every candidate of the space by Phi; raise NoFeasiblePlanError when none fits."""
    start = time.perf_counter()
    space = space or SearchSpace()
    seqs = tuple(space.seq_lens or (training.seq_len,))
    analytical = cm.AnalyticalCostModel(model, cluster, training)
    cost_model = cost_model or analytical
    layouts = enumerate_layouts(model, cluster, tuple(cost_model.device_names), list(space.tp_degrees or [])
                                or None)
    if not layouts:
        raise ConfigError("cluster", f"no TP x PP x DP layout fits {cluster.world_size} devices of counts "
                          f"{cluster.type_counts()} with at most {model.num_layers} stages",
                          "give each device type a count that shares a common divisor with the others")
    tps = sorted({lay.tp for lay in layouts})
    table = CostTable(cost_model, len(cost_model.device_names), tps, space.micro_batch_sizes, seqs)
    evaluator = Evaluator(model, cluster, training, cost_model, analytical, table, space.memory_headroom)
    stats = SearchStats()
    level_options, stats.binary_recompute_types = recompute_options(table, cost_model.device_names, space)
    stats.interleaving_allowed = cluster.heterogeneity_index() <= INTERLEAVE_MAX_HETEROGENEITY
    schedules = [("1f1b", 1)] + [("interleaved", v) for v in space.virtual_stages if "interleaved" in space.schedules]
    if "1f1b" not in space.schedules:
        schedules = schedules[1:]

    groups = []
    for layout in layouts:
        policies = _policy_rows(layout, level_options)
        for mbs, seq in itertools.product(space.micro_batch_sizes, seqs):
            for schedule, v in schedules:
                stats.enumerated += len(policies)
                if training.global_batch_size % (layout.dp * mbs):
                    stats.pruned_batch += len(policies)
                    continue
                g = training.global_batch_size // (layout.dp * mbs)
                if g < layout.pp:  # pipeline schedules need a micro-batch in flight per stage
                    stats.pruned_batch += len(policies)
                    continue
                if schedule == "interleaved" and (not stats.interleaving_allowed or g % layout.pp
                                                  or layout.pp * v > model.num_layers or layout.pp < 2):
                    stats.pruned_schedule += len(policies)
                    continue
                groups.append((_time_lower_bound(table, layout, mbs, seq, g, model.num_layers),
                               layout, mbs, seq, schedule, v, policies))
    groups.sort(key=lambda item: item[0])

    results: list[GroupResult] = []
    closest: list[tuple[float, str]] = []
    best_time = math.inf
    report_every = max(1, len(groups) // 10)
    for i, (lower_bound, layout, mbs, seq, schedule, v, policies) in enumerate(groups):
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            stats.budget_exhausted = True
            stats.pruned_time += sum(len(item[-1]) for item in groups[i:])
            break
        if lower_bound > space.time_prune_factor * best_time:
            stats.pruned_time += len(policies)
            continue
        # Memory lower bound: full recompute everywhere is the least memory a group can use.
        if not evaluator.fits_with_full_recompute(layout, mbs, seq, schedule, v):
            stats.pruned_memory += len(policies)
            full = np.full((1, layout.pp), cm.FULL)
            closest.append(_shortfall(evaluator.score(layout, mbs, seq, schedule, v, full), cost_model.device_names))
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
    stats.cache_hits, stats.cache_misses = table.hits, table.misses

    if not results and stats.pruned_batch == stats.enumerated:
        raise ConfigError("--global-batch-size", f"{training.global_batch_size} is not divisible by DP x micro-batch "
                          f"for any candidate (micro-batches {list(space.micro_batch_sizes)})",
                          "use a multiple of the data-parallel degree, e.g. a power of two")
    if not results:
        closest.sort()
        stats.seconds = time.perf_counter() - start
        if stats.budget_exhausted:
            raise NoFeasiblePlanError(
                f"the search budget of {time_budget_s:g}s ran out before any feasible plan was found "
                f"({stats.evaluated} of {stats.enumerated} evaluated); raise --search-budget-s", [])
        raise NoFeasiblePlanError(
            f"no candidate fits in memory ({stats.enumerated} enumerated, {stats.pruned_memory} over capacity "
            "even with full recompute); use more devices, a shorter --seq-len or a smaller model",
            [text for _, text in closest[:5]])

    ranked = _rank(results, cluster, model, training, objective, weights, top_k)
    stats.seconds = time.perf_counter() - start
    plans, pareto, profile, chosen, reason = ranked
    return SearchResult(plans, pareto, stats, profile, chosen, reason)


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
    """All layers of every micro-batch on perfectly balanced stages of the fastest device."""
    t_min = table.time[layout.stage_device, table.tps.index(layout.tp), table.mbss.index(mbs),
                       table.seqs.index(seq), cm.NONE].min()
    return g * num_layers * t_min / layout.pp


def _shortfall(result: GroupResult, device_names) -> tuple[float, str]:
    over = (result.memory[0] - result.layout.capacity) / cm.GIB
    lay = result.layout
    parts = [f"{device_names[d]} short {o:.1f} GiB" for d, o in zip(lay.stage_device, over) if o > 0]
    text = (f"tp={lay.tp} pp={lay.pp} dp={lay.dp} mbs={result.mbs} seq={result.seq} full recompute: "
            + ", ".join(dict.fromkeys(parts)))
    return float(over.max()), text


def _rank(results, cluster, model, training, objective, weights, top_k):
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
    order = np.argsort(score, kind="stable")
    plans, seen = [], set()
    for k in order:
        gi, row = index[k]
        key = _plan_key(results[gi], row)
        if key in seen:
            continue
        seen.add(key)
        terms = {"T": float(t_n[k]), "M": float(m_n[k]), "V": float(v_n[k]), **refs}
        plans.append(to_plan(results[gi], row, model, cluster, training,
                             Objective(float(score[k]), profile, chosen, terms)))
        if len(plans) >= top_k:
            break
    pareto, best_v, seen = [], math.inf, set()
    for k in np.lexsort((V, T)):
        if V[k] < best_v:
            best_v = V[k]
            gi, row = index[k]
            terms = {"T": float(t_n[k]), "M": float(m_n[k]), "V": float(v_n[k]), **refs}
            pareto.append(to_plan(results[gi], row, model, cluster, training,
                                  Objective(float(score[k]), profile, chosen, terms)))
    return plans, pareto, profile, chosen, why


def _plan_key(result: GroupResult, row: int):
    lay = result.layout
    return (lay.tp, lay.dp, lay.order, result.mbs, result.seq, result.schedule, result.v,
            tuple(result.levels[row]), tuple(result.layers[row]))


def to_plan(result: GroupResult, row: int, model, cluster, training, objective: Objective) -> Plan:
    lay = result.layout
    names = cluster.rank_device_types()
    stages = [StagePlan(device_type=names[ranks[0]], ranks=list(ranks),
                        num_layers=int(result.layers[row, i]),
                        recompute=cm.RECOMPUTE_LEVELS[int(result.levels[row, i])],
                        predicted_peak_memory_gib=round(float(result.memory[row, i]) / cm.GIB, 6),
                        predicted_stage_time_s=float(result.stage_time[row, i]),
                        memory_capacity_gib=float(lay.capacity[i]) / cm.GIB)
              for i, ranks in enumerate(lay.stage_ranks)]
    return Plan(model=model.name, model_spec=model, cluster=cluster.name, tp=lay.tp, pp=lay.pp, dp=lay.dp,
                micro_batch_size=result.mbs, global_batch_size=training.global_batch_size,
                seq_len=result.seq, schedule=result.schedule, virtual_stages=result.v, stages=stages,
                predicted_iteration_time_s=float(result.T[row]), objective=objective,
                predicted_peak_memory_fraction=float(result.M[row]),
                predicted_memory_variance=float(result.V[row]), emulated=cluster.is_emulated,
                training={"dtype": training.dtype, "optimizer": training.optimizer,
                          "distributed_optimizer": training.distributed_optimizer,
                          "fully_sharded": training.fully_sharded})


def progress_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- single layouts


def _parse_levels(recompute, pp: int) -> np.ndarray:
    if recompute is None:
        recompute = ["none"]
    if isinstance(recompute, str):
        recompute = recompute.split(",")
    if len(recompute) == 1:
        recompute = list(recompute) * pp
    if len(recompute) != pp:
        raise ConfigError("--recompute", f"{len(recompute)} levels for pp={pp}", "give one level, or one per stage")
    for level in recompute:
        if level not in cm.RECOMPUTE_LEVELS:
            raise ConfigError("--recompute", f"unknown level {level!r}", f"use one of {', '.join(cm.RECOMPUTE_LEVELS)}")
    return np.array([[cm.RECOMPUTE_LEVELS.index(level) for level in recompute]])


def evaluate_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, tp: int, pp: int,
                    dp: int, micro_batch_size: int, layers_per_stage=None, recompute=None,
                    stage_devices=None, schedule: str = "1f1b", virtual_stages: int = 1,
                    cost_model: cm.LayerCostModel | None = None, weights=None,
                    references: tuple[float, float, float] | None = None) -> Plan:
    """Predict one given layout (``memx estimate``). The plan may not fit: its stages then
    show predicted memory above capacity. Phi uses ``references`` (T, M, V medians) when
    given, else those of a default search of the same model, cluster and training spec."""
    if schedule not in ("1f1b", "interleaved"):
        raise ConfigError("--schedule", f"unknown schedule {schedule!r}", "use 1f1b or interleaved")
    v = virtual_stages if schedule == "interleaved" else 1
    if training.global_batch_size % (dp * micro_batch_size):
        raise ConfigError("--global-batch-size", f"{training.global_batch_size} is not divisible by "
                          f"dp*micro_batch_size={dp * micro_batch_size}", "choose a multiple of dp*micro_batch_size")
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise ConfigError("--tp", f"{tp} does not divide the model's {model.num_heads} heads and "
                          f"{model.num_kv_heads} KV heads", "use a divisor of both")
    if training.global_batch_size // (dp * micro_batch_size) < pp:
        raise ConfigError("--global-batch-size", f"{training.global_batch_size // (dp * micro_batch_size)} "
                          f"micro-batches for pp={pp} stages", "give at least one micro-batch per stage")
    analytical = cm.AnalyticalCostModel(model, cluster, training)
    cost_model = cost_model or analytical
    layout = layout_from_stage_devices(model, cluster, tuple(cost_model.device_names), tp, pp, dp, stage_devices)
    table = CostTable(cost_model, len(cost_model.device_names), [tp], [micro_batch_size], [training.seq_len])
    evaluator = Evaluator(model, cluster, training, cost_model, analytical, table)
    levels = _parse_levels(recompute, pp)
    layers = None
    if layers_per_stage is not None:
        layers = np.array([list(layers_per_stage)], dtype=np.int64)
        if layers.shape[1] != pp or layers.sum() != model.num_layers or (layers < v).any():
            raise ConfigError("--layers-per-stage", f"{list(layers_per_stage)} must give pp={pp} stages of at "
                              f"least {v} layer(s) adding up to {model.num_layers}", "fix the split")
        result = evaluator.score(layout, micro_batch_size, training.seq_len, schedule, v, levels, layers)
    else:
        result = _score_fixed_levels(evaluator, layout, micro_batch_size, training.seq_len, schedule, v, levels)
    if references is None:
        references = default_references(model, cluster, training, cost_model)
    profile = "custom" if weights is not None else "default"
    chosen = tuple(weights) if weights is not None else WEIGHT_PROFILES["default"]
    objective = _objective_for(result.T[0], result.M[0], result.V[0], references, profile, chosen)
    return to_plan(result, 0, model, cluster, training, objective)


def _score_fixed_levels(evaluator: Evaluator, layout, mbs, seq, schedule, v, levels) -> GroupResult:
    """Balanced split for levels the user fixed (no per-stage hard rule: their choice stands)."""
    per_layer, fixed, t_layer, edge_t, _ = evaluator.split_inputs(layout, mbs, seq, v, levels)
    min_layers = v if schedule == "interleaved" else 1
    max_layers = np.floor((evaluator.usable(layout) - fixed) / per_layer)
    layers, _ = balance_layers(t_layer, edge_t, max_layers, evaluator.model.num_layers, min_layers)
    return evaluator.score(layout, mbs, seq, schedule, v, levels, layers)


def default_references(model, cluster, training, cost_model=None) -> tuple[float, float, float]:
    """T, M and V medians over the feasible candidates of the default space."""
    try:
        result = search(model, cluster, training, cost_model=cost_model, top_k=1)
    except (NoFeasiblePlanError, ConfigError):
        return (math.nan, math.nan, math.nan)
    refs = result.best.objective.terms
    return refs["T_ref"], refs["M_ref"], refs["V_ref"]


def _objective_for(T, M, V, references, profile, weights) -> Objective:
    value, (t, m, v) = phi(T, M, V, weights, references)
    t_ref, m_ref, v_ref = references
    terms = {"T": float(t), "M": float(m), "V": float(v),
             "T_ref": float(t_ref), "M_ref": float(m_ref), "V_ref": float(v_ref)}
    return Objective(float(value), profile, tuple(weights), terms)


# --------------------------------------------------------------------------- baselines


def compare_baselines(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                      cost_model: cm.LayerCostModel | None = None, space: SearchSpace | None = None,
                      objective: str | None = None, weights=None,
                      memx: SearchResult | None = None) -> dict[str, Plan | None]:
    """What other planners would pick, judged by the same cost model.

    compute-proportional: layers by effective compute share, no recompute, fastest predicted
    plan (memory not checked, as compute-share planners do); memory-proportional: layers by
    capacity share, no recompute, fastest plan that fits; time-only: memx's search with
    weights (1, 0, 0); memx: memx's own choice (``memx``, the search already run, when given).
    """
    space = space or SearchSpace()
    if memx is None:
        memx = search(model, cluster, training, cost_model=cost_model, space=space, objective=objective,
                      weights=weights, top_k=1)
    refs = tuple(memx.best.objective.terms[k] for k in ("T_ref", "M_ref", "V_ref"))
    out: dict[str, Plan | None] = {}
    analytical = cm.AnalyticalCostModel(model, cluster, training)
    cost_model = cost_model or analytical
    names = tuple(cost_model.device_names)
    seq = training.seq_len
    table = CostTable(cost_model, len(names), tp_degrees(model, cluster), space.micro_batch_sizes, [seq])
    evaluator = Evaluator(model, cluster, training, cost_model, analytical, table)
    for name, share_of, must_fit in (("compute-proportional", _compute_share, False),
                                     ("memory-proportional", _memory_share, True)):
        best = None
        for layout in enumerate_layouts(model, cluster, names):
            layers = proportional_split(share_of(cluster, layout, names), model.num_layers)
            for mbs in space.micro_batch_sizes:
                if training.global_batch_size % (layout.dp * mbs) or layers.min() < 1:
                    continue
                levels = np.zeros((1, layout.pp), dtype=np.int64)
                result = evaluator.score(layout, mbs, seq, "1f1b", 1, levels, layers[None, :])
                if must_fit and not result.feasible[0]:
                    continue
                if best is None or result.T[0] < best.T[0]:
                    best = result
        out[name] = None if best is None else to_plan(
            best, 0, model, cluster, training,
            _objective_for(best.T[0], best.M[0], best.V[0], refs, memx.profile, memx.weights))
    time_only = search(model, cluster, training, cost_model=cost_model, space=space, weights=(1.0, 0.0, 0.0),
                       top_k=1).best
    time_only.objective = _objective_for(time_only.predicted_iteration_time_s,
                                         time_only.predicted_peak_memory_fraction,
                                         time_only.predicted_memory_variance, refs, memx.profile, memx.weights)
    out["time-only"] = time_only
    out["memx"] = memx.best
    return out


def _compute_share(cluster, layout, names):
    return np.array([cluster.device_type(names[d]).effective_tflops for d in layout.stage_device])


def _memory_share(cluster, layout, names):
    return np.array([cluster.device_type(names[d]).memory_gib for d in layout.stage_device])


def proportional_split(share: np.ndarray, num_layers: int) -> np.ndarray:
    """Largest-remainder rounding of ``num_layers * share / sum(share)``."""
    exact = num_layers * share / share.sum()
    layers = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - layers))[: num_layers - layers.sum()]:
        layers[i] += 1
    return layers
