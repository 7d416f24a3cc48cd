"""Hybrid sharding: what a sharded setup shards spread over part of each DP group only
(``TrainingSpec.shard_degree``): PyTorch's HSDP (FSDP2 on a 2-D mesh, torchtitan's
``data_parallel_shard_degree`` beside its replicate degree), Megatron's partial distributed
optimizer (``--num-distributed-optimizer-instances``) and DeepSpeed's MiCS (``mics_shard_size``).

N consecutive members of each DP (x CP) group form a shard group: the model states are sharded
over its N x CP ranks, and its all-gathers and reduce-scatters run inside it (within a node when
it fits one: NVLink instead of the network). The DP / N shard groups are replicas of each other:
the ranks holding the same shard, one per shard group, all-reduce its reduced gradients (the
shard's bytes) after each reduce-scatter (torch's ``FSDPParamGroup.post_backward``: HSDP's
reduce-scatter, then the all-reduce over the replicate dimension; Megatron's intra-instance
reduce-scatter, then the inter-instance all-reduce). Less memory saved than sharding over the
whole group, and more traffic in all, but the large gathers stay on the fast links.

Across communication domains no library gathers weights (NCCL and RCCL share no communicator),
so a fully sharded DP group that spans domains is sharded within them: its shard groups, of
``shard_degree`` or else the most consecutive members that stay in one domain, gather and
reduce-scatter natively, and memx-run all-reduces each rank's reduced shard with its replicas
over the bridge once a step (runtime/training.py). Where no two consecutive members share a
domain, shard groups of one keep the states whole: memx-run averages that group itself, as it
does without full sharding, and it is priced as a stage sharded over one rank (its hidden states
at the compute precision, where memx-run's whole stage keeps its residual stream in fp32 under
autocast: the one difference). No torch import.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning.bridge import GroupCrossing, group_crossing
from memx_launch.planning.data_parallel import sync_allreduce_bytes
from memx_launch.planning.model_states import reduced_gradient_bytes
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec


class ShardGroups(NamedTuple):
    """A layout's shard groups and replica groups, per stage (P,), as collectives.py prices a group."""
    ranks: np.ndarray
    """Ranks of a shard group: N x CP (the stage's N: its ``shard_degree``, or within its domains)."""
    gbps: np.ndarray
    """The slowest link of the stage's shard groups (ClusterSpec.group_gbps, at the cluster's link_efficiency)."""
    nodes: np.ndarray
    """Most nodes one of them spans."""
    replicas: np.ndarray
    """Shard groups of a DP group: DP / N, the ranks each native replica all-reduce spans (1 where
    the replicas sit in different domains: they all-reduce over the bridge, ``bridged``)."""
    replica_gbps: np.ndarray
    replica_nodes: np.ndarray
    bridged: dict
    """Stage -> the crossing of its replica groups, where they span communication domains."""


def domain_shard_degree(member_domains: list[str], dp: int, cp: int = 1, given: int | None = None) -> int:
    """The shard degree of a DP (x CP) group whose members, replica after replica, sit in
    ``member_domains``: ``given`` where its shard groups (``given`` x CP consecutive members) each
    stay in one domain, else the largest divisor of ``dp`` whose do; 0 where ``given`` cannot."""
    for s in [given] if given else [d for d in range(dp, 0, -1) if dp % d == 0]:
        size = s * cp
        if dp % s == 0 and all(len(set(member_domains[k:k + size])) == 1 for k in range(0, len(member_domains), size)):
            return s
    return 0


def shards_in_part(training: TrainingSpec, layout) -> bool:
    """Whether a stage of ``layout`` may shard over part of its DP group: with ``shard_degree``, or
    a fully sharded DP group across domains; else every stage that shards does so over the whole."""
    return training.shard_degree is not None or bool(training.fully_sharded and layout.group_crossings)


def stage_shard_degrees(cluster: ClusterSpec, layout, training: TrainingSpec) -> np.ndarray | None:
    """(P,) each stage's shard degree (0: none will do); None unless :func:`shards_in_part`."""
    if not shards_in_part(training, layout):
        return None
    domain = cluster.rank_domains()
    # A TP group stays in one device type, so every TP rank's DP group meets the domains alike: the first's.
    return np.array([domain_shard_degree([domain[r] for r in ranks[::int(tp)]], int(dp), layout.cp, training.shard_degree)
                     for ranks, tp, dp in zip(layout.stage_ranks, layout.stage_tp, layout.stage_dps)])


def divides(cluster: ClusterSpec, layout, training: TrainingSpec) -> bool:
    """Every stage's DP group splits into shard groups of ``shard_degree`` that each stay in one
    domain (without it, always: shard groups of one do), and a mixture's shard groups (x TP) into
    whole expert groups (:func:`expert_groups_fit`)."""
    degrees = stage_shard_degrees(cluster, layout, training)
    return degrees is None or bool(degrees.all() and expert_groups_fit(layout, training, degrees))


def expert_groups_fit(layout, training: TrainingSpec, degrees) -> bool:
    """A stage's TP x N x CP ranks (its shard groups, one per TP rank) hold whole EP x ETP groups:
    the routed experts are sharded over those ranks' expert data parallel share, TP x N x CP / (EP x
    ETP), and replicated over the DP / N replicas (Megatron asserts the expert data parallel degree
    a multiple of its optimizer instances; torchtitan's experts shard within ``dp_shard``)."""
    ranks = np.asarray(layout.stage_tp) * np.asarray(degrees) * layout.cp
    return not (ranks % (training.expert_parallel * training.expert_tensor_parallel)).any()


def sharded_layouts(cluster: ClusterSpec, layouts_of: list[list], trainings: list[TrainingSpec]) -> list[list]:
    """Each training's layouts that :func:`divides`; a one-line refusal where none is left. The first
    training is the one asked for, the others its ``--shard-degrees`` variants: where it shards over
    the whole group, a variant's layout whose every DP group is one shard group is that same plan,
    scored once."""
    whole = trainings[0].shard_degree is None
    kept = [[lay for lay in layouts if divides(cluster, lay, training)
             and not (whole and (np.asarray(lay.stage_dps) == training.shard_degree).all())]
            for layouts, training in zip(layouts_of, trainings)]
    if any(layouts_of) and not any(kept):
        degrees = sorted({int(d) for layouts in layouts_of for lay in layouts for d in lay.stage_dps})
        experts = " that hold whole expert groups (TP x N x CP a multiple of EP x ETP)" \
            if any(t.expert_parallel * t.expert_tensor_parallel > 1 for t in trainings) else ""
        raise ConfigError("--shard-degree", f"{trainings[0].shard_degree} divides none of the layouts' DP degrees "
                          f"({', '.join(map(str, degrees))}) in groups within one communication domain{experts}",
                          "use a divisor of the DP degree, e.g. the ranks of a node")
    return kept


def check_layout(cluster: ClusterSpec, layout, training: TrainingSpec) -> None:
    """A one-line refusal where ``layout``'s DP groups cannot be sharded as :func:`divides` asks."""
    if divides(cluster, layout, training):
        return
    s = training.shard_degree
    dps = "|".join(str(int(d)) for d in dict.fromkeys(layout.stage_dps.tolist()))
    if np.any(np.asarray(layout.stage_dps) % s):
        raise ConfigError("--shard-degree", f"{s}, but the DP degree {dps} is not a multiple of it", "use a divisor of --dp")
    degrees = stage_shard_degrees(cluster, layout, training)
    if degrees.all():
        raise ConfigError("--shard-degree", f"{s}: a shard group's TP x N x CP ranks do not hold whole expert groups of "
                          f"EP {training.expert_parallel} x ETP {training.expert_tensor_parallel}",
                          "use a shard degree whose TP x N x CP is a multiple of EP x ETP")
    raise ConfigError("--shard-degree", f"{s}: a shard group would span communication domains",
                      "use a divisor of each domain's replicas in a DP group")


class ShardLinks:
    """:func:`shard_groups` of each layout of a search on ``cluster``, worked out once each."""

    def __init__(self, cluster: ClusterSpec, training: TrainingSpec):
        self.cluster, self.training = cluster, training
        self._by_layout: dict[int, tuple] = {}

    def of(self, layout) -> ShardGroups | None:
        """None unless :func:`shards_in_part`."""
        if not shards_in_part(self.training, layout):
            return None
        kept = self._by_layout.get(id(layout))
        if kept is None or kept[0] is not layout:  # the layout is kept too: its id is not reused meanwhile
            kept = self._by_layout[id(layout)] = (layout, shard_groups(self.cluster, layout, self.training))
        return kept[1]

    def state_shards(self, layout):
        """Ranks a stage's sharded model states spread over: its DP x CP group, or a shard group's."""
        shards = self.of(layout)
        if shards is None:
            return layout.dp_cp
        return shards.ranks[0] if (shards.ranks == shards.ranks[0]).all() else shards.ranks


def shard_groups(cluster: ClusterSpec, layout, training: TrainingSpec) -> ShardGroups:
    """The shard and replica groups of each stage of ``layout``: a DP (x CP) group is every tp-th
    rank of the stage, replica after replica (layouts.make_layout); a shard group is the stage's
    shard degree of consecutive replicas of it, a replica group the ranks at one position in each."""
    degrees = stage_shard_degrees(cluster, layout, training)
    domain = cluster.rank_domains()
    columns = {key: [] for key in ("ranks", "gbps", "nodes", "replicas", "replica_gbps", "replica_nodes")}
    bridged = {}
    for stage, (stage_ranks, tp, degree) in enumerate(zip(layout.stage_ranks, layout.stage_tp, degrees)):
        size = max(int(degree), 1) * layout.cp
        groups = [stage_ranks[j::int(tp)] for j in range(int(tp))]
        shards = [g[k:k + size] for g in groups for k in range(0, len(g), size)]
        copies = [g[k::size] for g in groups for k in range(size)]
        crossing = group_crossing(cluster, stage, copies, domain) if cluster.crosses_domains else None
        if crossing is not None:
            bridged[stage] = crossing
        columns["ranks"].append(size)
        columns["replicas"].append(1 if crossing else len(copies[0]))
        for group_list, links, spans in ((shards, "gbps", "nodes"), (copies, "replica_gbps", "replica_nodes")):
            columns[links].append(min(cluster.group_gbps(g) for g in group_list) * cluster.link_efficiency)
            columns[spans].append(max(cluster.nodes_spanned(g) for g in group_list))
    return ShardGroups(*(np.asarray(v, dtype=np.float64) for v in columns.values()), bridged)


def bridged_syncs(bridges, layout, shards: ShardGroups | None, sync: np.ndarray, stage_params, training: TrainingSpec,
                  trained) -> np.ndarray:
    """``sync`` (C, P), each stage whose DP groups span communication domains synced over the bridge
    (``bridges``: planning/bridge.py's pricing): its gradients all-reduced whole, hierarchically; or,
    sharded within its domains, its shard groups' collectives (in ``sync`` already) and each rank's
    reduced shard all-reduced with its replicas, once a step."""
    for group in layout.group_crossings:
        replicas: GroupCrossing | None = shards.bridged.get(group.stage) if shards is not None else None
        params = stage_params[:, group.stage]
        if replicas is None:
            sync[:, group.stage] = bridges.group_sync_time(group, sync_allreduce_bytes(params, training, trained))
        else:
            shard = params * trained.share * reduced_gradient_bytes(training) / shards.ranks[group.stage]
            sync[:, group.stage] = sync[:, group.stage] + bridges.group_sync_time(replicas, shard)
    return sync
