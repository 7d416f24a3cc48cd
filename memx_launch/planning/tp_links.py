"""The link a tensor-parallel group of one device type talks over: the bandwidth it reaches and
whether it goes through the host. Profile records carry it, so that a learned ratio is taken
against the analytical base of the cluster the record ran on."""

from __future__ import annotations

from typing import NamedTuple

from memx_launch.specs.cluster import ClusterSpec


class TpLink(NamedTuple):
    gbps: float
    """Bandwidth the group reaches, before link_efficiency (through the host on a PCIe node)."""
    over_pcie: bool
    """The group's ranks talk over PCIe through the host."""


def tp_link(cluster: ClusterSpec, device_type: str, tp: int = 2) -> TpLink:
    """The link of a TP group of ``tp`` devices of ``device_type`` on ``cluster``."""
    return TpLink(tp_link_gbps(cluster, device_type, tp), tp_over_pcie(cluster, device_type, tp))


def record_fields(link: TpLink | None, tp: int) -> dict:
    """A profile record's link fields (Measurement.tp_link_gbps, .tp_over_pcie) for TP ``tp``:
    none at TP 1, where no TP traffic flows."""
    return {"tp_link_gbps": link.gbps, "tp_over_pcie": link.over_pcie} if tp > 1 and link else {}


def tp_link_gbps(cluster: ClusterSpec, device_type: str, tp: int = 2) -> float:
    """Slowest link inside a TP group of ``tp`` consecutive devices of one type, in the node
    holding the most of them: TP 4 inside a NUMA domain runs at its link, TP 8 across two
    domains at the cross-NUMA link. A node with fewer such devices (a profile of one device)
    gives its intra-node link (through the host on a PCIe node)."""
    node, ranks = _tp_group(cluster, device_type, tp)
    if node is None:
        return cluster.inter_node_gbps
    if ranks is None:
        return node.peer_gbps(node.intra_node_gbps, cluster.datasheet_links)
    return cluster.group_gbps(ranks)


def tp_over_pcie(cluster: ClusterSpec, device_type: str, tp: int = 2) -> bool:
    """Whether a TP group of ``tp`` devices of one type talks over PCIe through the host."""
    node, _ = _tp_group(cluster, device_type, tp)
    return node is not None and node.over_pcie


def _tp_group(cluster: ClusterSpec, device_type: str, tp: int):
    """(node, ranks) of a TP group of ``tp`` consecutive devices of one type in the node holding
    the most of them; ranks None where that node has fewer (or tp < 2); node None: no such type."""
    best_node, best_count, best_start = None, 0, 0
    start = 0
    for node in cluster.nodes:
        count = sum(n for t, n in node.devices if t == device_type)
        if count > best_count:
            best_node, best_count, best_start = node, count, start
        start += node.num_devices
    if best_node is None or best_count < tp or tp < 2:
        return best_node, None
    types = cluster.rank_device_types()
    return best_node, [r for r in range(best_start, best_start + best_node.num_devices)
                       if types[r] == device_type][:tp]
