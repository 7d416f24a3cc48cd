"""Pipeline layouts: which ranks form each stage, each stage's TP degree, a CP and a DP degree
and an order of device types along the pipeline. TP groups stay inside one device type; the
search keeps every stage on one type, a user-given stage may spread its DP replicas over
several (``A100+V100``, :func:`parse_stage_devices`). A stage's ranks are in Megatron's order:
TP fastest, then CP, then DP (a DP replica is ``cp`` consecutive TP groups).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning.bridge import EdgeCrossing, GroupCrossing, layout_crossings, tied_crossing
from memx_launch.planning.collectives import NVLINK, PCI
from memx_launch.planning.costmodel import communicators_per_rank
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.tp_split import splits_over_tp


MIXED_SEPARATOR = "+"
REPLICAS_MARK = "*"


@dataclass
class Layout:
    """One (per-stage TP, DP, device-type order): which ranks form each pipeline stage.

    A stage whose DP replicas sit on several device types has one row per type in
    ``replica_device`` / ``replica_capacity`` (a stage on one type repeats it): the scorer
    times the stage at its slowest type and checks its memory on every type.
    """

    stage_tp: np.ndarray              # (P,) TP degree of each stage
    dp: int
    order: tuple[str, ...]
    replica_device: np.ndarray        # (K, P) index into the cost model's device names
    stage_ranks: list[list[int]]
    replica_capacity: np.ndarray      # (K, P) bytes
    next_stage_gbps: np.ndarray       # (P,) link to the next stage, inf for the last
    dp_gbps: np.ndarray               # (P,) slowest link of the stage's DP groups
    dp_nodes: np.ndarray              # (P,) most nodes one of the stage's DP groups spans
    dp_hop: np.ndarray                # (P,) collectives.NVLINK or PCI: the hop inside a node of its DP groups
    edge_crossings: tuple[EdgeCrossing, ...] = ()
    """Pipeline edges (the last stage's: interleaving's wrap-around) that cross communication domains."""
    group_crossings: tuple[GroupCrossing, ...] = ()
    """Stages whose DP groups span communication domains."""
    ends_gbps: float = math.inf
    """The link between the first and the last stage (tied embeddings' gradient sum)."""
    ends_crossing: EdgeCrossing | None = None
    """That sum, when the first and the last stage sit in different domains."""
    cp: int = 1
    """Context-parallel degree: each DP replica's micro-batch is split along the sequence over
    ``cp`` TP groups (``planning/context_parallel.py``)."""
    cp_gbps: np.ndarray | None = None
    """(P,) what each transfer of the stage's CP rings gets, all rings at once; None without CP."""
    stage_dp: np.ndarray | None = None
    """(P,) each stage's DP degree where they differ (Sailor's plans); None: every stage at
    ``dp``, which is otherwise the largest. A pipeline micro-batch is ``dp x micro-batch``
    sequences on every stage: a stage of fewer replicas runs larger local micro-batches
    (:meth:`local_micro_batch`)."""

    @property
    def pp(self) -> int:
        return len(self.stage_ranks)

    @property
    def stage_dps(self) -> np.ndarray:
        """(P,) the DP degree of each stage."""
        return np.full(self.pp, self.dp) if self.stage_dp is None else self.stage_dp

    @property
    def dp_cp(self):
        """Ranks of a stage holding the same parameters (DP x CP): its gradients sync and its
        sharded states spread over them; (P,) where the stages' DP degrees differ."""
        return self.dp * self.cp if self.stage_dp is None else self.stage_dp * self.cp

    def local_micro_batch(self, mbs: int):
        """Sequences a replica of each stage runs per micro-batch: ``mbs``, or (P,) where the
        stages' DP degrees differ (a pipeline micro-batch of ``dp x mbs`` split over each
        stage's replicas)."""
        return mbs if self.stage_dp is None else mbs * self.dp // self.stage_dp

    @functools.cached_property
    def communicators(self) -> np.ndarray:
        """(P,) communicators a rank of each stage joins (their buffers count in its memory)."""
        world = sum(len(ranks) for ranks in self.stage_ranks)
        return np.array([communicators_per_rank(int(tp), self.pp, int(dp), world, self.cp)
                         for tp, dp in zip(self.stage_tp, self.stage_dps)])

    @functools.cached_property
    def uniform_tp(self) -> bool:
        return bool((self.stage_tp == self.stage_tp[0]).all())

    @functools.cached_property
    def end_tp(self) -> tuple[int, int]:
        """TP degrees of the first and the last stage (embedding, head)."""
        return int(self.stage_tp[0]), int(self.stage_tp[-1])

    @property
    def tp(self) -> int:
        """The TP degree of every stage; only a layout whose stages share one has it."""
        if not self.uniform_tp:
            raise ValueError(f"stages have different TP degrees {self.stage_tp.tolist()}")
        return int(self.stage_tp[0])

    @functools.cached_property
    def tp_degrees(self):
        """The TP degree as the cost functions take it: one number where every stage has it (a
        scalar broadcasts: the search's hot path), else one per stage."""
        return self.tp if self.uniform_tp else self.stage_tp

    @property
    def stage_device(self) -> np.ndarray:
        """(P,) each stage's (first) device type."""
        return self.replica_device[0]

    @property
    def capacity(self) -> np.ndarray:
        """(P,) bytes of each stage's (first) device type."""
        return self.replica_capacity[0]

    @property
    def mixed(self) -> bool:
        return len(self.replica_device) > 1


def first_and_last(values, pp: int) -> tuple:
    """The first and the last stage's ``values`` (one value, or one per stage)."""
    if np.ndim(values) == 0:  # the search's hot path: one DP degree
        return values, values
    values = np.broadcast_to(values, (pp,))
    return values[0], values[-1]


def tp_degrees(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Powers of two that divide the heads (and Mamba groups) and fit inside one node for every device type."""
    per_node = min(n for node in cluster.nodes for _, n in node.devices)
    out, tp = [], 1
    while tp <= min(8, per_node):
        if splits_over_tp(model, tp):
            out.append(tp)
        tp *= 2
    return out


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, device_names: tuple[str, ...],
                      tps: list[int] | None = None, max_orders: int = 24, per_type_tp: bool = False,
                      mixed_stages: bool = False, cps: tuple[int, ...] = (1,), per_type_dp: bool = False) -> list[Layout]:
    """Every (TP, CP, DP, device-type order) layout: one CP and one DP degree for all stages, a
    type's stages on its own ranks, tp x cp x dp dividing the type's count (``cps``: the CP
    degrees to take; the layouts of CP 1 first). ``per_type_tp``: each device type may
    take its own TP degree from ``tps`` (layouts of one degree come first, in the same order).
    ``per_type_dp``: each device type may take its own DP degree, each dividing the largest (a
    type of fewer replicas runs larger local micro-batches; after the one-degree layouts).
    ``mixed_stages``: also the layouts whose tp x dp divides the world but not every type's
    count, the stage at a boundary between types taking its replicas from both (after the
    others)."""
    rank_types = cluster.rank_device_types()
    counts = cluster.type_counts()
    ranks_of = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in counts}
    degrees = tps or tp_degrees(model, cluster)
    combos = [(tp,) * len(counts) for tp in degrees]
    if per_type_tp and len(counts) > 1:
        combos += [c for c in itertools.product(degrees, repeat=len(counts)) if len(set(c)) > 1]
    layouts = []
    for cp, combo in itertools.product(sorted(cps), combos):
        tp_of = dict(zip(counts, combo))
        for dp_of in _dp_choices(counts, tp_of, cp, per_type_dp):
            if sum(counts[t] // (tp_of[t] * cp * dp_of[t]) for t in counts) > model.num_layers:
                continue
            for order in itertools.islice(itertools.permutations(counts), max_orders):
                stage_ranks, stage_tp, stage_dp = [], [], []
                for t in order:
                    group = tp_of[t] * cp * dp_of[t]
                    stage_ranks += [ranks_of[t][i:i + group] for i in range(0, counts[t], group)]
                    stage_tp += [tp_of[t]] * (counts[t] // group)
                    stage_dp += [dp_of[t]] * (counts[t] // group)
                layouts.append(make_layout(cluster, device_names, stage_tp, stage_dp, order, stage_ranks, cp))
    if mixed_stages:
        layouts += _spanning_layouts(model, cluster, device_names, degrees, max_orders, cps)
    return layouts


def _dp_choices(counts: dict, tp_of: dict, cp: int, per_type_dp: bool) -> list[dict]:
    """DP degree of each device type: one for all that divides every type's replica groups, then
    with ``per_type_dp`` (several types) one per type, each dividing the largest."""
    options = {t: [dp for dp in range(1, counts[t] // (tp_of[t] * cp) + 1) if counts[t] % (tp_of[t] * cp * dp) == 0]
               for t in counts}
    shared = sorted(set.intersection(*(set(o) for o in options.values())))
    choices = [{t: dp for t in counts} for dp in shared]
    if per_type_dp and len(counts) > 1:
        choices += [dict(zip(counts, dps)) for dps in itertools.product(*options.values())
                    if len(set(dps)) > 1 and not any(max(dps) % d for d in dps)]
    return choices


def _spanning_layouts(model, cluster, device_names, degrees, max_orders, cps) -> list[Layout]:
    """Layouts of one TP and one CP degree whose stages cut the ranks, taken type after type, into
    groups of tp x cp x dp where that does not divide some type's count: a stage across a
    boundary has replicas of both types (each replica, its TP groups and CP ring, inside one
    type, so tp x cp divides every count)."""
    rank_types = cluster.rank_device_types()
    counts = cluster.type_counts()
    ranks_of = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in counts}
    out = []
    for cp, tp in itertools.product(sorted(cps), degrees):
        width = tp * cp
        if any(n % width for n in counts.values()):
            continue
        for dp in range(1, cluster.world_size // width + 1):
            group = width * dp
            if cluster.world_size % group or all(n % group == 0 for n in counts.values()) \
                    or cluster.world_size // group > model.num_layers:
                continue
            for order in itertools.islice(itertools.permutations(counts), max_orders):
                ranks = [r for t in order for r in ranks_of[t]]
                stage_ranks = [ranks[i:i + group] for i in range(0, len(ranks), group)]
                out.append(make_layout(cluster, device_names, tp, dp, order, stage_ranks, cp))
    return out


def tp_text(stage_tp) -> str:
    """A per-stage degree (TP, DP) as plans print it: ``4``, or ``4|2|2`` when the stages' differ."""
    degrees = [int(t) for t in stage_tp]
    return str(degrees[0]) if len(set(degrees)) == 1 else "|".join(map(str, degrees))


def make_layout(cluster, device_names, tp, dp, order, stage_ranks, cp: int = 1) -> Layout:
    """``tp``: one degree for every stage or one per stage. A stage's ranks are its DP replicas
    in order, ``tp x cp`` consecutive ranks each (its CP group's TP groups in order); they may
    be of several device types. ``dp``: one degree, or one per stage."""
    rank_types = cluster.rank_device_types()
    stage_tp = np.broadcast_to(np.asarray(tp, dtype=np.int64), (len(stage_ranks),)).copy()
    stage_dp = np.broadcast_to(np.asarray(dp, dtype=np.int64), (len(stage_ranks),)).copy()
    dp, stage_dp = int(stage_dp.max()), (stage_dp if len(set(stage_dp.tolist())) > 1 else None)
    types = [list(dict.fromkeys(rank_types[r] for r in ranks)) for ranks in stage_ranks]
    k = max(len(t) for t in types)
    rows = [[t[min(j, len(t) - 1)] for t in types] for j in range(k)]
    next_gbps = [cluster.transfers_gbps(zip(cur, nxt))
                 for cur, nxt in zip(stage_ranks, stage_ranks[1:])] + [math.inf]
    # A DP (x CP) group is every tp-th rank of the stage; the slowest group decides
    # (ClusterSpec.group_gbps: links inside a node, each node's share of its NICs between nodes).
    dp_gbps = [min([cluster.group_gbps(ranks[j::t]) for j in range(t)]) for ranks, t in zip(stage_ranks, stage_tp)]
    dp_nodes = [max(cluster.nodes_spanned(ranks[j::t]) for j in range(t)) for ranks, t in zip(stage_ranks, stage_tp)]
    dp_hop = [PCI if cluster.intra_hop_over_pcie(ranks) else NVLINK for ranks in stage_ranks]
    cp_gbps = np.array([cluster.transfers_gbps(cp_ring_pairs(ranks, t, cp)) for ranks, t in zip(stage_ranks, stage_tp)],
                       dtype=float) if cp > 1 else None
    return Layout(stage_tp, dp, tuple(order), np.array([[device_names.index(t) for t in row] for row in rows]),
                  [list(r) for r in stage_ranks],
                  np.array([[cluster.device_type(t).memory_bytes for t in row] for row in rows], dtype=float),
                  np.array(next_gbps, dtype=float), np.array(dp_gbps, dtype=float),
                  np.array(dp_nodes, dtype=float), np.array(dp_hop),
                  *layout_crossings(cluster, [list(r) for r in stage_ranks], stage_tp),
                  cluster.transfers_gbps(zip(stage_ranks[0], stage_ranks[-1])) if len(stage_ranks) > 1 else math.inf,
                  tied_crossing(cluster, [list(r) for r in stage_ranks]), cp, cp_gbps, stage_dp)


def cp_ring_pairs(ranks: list[int], tp: int, cp: int) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs of a stage's CP rings, all running at once: in each DP
    replica (``tp x cp`` consecutive ranks), one ring per TP rank through its ``cp`` peers."""
    pairs = []
    for start in range(0, len(ranks), tp * cp):
        for j in range(tp):
            ring = ranks[start + j:start + tp * cp:tp]
            pairs += list(zip(ring, ring[1:] + ring[:1]))
    return pairs


def parse_stage_devices(text: str, known, dp: int, field: str) -> list[tuple[str, int]]:
    """A stage's device types and how many of its ``dp`` replicas each holds, in rank order.

    ``A100`` (every replica), ``A100+V100`` (the replicas split evenly, the first types first)
    or ``A100*3+V100*1`` (replica counts adding up to dp). A whole known type name is
    always a type, so a type whose name holds ``+`` or ``*`` still works on its own."""
    text = str(text).strip()
    if text in known:
        return [(text, dp)]
    parts = [p.strip() for p in text.split(MIXED_SEPARATOR)]
    out = []
    for part in parts:
        name, mark, count = part.rpartition(REPLICAS_MARK) if REPLICAS_MARK in part else (part, "", "")
        if name not in known:
            raise ConfigError(field, f"unknown device type {name!r}", f"use one of {', '.join(known)}, "
                              f"or several joined by '{MIXED_SEPARATOR}' (e.g. a+b, a*3+b*1)")
        if mark and not (count.isascii() and count.isdigit() and int(count) > 0):
            raise ConfigError(field, f"{part!r}: replica count {count!r} is not a positive integer",
                              f"write TYPE{REPLICAS_MARK}N, N the stage's replicas on TYPE")
        out.append((name, int(count) if mark else 0))
    if len({name for name, _ in out}) != len(out):
        raise ConfigError(field, f"{text!r} names a device type twice", "list each type once")
    if all(n == 0 for _, n in out):
        if dp % len(out):
            raise ConfigError(field, f"dp={dp} replicas cannot split evenly over {len(out)} device types",
                              f"give counts, e.g. {out[0][0]}{REPLICAS_MARK}{dp - dp // 2}+...")
        return [(name, dp // len(out)) for name, _ in out]
    if any(n == 0 for _, n in out) or sum(n for _, n in out) != dp:
        raise ConfigError(field, f"replica counts in {text!r} must add up to dp={dp}",
                          f"give every type a count, e.g. {out[0][0]}{REPLICAS_MARK}{dp}")
    return out


def stage_device_types(text: str) -> list[str]:
    """The device types a stage's text names (``a``, ``a+b``, ``a*3+b*1``), unchecked."""
    return [part.rpartition(REPLICAS_MARK)[0] or part for part in text.split(MIXED_SEPARATOR)]


def stage_device_text(cluster: ClusterSpec, ranks: list[int], width: int) -> str:
    """A stage's device type as plans and ``--stage-devices`` write it: ``a``, ``a+b`` when its
    replicas (``width`` ranks each: TP x CP) split evenly over several types, else ``a*3+b*1``
    (replicas per type)."""
    rank_types = cluster.rank_device_types()
    counts: dict[str, int] = {}
    for r in ranks:
        counts[rank_types[r]] = counts.get(rank_types[r], 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    if len(set(counts.values())) == 1:
        return MIXED_SEPARATOR.join(counts)
    return MIXED_SEPARATOR.join(f"{t}{REPLICAS_MARK}{n // width}" for t, n in counts.items())


def layout_from_stage_devices(model, cluster, device_names, tp, pp, dp, stage_devices, cp: int = 1) -> Layout:
    """A user-given layout: stage i's replicas (``tp x cp`` ranks each) on the next free ranks of
    ``stage_devices[i]`` (one type, or several: :func:`parse_stage_devices`). ``tp`` and ``dp``:
    one degree each, or one per stage."""
    stage_tp = [int(tp)] * pp if np.ndim(tp) == 0 else [int(t) for t in tp]
    if len(stage_tp) != pp:
        raise ConfigError("--stage-tp", f"{len(stage_tp)} degrees for pp={pp}", "give one TP degree per stage")
    stage_dp = [int(dp)] * pp if np.ndim(dp) == 0 else [int(d) for d in dp]
    if len(stage_dp) != pp:
        raise ConfigError("--stage-dp", f"{len(stage_dp)} degrees for pp={pp}", "give one DP degree per stage")
    devices = sum(t * d for t, d in zip(stage_tp, stage_dp)) * cp
    if devices != cluster.world_size:
        if np.ndim(dp):
            flag, used = "--stage-dp", "sum(tp*stage_dp)" if np.ndim(tp) == 0 else "sum(stage_tp*stage_dp)"
        elif np.ndim(tp) == 0:
            flag, used = "--tp/--pp/--dp", "tp*pp*dp"
        else:
            flag, used = "--stage-tp/--dp", "sum(stage_tp)*dp"
        if cp > 1:
            flag, used = flag.replace("--dp", "--cp/--dp"), f"{used}*cp"
        raise ConfigError(flag, f"{used} = {devices} but the cluster has {cluster.world_size} devices",
                          "choose degrees whose devices add up to the world size")
    rank_types = cluster.rank_device_types()
    free = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in cluster.type_counts()}
    if stage_devices is None:
        starts = np.cumsum([0] + [t * cp * d for t, d in zip(stage_tp, stage_dp)])
        stage_devices = [rank_types[s] for s in starts[:-1]]
    if len(stage_devices) != pp:
        raise ConfigError("--stage-devices", f"{len(stage_devices)} entries for pp={pp}", "give one device type per stage")
    stage_ranks, order = [], []
    for i, (text, t, d) in enumerate(zip(stage_devices, stage_tp, stage_dp)):
        field = f"--stage-devices[{i}]"
        ranks = []
        for name, replicas in parse_stage_devices(text, free, d, field):
            width = t * cp
            if len(free[name]) < width * replicas:
                raise ConfigError(field, f"not enough {name} devices left for {replicas} replica(s) of "
                                  f"tp={t}" + (f" x cp={cp}" if cp > 1 else ""),
                                  "assign stages to device types by their counts")
            ranks += free[name][:width * replicas]
            free[name] = free[name][width * replicas:]
            order.append(name)
        stage_ranks.append(ranks)
    return make_layout(cluster, device_names, stage_tp, stage_dp, tuple(dict.fromkeys(order)), stage_ranks, cp)
