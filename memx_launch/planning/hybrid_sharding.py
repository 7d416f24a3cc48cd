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
whole group, and more traffic in all, but the large gathers stay on the fast links. No torch import.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec


class ShardGroups(NamedTuple):
    """A layout's shard groups and replica groups, per stage (P,), as collectives.py prices a group."""
    ranks: np.ndarray
    """Ranks of a shard group: N x CP."""
    gbps: np.ndarray
    """The slowest link of the stage's shard groups (ClusterSpec.group_gbps, at the cluster's link_efficiency)."""
    nodes: np.ndarray
    """Most nodes one of them spans."""
    replicas: np.ndarray
    """Shard groups of a DP group: DP / N, the ranks each replica all-reduce spans."""
    replica_gbps: np.ndarray
    replica_nodes: np.ndarray


def state_shards(training: TrainingSpec, layout):
    """Ranks a stage's sharded model states spread over: its DP x CP group, or N x CP of it."""
    return layout.dp_cp if training.shard_degree is None else training.shard_degree * layout.cp


def divides(layout, training: TrainingSpec) -> bool:
    """Every stage's DP degree splits into whole shard groups, none across communication domains
    (its replicas all-reduce over the bridge: not priced; each sharded DP group in one domain is)."""
    s = training.shard_degree
    return s is None or (not (np.asarray(layout.stage_dps) % s).any() and not layout.group_crossings)


def sharded_layouts(layouts_of: list[list], trainings: list[TrainingSpec]) -> list[list]:
    """Each training's layouts that :func:`divides`; a one-line refusal where none is left."""
    kept = [[lay for lay in layouts if divides(lay, training)] for layouts, training in zip(layouts_of, trainings)]
    if any(layouts_of) and not any(kept):
        degrees = sorted({int(d) for layouts in layouts_of for lay in layouts for d in lay.stage_dps})
        raise ConfigError("--shard-degree", f"{trainings[0].shard_degree} divides none of the layouts' DP degrees "
                          f"({', '.join(map(str, degrees))}) within one communication domain",
                          "use a divisor of the DP degree, e.g. the ranks of a node")
    return kept


def check_layout(layout, training: TrainingSpec) -> None:
    """A one-line refusal where ``layout`` cannot be sharded ``training.shard_degree`` ranks at a time."""
    if divides(layout, training):
        return
    s = training.shard_degree
    if layout.group_crossings:
        raise ConfigError("--shard-degree", f"{s} with a DP group across communication domains, whose replicas "
                          "would all-reduce over the bridge (not priced)", "plan on one domain's devices, or drop it")
    dps = "|".join(str(int(d)) for d in dict.fromkeys(layout.stage_dps.tolist()))
    raise ConfigError("--shard-degree", f"{s}, but the DP degree {dps} is not a multiple of it", "use a divisor of --dp")


class ShardLinks:
    """:func:`shard_groups` of each layout of a search on ``cluster``, worked out once each."""

    def __init__(self, cluster: ClusterSpec, training: TrainingSpec):
        self.cluster, self.degree = cluster, training.shard_degree
        self._by_layout: dict[int, tuple] = {}

    def of(self, layout) -> ShardGroups | None:
        """None without ``shard_degree``."""
        if self.degree is None:
            return None
        kept = self._by_layout.get(id(layout))
        if kept is None or kept[0] is not layout:  # the layout is kept too: its id is not reused meanwhile
            kept = self._by_layout[id(layout)] = (layout, shard_groups(self.cluster, layout, self.degree))
        return kept[1]


def shard_groups(cluster: ClusterSpec, layout, degree: int) -> ShardGroups:
    """The shard and replica groups of each stage of ``layout``: a DP (x CP) group is every tp-th
    rank of the stage, replica after replica (layouts.make_layout); a shard group is ``degree``
    consecutive replicas of it, a replica group the ranks at one position in each shard group."""
    ranks, gbps, nodes, replicas, replica_gbps, replica_nodes = ([] for _ in range(6))
    for stage_ranks, tp, dp in zip(layout.stage_ranks, layout.stage_tp, layout.stage_dps):
        size = degree * layout.cp
        groups = [stage_ranks[j::int(tp)] for j in range(int(tp))]
        shards = [g[k:k + size] for g in groups for k in range(0, len(g), size)]
        copies = [g[k::size] for g in groups for k in range(size)]
        ranks.append(size)
        replicas.append(int(dp) // degree)
        for group_list, links, spans in ((shards, gbps, nodes), (copies, replica_gbps, replica_nodes)):
            links.append(min(cluster.group_gbps(g) for g in group_list) * cluster.link_efficiency)
            spans.append(max(cluster.nodes_spanned(g) for g in group_list))
    return ShardGroups(*(np.asarray(x, dtype=np.float64) for x in (ranks, gbps, nodes, replicas, replica_gbps,
                                                                   replica_nodes)))
