"""Pricing traffic between communication domains (the bridge). No torch import.

Ranks of one domain talk through their native library (NCCL among NVIDIA GPUs); NCCL and RCCL
cannot share a communicator, so what crosses goes over the bridge (``cluster.bridge``: gloo
over TCP by default), each message staged through pinned host memory:

- a pipeline edge between stages of different domains: every activation (and its gradient)
  pays device->host, the network and host->device, plus the bridge's per-message latency;
- a DP group whose replicas span D domains syncs hierarchically. Every domain k members:
  native reduce-scatter in each domain (k shards), a bridge ring all-reduce of each M/k shard
  among the D ranks holding it, native all-gather. Domains of different sizes: native
  all-reduce in each, the domains' first ranks all-reduce M over the bridge, native broadcast.
  A bridge all-reduce stages its buffer once each way and pays 2(D-1) messages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from memx_launch.planning import costmodel as cm
from memx_launch.planning.collectives import NVLINK, PCI
from memx_launch.specs.cluster import ClusterSpec


@dataclass(frozen=True)
class BridgeLink:
    """What a bridge transfer between some domains costs: seconds = latency_s + bytes / gbps
    over the network + two staging copies at host_copy_gbps."""

    gbps: float
    latency_s: float
    host_copy_gbps: float

    def transfer_time(self, nbytes) -> np.ndarray:
        """One message of ``nbytes``: staged out, sent, staged in."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        return self.latency_s + nbytes / (self.gbps * 1e9) + 2.0 * nbytes / (self.host_copy_gbps * 1e9)

    def allreduce_time(self, nbytes, members: int) -> np.ndarray:
        """Ring all-reduce of ``nbytes`` among ``members`` ranks of different domains."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        steps = 2 * (members - 1)
        return (2.0 * nbytes / (self.host_copy_gbps * 1e9) + steps * self.latency_s
                + steps / members * nbytes / (self.gbps * 1e9))


@dataclass(frozen=True)
class EdgeCrossing:
    """A pipeline edge whose transfers cross domains: stage ``stage`` to the next (the last
    stage's edge leads to stage 0: interleaving's wrap-around)."""

    stage: int
    domain_pairs: tuple[tuple[str, str], ...]
    link_gbps: float
    """The link the edge's concurrent transfers get, before link_efficiency."""


@dataclass(frozen=True)
class GroupCrossing:
    """A stage whose DP groups span domains."""

    stage: int
    domain_sizes: tuple[tuple[str, int], ...]
    """Members of each domain in one DP group (every DP group of a stage has the same)."""
    native_gbps: tuple[float, ...]
    """Per domain, the bandwidth of its members' native collective (the slowest DP group's)."""
    bridge_link_gbps: float
    """The link among the ranks that all-reduce over the bridge, before link_efficiency."""
    native_hop: tuple[int, ...] = ()
    """Per domain, the hop between its members inside a node (collectives.NVLINK or PCI); empty: NVLink."""

    @property
    def shards(self) -> int | None:
        """k when every domain has k members (the reduce-scatter path), else None."""
        sizes = {n for _, n in self.domain_sizes}
        return sizes.pop() if len(sizes) == 1 else None

    def bridge_bytes(self, allreduce_bytes) -> np.ndarray:
        """Bytes each bridge rank sends per sync: 2(D-1)/D of the buffer it all-reduces."""
        d = len(self.domain_sizes)
        return 2.0 * (d - 1) / d * np.asarray(allreduce_bytes, dtype=np.float64) / (self.shards or 1)


def pair(a: str, b: str) -> tuple[str, str]:
    """A pair of domains in one order, as bridge measurements key them."""
    return (a, b) if a <= b else (b, a)


def layout_crossings(cluster: ClusterSpec, stage_ranks, stage_tp) -> tuple[tuple[EdgeCrossing, ...],
                                                                             tuple[GroupCrossing, ...]]:
    """The pipeline edges (and the wrap-around edge) and the DP groups of a layout that cross
    communication domains; both empty on a cluster of one domain."""
    if not cluster.crosses_domains:
        return (), ()
    domain = cluster.rank_domains()
    edges = []
    for i, (cur, nxt) in enumerate(zip(stage_ranks, stage_ranks[1:] + stage_ranks[:1])):
        pairs = tuple(sorted({pair(domain[a], domain[b]) for a, b in zip(cur, nxt) if domain[a] != domain[b]}))
        if pairs and len(stage_ranks) > 1:
            edges.append(EdgeCrossing(i, pairs, cluster.transfers_gbps(zip(cur, nxt))))
    groups = [group_crossing(cluster, i, [ranks[j::int(tp)] for j in range(int(tp))], domain)
              for i, (ranks, tp) in enumerate(zip(stage_ranks, stage_tp))]
    return tuple(edges), tuple(g for g in groups if g is not None)


def group_crossing(cluster: ClusterSpec, stage: int, groups: list[list[int]], domain: list[str]) -> GroupCrossing | None:
    """The crossing of a stage's ``groups`` (its DP groups, one per TP rank; or hybrid sharding's
    replica groups), each with as many members in each domain; None where they stay in one."""
    members = {}
    for r in groups[0]:
        members.setdefault(domain[r], []).append(r)
    if len(members) < 2:
        return None
    # Per domain, its members in each of the groups.
    by_domain = [[[r for r in g if domain[r] == d] for g in groups] for d in members]
    native = tuple(min(cluster.group_gbps(g) for g in groups_of_d) for groups_of_d in by_domain)
    sizes = {len(m) for m in members.values()}
    # The bridge's rings: the ranks holding one shard (the j-th of each domain) when the
    # domains are of one size, else the domains' first ranks.
    shards = sizes.pop() if len(sizes) == 1 else 1
    rings = [[groups_of_d[g][j] for groups_of_d in by_domain] for g in range(len(groups)) for j in range(shards)]
    hops = tuple(PCI if any(cluster.intra_hop_over_pcie(g) for g in groups_of_d) else NVLINK
                 for groups_of_d in by_domain)
    return GroupCrossing(stage, tuple((d, len(m)) for d, m in members.items()), native,
                         min(cluster.group_gbps(ring) for ring in rings), hops)


def tied_crossing(cluster: ClusterSpec, stage_ranks) -> EdgeCrossing | None:
    """The first and the last stage's sum of tied-embedding gradients (rank j of one with rank j
    of the other) when it crosses domains; ``stage`` is the last stage."""
    if not cluster.crosses_domains or len(stage_ranks) < 2:
        return None
    domain = cluster.rank_domains()
    ends = list(zip(stage_ranks[0], stage_ranks[-1]))
    pairs = tuple(sorted({pair(domain[a], domain[b]) for a, b in ends if domain[a] != domain[b]}))
    return EdgeCrossing(len(stage_ranks) - 1, pairs, cluster.transfers_gbps(ends)) if pairs else None


class BridgePricing:
    """Bridge costs on one cluster: the cluster file's ``bridge`` settings, the measured
    (latency_s, gbps) of domain pairs where calibration measured them (``measured``, keyed by
    :func:`pair`). Links are kept once resolved: the search asks the same edges again."""

    def __init__(self, cluster: ClusterSpec, measured: dict | None = None):
        self.cluster = cluster
        self.measured = dict(measured or {})
        self._links: dict = {}

    def link(self, domain_pairs, link_gbps: float) -> BridgeLink:
        """The slowest bridge among ``domain_pairs`` over a link of ``link_gbps``."""
        key = (tuple(domain_pairs), link_gbps)
        if key not in self._links:
            cluster = self.cluster
            default = (cluster.bridge.latency_s, cluster.bridge.network_gbps(link_gbps, cluster.link_efficiency))
            each = [self.measured.get(p, default) for p in domain_pairs]
            self._links[key] = BridgeLink(gbps=min(g for _, g in each), latency_s=max(lat for lat, _ in each),
                                          host_copy_gbps=cluster.bridge.staging_gbps(cluster.is_emulated))
        return self._links[key]

    def edge_link(self, edge: EdgeCrossing) -> BridgeLink:
        return self.link(edge.domain_pairs, edge.link_gbps)

    def ends_sum_time(self, layout, nbytes: float) -> float:
        """The first and the last stage's all-reduce of ``nbytes`` (tied embeddings; Megatron's
        embedding group): over the bridge when they sit in different domains."""
        if not nbytes:
            return 0.0
        if layout.ends_crossing is not None:
            return float(self.edge_link(layout.ends_crossing).allreduce_time(nbytes, 2))
        return float(cm.allreduce_time(nbytes, 2, layout.ends_gbps * self.cluster.link_efficiency))

    def group_link(self, group: GroupCrossing) -> BridgeLink:
        domains = sorted(d for d, _ in group.domain_sizes)
        return self.link(tuple(pair(a, b) for a, b in itertools.combinations(domains, 2)), group.bridge_link_gbps)

    def group_sync_time(self, group: GroupCrossing, allreduce_bytes) -> np.ndarray:
        """Hierarchical gradient sync of an all-reduce of ``allreduce_bytes`` per rank."""
        eff = self.cluster.link_efficiency
        m = np.asarray(allreduce_bytes, dtype=np.float64)
        sizes = [n for _, n in group.domain_sizes]
        native = [g * eff for g in group.native_gbps]
        hops = group.native_hop or (NVLINK,) * len(sizes)
        bridge = self.group_link(group).allreduce_time
        k = group.shards
        if k is not None:  # reduce-scatter, bridge all-reduce of a shard, all-gather
            native_part = np.max([cm.collective_time(m, k, g, 1, hop) for g, hop in zip(native, hops)], axis=0)
            return 2.0 * native_part + bridge(m / k, len(sizes))
        inside = np.max([cm.allreduce_time(m, n, g, 1, hop) for n, g, hop in zip(sizes, native, hops)], axis=0)
        spread = np.max([cm.broadcast_time(m, n, g, 1, hop) for n, g, hop in zip(sizes, native, hops)], axis=0)
        return inside + bridge(m, len(sizes)) + spread
