"""One machine of a cluster: its devices, the links between them and its network interfaces."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import reject_unknown, require_name, require_number, require_positive

MAX_DEVICES_PER_NODE = 4096
# Nodes given with a count are expanded: a bound keeps a typo (count: 10000000) from filling memory.
MAX_DEVICES = 1_000_000
"""Bounds on the device counts a cluster file may declare (memx keeps a table per rank)."""

# A PCIe 5.0 x16 link per direction; every NVLink generation gives a GPU more (V100 150, A100
# 300, H100 450 GB/s).
PCIE_MAX_GBPS = 64.0
GPU_LINKS = ("direct", "pcie")
# Bus bandwidth of NCCL collectives among PCIe GPUs without a direct path (peer-to-peer off, as
# on cloud VMs, or through the CPU): each chunk is staged in host memory, through the CPU's root
# complex and memory, and reaches about half the link: 28 and 35 GB/s all-reduce bus bandwidth on
# 8 and 4 PCIe 5.0 GPUs (64 GB/s links; github.com/NVIDIA/nccl/issues/1639, "determined by the
# bandwidth your CPU and memory can deliver"); NCCL's topology takes a PCIe 3.0 x16 path at 12 of
# its 16 GB/s and a CPU-to-CPU hop at 6-10 GB/s (src/graph/topo.h). As a share of the link
# before link_efficiency (0.8, NVLink's): 0.5 / 0.8.
PCIE_STAGED_SHARE = 0.5 / 0.8

@dataclass(frozen=True)
class Node:
    name: str
    devices: tuple[tuple[str, int], ...]
    """(device type, count) in rank order."""
    intra_node_gbps: float
    numa_domains: int = 1
    cross_numa_gbps: float | None = None
    host: str | None = None
    """Address the other nodes reach this one at (the rendezvous master when it is the first)."""
    nics: int | None = None
    """Network interfaces (rails) of ``inter_node_gbps`` each that the node's devices share;
    None: one per device, as on DGX/HGX nodes."""
    gpu_link: str | None = None
    """How the node's devices reach each other: ``direct`` (NVLink, xGMI, HCCS: device to device)
    or ``pcie`` (through the host: PCIe GPUs such as A10G, T4, L4). None: ``pcie`` where
    ``intra_node_gbps`` is at most :data:`PCIE_MAX_GBPS`, else ``direct``."""

    @functools.cached_property
    def num_devices(self) -> int:  # cached: layouts of large clusters ask it for every group
        return sum(n for _, n in self.devices)

    @property
    def over_pcie(self) -> bool:
        """The devices talk over PCIe through the host (:attr:`gpu_link`)."""
        if self.gpu_link is not None:
            return self.gpu_link == "pcie"
        return self.intra_node_gbps <= PCIE_MAX_GBPS

    @property
    def rails(self) -> int:
        """NICs between this node and the others (one per device unless ``nics`` says)."""
        return self.nics or self.num_devices

    def uplink_gbps(self, inter_node_gbps: float, members: int, staged: bool = True) -> float:
        """Inter-node bandwidth of a collective group with ``members`` devices on this node. NCCL
        runs a ring per rail, so the group leaves the node over its members' share of the NICs
        (every group of a layout communicates at once), and its members forward the ring's
        traffic over the node's own links."""
        rails = members * self.rails / self.num_devices
        inside = self.peer_gbps(self.intra_node_gbps, staged) if members > 1 else math.inf
        return min(inter_node_gbps * rails, inside)

    def peer_gbps(self, link_gbps: float, staged: bool = True) -> float:
        """What traffic between this node's devices gets of a link of theirs: all of it over
        NVLink; :data:`PCIE_STAGED_SHARE` of it through the host, where ``staged`` (the figure
        is a datasheet link, not a measured bus bandwidth)."""
        return link_gbps * PCIE_STAGED_SHARE if staged and self.over_pcie else link_gbps


def nodes_from(raw_nodes, known_types: set[str]) -> list[Node]:
    """The nodes of a cluster file's ``nodes`` list, each ``count`` expanded, every field checked
    (``known_types``: the file's device types)."""
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError("cluster.nodes", "missing or empty", "list the nodes with their devices")
    nodes, devices_in_file = [], 0
    for i, raw in enumerate(raw_nodes):
        where = f"cluster.nodes[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(where, "must be a mapping")
        reject_unknown(raw, {"name", "devices", "intra_node_gbps", "numa_domains",
                             "cross_numa_gbps", "host", "count", "nics", "gpu_link"}, where)
        devices = raw.get("devices")
        if not isinstance(devices, dict) or not devices:
            raise ConfigError(f"{where}.devices", "missing or empty", "e.g. devices: {a100: 8}")
        for tname, count in devices.items():
            if tname not in known_types:
                raise ConfigError(f"{where}.devices.{tname}", "unknown device type",
                                  f"declare it under device_types (known: {', '.join(sorted(known_types))})")
            require_number(count, f"{where}.devices.{tname}", lo=0, lo_open=True, hi=MAX_DEVICES_PER_NODE,
                           integer=True, fix="the number of such devices in this node")
        intra = raw.get("intra_node_gbps")
        require_positive(intra, f"{where}.intra_node_gbps")
        numa = raw.get("numa_domains", 1)
        require_number(numa, f"{where}.numa_domains", lo=0, lo_open=True, hi=MAX_DEVICES_PER_NODE, integer=True)
        require_name(raw.get("name", f"node{i}"), f"{where}.name")
        cross = raw.get("cross_numa_gbps")
        if cross is not None:
            require_positive(cross, f"{where}.cross_numa_gbps")
        nics = raw.get("nics")
        if nics is not None:
            require_number(nics, f"{where}.nics", lo=0, lo_open=True, hi=MAX_DEVICES_PER_NODE, integer=True,
                           fix="the number of network interfaces the node's devices share")
        gpu_link = raw.get("gpu_link")
        if gpu_link is not None and gpu_link not in GPU_LINKS:
            raise ConfigError(f"{where}.gpu_link", f"unknown link {gpu_link!r}",
                              "direct (NVLink, xGMI, HCCS) or pcie (through the host)")
        count = raw.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise ConfigError(f"{where}.count", f"must be a positive integer, got {count!r}",
                              "the number of identical nodes this entry stands for")
        host = raw.get("host")
        if host is not None:
            require_name(host, f"{where}.host")
        if host is not None and (not isinstance(host, str) or count > 1):
            raise ConfigError(f"{where}.host", "must be one address, on an entry without count",
                              "list nodes with their own host one by one")
        devices_in_file += count * sum(devices.values())
        if devices_in_file > MAX_DEVICES:
            raise ConfigError(f"{where}.count", f"the file declares more than {MAX_DEVICES:,} devices",
                              "split the job, or check the counts")
        name = str(raw.get("name", f"node{i}"))
        nodes += [Node(name if count == 1 else f"{name}-{k}", tuple(devices.items()), float(intra), numa,
                       None if cross is None else float(cross), host, nics, gpu_link) for k in range(count)]
    return nodes
