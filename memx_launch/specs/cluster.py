"""What it runs on: DeviceType, Node, Emulation and ClusterSpec, read from a cluster YAML file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any


from memx_launch.errors import ConfigError
from memx_launch.specs.checks import reject_unknown, require_name, require_number, require_positive, require_type
from memx_launch.specs.inputs import load_yaml


CLUSTER_FILE_VERSION = 1
MAX_DEVICES_PER_NODE = 4096
MAX_DEVICES = 2**20
"""Bounds on the device counts a cluster file may declare (memx keeps a table per rank)."""


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator. ``efficiency`` is the measured share of peak reached in training."""

    name: str
    vendor: str
    memory_gib: float
    peak_tflops: float
    efficiency: float | None = None
    memory_bandwidth_gbps: float | None = None
    """HBM bandwidth in GB/s; bounds element-wise work in the analytical time model."""
    flash_attention: bool = True
    """Fused attention kernel available (no s^2 activation term)."""

    def __post_init__(self):
        where = f"device_types.{self.name}"
        for attr in ("memory_gib", "peak_tflops"):
            require_positive(getattr(self, attr), f"{where}.{attr}", "give the device's real capacity")
        if self.efficiency is not None:
            require_number(self.efficiency, f"{where}.efficiency", lo=0, hi=1, lo_open=True,
                           fix="give achieved/peak TFLOPS, e.g. 0.45")
        if self.memory_bandwidth_gbps is not None:
            require_positive(self.memory_bandwidth_gbps, f"{where}.memory_bandwidth_gbps",
                             "give the HBM bandwidth in GB/s, e.g. 2039")
        require_type(self.flash_attention, bool, f"{where}.flash_attention", "true or false")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def effective_tflops(self) -> float:
        return self.peak_tflops * (self.efficiency if self.efficiency is not None else DEFAULT_EFFICIENCY)


DEFAULT_EFFICIENCY = 0.45


@dataclass(frozen=True)
class Node:
    name: str
    devices: tuple[tuple[str, int], ...]
    """(device type, count) in rank order."""
    intra_node_gbps: float
    numa_domains: int = 1
    cross_numa_gbps: float | None = None

    @property
    def num_devices(self) -> int:
        return sum(n for _, n in self.devices)


@dataclass(frozen=True)
class Emulation:
    """CPU stand-ins for devices: each device type's memory is enforced by a guard and its
    compute slowed by ``slowdown`` (>= 1)."""

    slowdown: tuple[tuple[str, float], ...]

    def slowdown_of(self, device_type: str) -> float:
        return dict(self.slowdown).get(device_type, 1.0)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device_types: tuple[DeviceType, ...]
    nodes: tuple[Node, ...]
    inter_node_gbps: float
    emulation: Emulation | None = None

    def __post_init__(self):
        # Rank tables, computed once: the search asks for links between thousands of ranks.
        types, locations = [], []
        for ni, node in enumerate(self.nodes):
            per_domain = math.ceil(node.num_devices / node.numa_domains)
            types += [t for t, count in node.devices for _ in range(count)]
            locations += [(ni, i // per_domain) for i in range(node.num_devices)]
        object.__setattr__(self, "_rank_types", tuple(types))
        object.__setattr__(self, "_rank_locations", tuple(locations))

    # ---- derived views
    def device_type(self, name: str) -> DeviceType:
        for d in self.device_types:
            if d.name == name:
                return d
        raise KeyError(name)

    @property
    def world_size(self) -> int:
        return sum(n.num_devices for n in self.nodes)

    def rank_device_types(self) -> list[str]:
        """Device type of each global rank: nodes in order, types in listed order."""
        return list(self._rank_types)

    def rank_locations(self) -> tuple[tuple[int, int], ...]:
        """(node index, NUMA domain) of each global rank."""
        return self._rank_locations

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {d.name: 0 for d in self.device_types}
        for t in self.rank_device_types():
            counts[t] += 1
        return {k: v for k, v in counts.items() if v}

    def link_gbps(self, rank_a: int, rank_b: int) -> float:
        """Bandwidth of the slowest link between two ranks (GB/s)."""
        if rank_a == rank_b:
            return math.inf
        (na, da), (nb, db) = self._rank_locations[rank_a], self._rank_locations[rank_b]
        if na != nb:
            return self.inter_node_gbps
        node = self.nodes[na]
        if da != db and node.cross_numa_gbps:
            return node.cross_numa_gbps
        return node.intra_node_gbps

    def group_gbps(self, ranks: list[int]) -> float:
        """Bandwidth a collective over ``ranks`` is limited by (slowest pairwise link)."""
        if len(ranks) < 2:
            return math.inf
        return min(self.link_gbps(a, b) for a, b in zip(ranks, ranks[1:] + ranks[:1]) if a != b)

    @property
    def is_emulated(self) -> bool:
        return self.emulation is not None

    def heterogeneity_index(self) -> float:
        """Coefficient of variation of per-device effective compute."""
        values = [self.device_type(t).effective_tflops for t in self.rank_device_types()]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        return math.sqrt(var) / mean

    def signature(self) -> str:
        payload = json.dumps([asdict(d) for d in self.device_types], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # ---- loading
    @classmethod
    def from_yaml(cls, path: str) -> "ClusterSpec":
        data = load_yaml(path, "--cluster", fix="pass a cluster YAML file (see examples/clusters/)")
        default_name = os.path.splitext(os.path.basename(path))[0]
        return cls.from_dict(data, default_name=default_name)

    @classmethod
    def from_dict(cls, data: Any, default_name: str = "cluster") -> "ClusterSpec":
        if not isinstance(data, dict):
            raise ConfigError("cluster", "the file must be a mapping with version, device_types, nodes",
                              "see examples/clusters/paper-20gpu.yaml")
        reject_unknown(data, {"version", "name", "device_types", "nodes", "inter_node_gbps",
                               "emulation"}, "cluster")
        version = data.get("version")
        if version != CLUSTER_FILE_VERSION:
            raise ConfigError("cluster.version", f"expected {CLUSTER_FILE_VERSION}, got {version!r}",
                              f"add 'version: {CLUSTER_FILE_VERSION}' at the top")
        raw_types = data.get("device_types")
        if not isinstance(raw_types, dict) or not raw_types:
            raise ConfigError("cluster.device_types", "missing or empty",
                              "map each device type name to its memory_gib and peak_tflops")
        types = []
        allowed = {"vendor", "memory_gib", "peak_tflops", "efficiency", "memory_bandwidth_gbps",
                   "flash_attention"}
        for tname, spec in raw_types.items():
            require_type(tname, str, f"cluster.device_types.{tname}", "name device types with text")
            require_name(tname, f"cluster.device_types.{tname}")
            if not isinstance(spec, dict):
                raise ConfigError(f"cluster.device_types.{tname}", "must be a mapping")
            reject_unknown(spec, allowed, f"cluster.device_types.{tname}")
            for req in ("memory_gib", "peak_tflops"):
                if req not in spec:
                    raise ConfigError(f"cluster.device_types.{tname}.{req}", "missing",
                                      f"add {req}: <number>")
            require_name(spec.get("vendor", "unknown"), f"cluster.device_types.{tname}.vendor")
            types.append(DeviceType(name=str(tname), vendor=str(spec.get("vendor", "unknown")),
                                    **{k: v for k, v in spec.items() if k != "vendor"}))
        known = {t.name for t in types}
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise ConfigError("cluster.nodes", "missing or empty", "list the nodes with their devices")
        nodes = []
        for i, raw in enumerate(raw_nodes):
            where = f"cluster.nodes[{i}]"
            if not isinstance(raw, dict):
                raise ConfigError(where, "must be a mapping")
            reject_unknown(raw, {"name", "devices", "intra_node_gbps", "numa_domains",
                                  "cross_numa_gbps"}, where)
            devices = raw.get("devices")
            if not isinstance(devices, dict) or not devices:
                raise ConfigError(f"{where}.devices", "missing or empty", "e.g. devices: {a100: 8}")
            for tname, count in devices.items():
                if tname not in known:
                    raise ConfigError(f"{where}.devices.{tname}", "unknown device type",
                                      f"declare it under device_types (known: {', '.join(sorted(known))})")
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
            nodes.append(Node(str(raw.get("name", f"node{i}")), tuple(devices.items()),
                              float(intra), numa, None if cross is None else float(cross)))
        total = sum(n.num_devices for n in nodes)
        if total > MAX_DEVICES:
            raise ConfigError("cluster.nodes", f"{total} devices, over the limit of {MAX_DEVICES}",
                              "describe the cluster memx should plan for")
        inter = data.get("inter_node_gbps")
        if len(nodes) > 1 or inter is not None:
            require_positive(inter, "cluster.inter_node_gbps")
        emulation = None
        if data.get("emulation") is not None:
            raw = data["emulation"]
            if not isinstance(raw, dict):
                raise ConfigError("cluster.emulation", "must be a mapping with slowdown")
            reject_unknown(raw, {"slowdown"}, "cluster.emulation")
            slow = raw.get("slowdown") or {}
            if not isinstance(slow, dict):
                raise ConfigError("cluster.emulation.slowdown", "must be a mapping of device type to factor",
                                  "e.g. slowdown: {fast-small: 1.0, slow-big: 3.0}")
            for tname, factor in slow.items():
                if tname not in known:
                    raise ConfigError(f"cluster.emulation.slowdown.{tname}", "unknown device type")
                require_positive(factor, f"cluster.emulation.slowdown.{tname}")
                if factor < 1:
                    raise ConfigError(f"cluster.emulation.slowdown.{tname}", f"{factor} < 1",
                                      "a slowdown is 1 or more (1 = CPU speed)")
            emulation = Emulation(tuple((k, float(v)) for k, v in slow.items()))
        require_name(data.get("name", default_name), "cluster.name")
        return cls(str(data.get("name", default_name)), tuple(types), tuple(nodes),
                   float(inter) if inter is not None else math.inf, emulation)
