"""What it runs on: DeviceType, Node, Emulation and ClusterSpec, read from a cluster YAML file.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from memx_launch.errors import ConfigError
from memx_launch.specs.bridge import DOMAIN_BY_VENDOR, Bridge, bridge_from
from memx_launch.specs.efficiency import (FP32_MATMUL_SHARE, IDLE_POWER_SHARE, default_efficiency,
                                          power_limited_clock_share)
from memx_launch.specs.checks import reject_unknown, require_name, require_number, require_positive, require_type
from memx_launch.specs.inputs import load_yaml
from memx_launch.specs.node import Node, nodes_from

CLUSTER_FILE_VERSION = 1


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator. ``efficiency`` is the measured share of peak reached in training."""

    name: str
    vendor: str
    memory_gib: float
    peak_tflops: float
    efficiency: float | None = None
    memory_bandwidth_gbps: float | None = None
    """The datasheet HBM bandwidth in GB/s: the analytical time model moves memory-bound work at the
    vendor's sustained share of it (:func:`~memx_launch.planning.peaks.hbm_gbps`)."""
    flash_attention: bool = True
    """Fused attention kernel available (no s^2 activation term)."""
    peak_tflops_fp32: float | None = None
    """Dense fp32 matmul peak on CUDA cores, for fp32 training (``peak_tflops`` serves every dtype
    without it); with TF32 on, :func:`~memx_launch.planning.peaks.training_tflops` decides."""
    peak_tflops_fp8: float | None = None
    """Dense FP8 matmul peak, for ``--fp8`` training. Unset: twice ``peak_tflops`` on NVIDIA
    compute capability 8.9 and later (Ada, Hopper, Blackwell), none elsewhere
    (:func:`~memx_launch.planning.peaks.fp8_peak_tflops`)."""
    peak_tflops_fp4: float | None = None
    """Dense FP4 matmul peak, for ``--fp4`` training. Unset: four times ``peak_tflops`` on NVIDIA
    Blackwell, six on Blackwell Ultra (compute capability 10.3), none elsewhere
    (:func:`~memx_launch.planning.peaks.fp4_peak_tflops`)."""
    compute_capability: float | None = None
    """NVIDIA compute capability (8.0 A100, 8.9 L4, 9.0 H100/H200/GH200): on 9.0 and later the
    fused attention kernels written for Ampere (FlashAttention 1 and 2) reach a smaller share
    of the peak (:func:`~memx_launch.planning.costmodel.fused_attention_speed`). Unset: taken
    as Ampere."""
    memory_overhead_gib: float | None = None
    """Memory a training process holds above its tensors: CUDA context and the caching
    allocator's reserve over allocated. Unset: the vendor's default
    (:data:`DEFAULT_MEMORY_OVERHEAD_GIB`). The buffers of the plan's communicators come on top
    (:attr:`communicator_bytes` each)."""
    sm_count: int | None = None
    """Streaming multiprocessors (NVIDIA) or compute units (AMD): the waves a matmul's tiles run
    in. Unset: by compute capability (:data:`~memx_launch.planning.matmuls.SMS_BY_COMPUTE_CAPABILITY`)."""
    domain: str | None = None
    """Communication domain: the collective library this type's ranks share. Ranks of one domain
    form native groups (NCCL among NVIDIA GPUs); traffic between domains takes the bridge.
    Unset: the vendor's (:data:`DOMAIN_BY_VENDOR`)."""
    host_ms_per_layer: float | None = None
    """Host time the training framework takes on this type's nodes to issue one layer's forward
    and backward: no layer runs faster (the device runs behind the host). Calibration measures
    it for memx's runtime (:func:`~memx_launch.profiling.calibrated_parts.one_descriptor_set`);
    ``--host-ms-per-layer`` overrides it for every type. Unset: a fused block's launches."""
    host_link_gbps: float | None = None
    """Bandwidth of a device<->host copy in GB/s, per direction and device, as the offloads use it
    (``--activation-offload-layers``, ``--optimizer-offload``): about 25 on PCIe Gen4 x16, 50 on
    Gen5, far more over NVLink-C2C to a Grace CPU. Unset: :data:`~memx_launch.specs.bridge.HOST_COPY_GBPS`."""

    power_limit_w: float | None = None
    """The board power limit the type's GPUs run under (``nvidia-smi -q -d POWER``), with
    ``rated_power_w``, the board's rated power (TDP) that the default ``efficiency`` assumes: below
    it the default is scaled by the clock the limit leaves
    (:func:`~memx_launch.specs.efficiency.power_limited_clock_share`). A given ``efficiency`` is
    taken as measured under the limit."""
    rated_power_w: float | None = None

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
        if self.peak_tflops_fp32 is not None:
            require_positive(self.peak_tflops_fp32, f"{where}.peak_tflops_fp32", "give the fp32/TF32 peak")
        if self.peak_tflops_fp8 is not None:
            require_positive(self.peak_tflops_fp8, f"{where}.peak_tflops_fp8", "give the dense FP8 peak")
        if self.peak_tflops_fp4 is not None:
            require_positive(self.peak_tflops_fp4, f"{where}.peak_tflops_fp4", "give the dense FP4 peak")
        if self.compute_capability is not None:
            require_number(self.compute_capability, f"{where}.compute_capability", lo=0, lo_open=True, hi=100,
                           fix="give major.minor, e.g. 9.0 for H100")
        if self.memory_overhead_gib is not None:
            require_number(self.memory_overhead_gib, f"{where}.memory_overhead_gib", lo=0, hi=self.memory_gib,
                           fix="give reserved minus allocated memory in GiB")
        if self.domain is not None:
            require_name(self.domain, f"{where}.domain")
        if self.host_ms_per_layer is not None:
            require_number(self.host_ms_per_layer, f"{where}.host_ms_per_layer", lo=0, lo_open=True, hi=1000.0,
                           fix="give the milliseconds one layer's forward and backward take to issue, e.g. 3")
        if self.host_link_gbps is not None:
            require_positive(self.host_link_gbps, f"{where}.host_link_gbps",
                             "give the device<->host copy bandwidth in GB/s per direction, e.g. 50 for PCIe Gen5")
        if (self.power_limit_w is None) != (self.rated_power_w is None):
            raise ConfigError(f"{where}.power_limit_w", "needs rated_power_w beside it, and rated_power_w needs it",
                              "give both, e.g. power_limit_w: 500 and rated_power_w: 700 for a capped H100 SXM")
        if self.rated_power_w is not None:
            require_positive(self.rated_power_w, f"{where}.rated_power_w", "give the board's rated power (TDP) in W")
            require_number(self.power_limit_w, f"{where}.power_limit_w", lo=IDLE_POWER_SHARE * self.rated_power_w,
                           lo_open=True, hi=self.rated_power_w,
                           fix="give the enforced board power limit in W, at most rated_power_w")
        if self.sm_count is not None:
            require_number(self.sm_count, f"{where}.sm_count", lo=0, lo_open=True, hi=100000, integer=True,
                           fix="give the device's streaming multiprocessors, e.g. 132 for H100 SXM")

    @property
    def communication_domain(self) -> str:
        """The collective library this type's ranks share: ``domain``, else the vendor's; a vendor
        memx knows no library of is a domain of its own."""
        return self.domain or DOMAIN_BY_VENDOR.get(self.vendor, f"{self.vendor}-native")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def effective_tflops(self) -> float:
        """Sustained 16-bit matmul TFLOPS: ``efficiency`` (or :func:`default_efficiency` at the
        clock the power limit leaves) x peak."""
        if self.efficiency is not None:
            return self.peak_tflops * self.efficiency
        return self.peak_tflops * default_efficiency(self.vendor, self.compute_capability) * self.clock_share

    def effective_tflops_for(self, dtype: str) -> float:
        """Sustained TFLOPS for training in ``dtype``: the fp32 peak for fp32 when given, at the
        type's efficiency or FP32_MATMUL_SHARE (CUDA-core GEMMs; the 16-bit shares are tensor cores')."""
        if dtype == "fp32" and self.peak_tflops_fp32 is not None:
            return self.peak_tflops_fp32 * (self.efficiency if self.efficiency is not None
                                            else FP32_MATMUL_SHARE * self.clock_share)
        return self.effective_tflops

    @property
    def clock_share(self) -> float:
        """The clock compute-bound work keeps under ``power_limit_w`` (1 without one)."""
        if self.power_limit_w is None:
            return 1.0
        return power_limited_clock_share(self.power_limit_w, self.rated_power_w)

    @property
    def overhead_bytes(self) -> float:
        gib = self.memory_overhead_gib
        if gib is None:
            gib = DEFAULT_MEMORY_OVERHEAD_GIB.get(self.vendor, DEFAULT_MEMORY_OVERHEAD_GIB["unknown"])
        return gib * 2**30

    @property
    def communicator_bytes(self) -> float:
        """GPU memory one NCCL/RCCL communicator holds on this device (:data:`COMMUNICATOR_GIB`)."""
        return COMMUNICATOR_GIB.get(self.vendor, 0.0) * 2**30


# Unmeasured memory above the tensors, per vendor. NVIDIA/AMD: the CUDA/HIP context with the
# BLAS and attention-kernel modules loaded (outside the caching allocator) and the allocator's
# reserve over allocated (partly used 2 MiB / 20 MiB blocks). CPU emulation: a guard counts the
# tensors only. A measured value in the cluster YAML (memory_overhead_gib) replaces these.
CONTEXT_GIB, ALLOCATOR_RESERVE_GIB = 0.75, 0.5
DEFAULT_MEMORY_OVERHEAD_GIB = {"nvidia": CONTEXT_GIB + ALLOCATOR_RESERVE_GIB, "amd": CONTEXT_GIB + ALLOCATOR_RESERVE_GIB,
                               "cpu": 0.0, "unknown": 0.0}

# Buffers one communicator holds per GPU at NCCL's default sizes: 544-688 MB measured per
# process group on 4 x A100 over NVLink (github.com/NVIDIA/nccl/issues/964); every communicator
# a rank joins holds its own (nccl#864, #986; which ones: costmodel.communicators_per_rank).
# RCCL is built alike.
COMMUNICATOR_GIB = {"nvidia": 0.6, "amd": 0.6}
# Those buffers are per channel: "the memory usage is linearly tied to the number of channels"
# (NCCL's maintainer, github.com/NVIDIA/nccl/issues/986, who names PCIe as needing less than
# NVLink). NCCL runs 24 channels over NVLink and NVSwitch boards (its logs' "Channel 00/24" on
# A100 and H100 nodes), 2 among GPUs that reach each other through the host ("Channel 00/02").
DIRECT_LINK_CHANNELS, PCIE_CHANNELS = 24, 2

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
    master_addr: str | None = None
    """Where torchrun's rendezvous runs; default: the first node's host."""
    link_efficiency: float = 0.8
    """Share of the links' stated bandwidth collectives and transfers reach. The default takes
    the figures as datasheet numbers: NCCL's all-reduce bus bandwidth reaches about 230 of
    NVLink 3's 300 GB/s on DGX A100 nodes and 90% of an InfiniBand NIC's line rate (nccl-tests);
    a detected cluster states the measured bus bandwidth and 1.0."""
    bridge: Bridge = Bridge()
    """Traffic between communication domains (:attr:`crosses_domains`)."""

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
        return len(self._rank_types)

    def master_address(self) -> str | None:
        """The rendezvous address: ``master_addr``, else the first node's ``host`` (None: not given)."""
        return self.master_addr or self.nodes[0].host

    def communicator_bytes(self, device_type: str) -> float:
        """GPU memory one NCCL/RCCL communicator holds on a device of ``device_type``: its
        vendor's size (:attr:`DeviceType.communicator_bytes`, at :data:`DIRECT_LINK_CHANNELS`), or
        :data:`PCIE_CHANNELS` of those channels' worth where every node holding the type links its
        devices through the host (:attr:`Node.over_pcie`)."""
        nodes = [n for n in self.nodes if any(name == device_type for name, _ in n.devices)]
        share = PCIE_CHANNELS / DIRECT_LINK_CHANNELS if nodes and all(n.over_pcie for n in nodes) else 1.0
        return self.device_type(device_type).communicator_bytes * share

    def rank_device_types(self) -> list[str]:
        """Device type of each global rank: nodes in order, types in listed order."""
        return list(self._rank_types)

    def rank_locations(self) -> tuple[tuple[int, int], ...]:
        """(node index, NUMA domain) of each global rank."""
        return self._rank_locations

    def rank_domains(self) -> list[str]:
        """Communication domain of each global rank (DeviceType.communication_domain)."""
        domains = {d.name: d.communication_domain for d in self.device_types}
        return [domains[t] for t in self._rank_types]

    @property
    def crosses_domains(self) -> bool:
        """Whether the job's ranks use more than one collective library."""
        return len(set(self.rank_domains())) > 1

    def devices_per_node(self, device_type: str) -> list[int]:
        """Devices of ``device_type`` on each node that holds some."""
        return [n for node in self.nodes for t, n in node.devices if t == device_type]

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
        link = node.cross_numa_gbps if da != db and node.cross_numa_gbps else node.intra_node_gbps
        return node.peer_gbps(link, self.datasheet_links)

    @property
    def datasheet_links(self) -> bool:
        """Datasheet link figures (link_efficiency < 1), not measured bus bandwidths (1.0, detected)."""
        return self.link_efficiency < 1.0

    def intra_hop_over_pcie(self, ranks) -> bool:
        """Whether a group's ranks inside a node talk over PCIe through the host (any of its nodes)."""
        return any(self.nodes[n].over_pcie for n in {self._rank_locations[r][0] for r in ranks})

    def nodes_spanned(self, ranks) -> int:
        """Nodes a group's ranks sit on."""
        return len({self._rank_locations[r][0] for r in ranks})

    def transfers_gbps(self, pairs) -> float:
        """Bandwidth each of these concurrent point-to-point transfers gets (the slowest): inside
        a node its link; between nodes a NIC each while the node has as many as transfers leave
        or enter it, else they share its NICs."""
        crossing: dict[int, int] = {}  # transfers in or out of each node
        slowest = math.inf
        for a, b in pairs:
            na, nb = self._rank_locations[a][0], self._rank_locations[b][0]
            if na != nb:
                crossing[na], crossing[nb] = crossing.get(na, 0) + 1, crossing.get(nb, 0) + 1
            else:
                slowest = min(slowest, self.link_gbps(a, b))
        for n, k in crossing.items():
            slowest = min(slowest, self.inter_node_gbps * min(1.0, self.nodes[n].rails / k))
        return slowest

    def group_gbps(self, ranks: list[int]) -> float:
        """Bandwidth a collective over ``ranks`` is limited by: the slowest link inside a node,
        and between nodes each node's uplink for the group's members there
        (:meth:`Node.uplink_gbps`: one ring per rail, NCCL's multi-rail)."""
        if len(ranks) < 2:
            return math.inf
        node_of = {r: self._rank_locations[r][0] for r in ranks}
        inside = [self.link_gbps(a, b) for a, b in zip(ranks, ranks[1:] + ranks[:1])
                  if a != b and node_of[a] == node_of[b]]
        members = collections.Counter(node_of[r] for r in ranks)
        across = [self.nodes[n].uplink_gbps(self.inter_node_gbps, k, self.datasheet_links) for n, k in members.items()] \
            if len(members) > 1 else []
        return min(inside + across, default=math.inf)

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
                               "emulation", "master_addr", "link_efficiency", "bridge"}, "cluster")
        version = data.get("version")
        if version != CLUSTER_FILE_VERSION:
            raise ConfigError("cluster.version", f"expected {CLUSTER_FILE_VERSION}, got {version!r}",
                              f"add 'version: {CLUSTER_FILE_VERSION}' at the top")
        raw_types = data.get("device_types")
        if not isinstance(raw_types, dict) or not raw_types:
            raise ConfigError("cluster.device_types", "missing or empty",
                              "map each device type name to its memory_gib and peak_tflops")
        types = []
        allowed = {"vendor", "memory_gib", "peak_tflops", "efficiency", "memory_bandwidth_gbps", "flash_attention",
                   "peak_tflops_fp32", "peak_tflops_fp8", "peak_tflops_fp4", "memory_overhead_gib", "compute_capability",
                   "domain", "sm_count", "host_ms_per_layer", "host_link_gbps", "power_limit_w", "rated_power_w"}
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
        nodes = nodes_from(data.get("nodes"), known)
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
        master = data.get("master_addr")
        if master is not None:
            require_name(master, "cluster.master_addr")
        if master is not None and not (isinstance(master, str) and master):
            raise ConfigError("cluster.master_addr", f"must be a host name or address, got {master!r}",
                              "e.g. master_addr: node0.example.org")
        require_name(data.get("name", default_name), "cluster.name")
        link_efficiency = data.get("link_efficiency", cls.link_efficiency)
        require_number(link_efficiency, "cluster.link_efficiency", lo=0, hi=1, lo_open=True,
                       fix="the share of the stated link bandwidth collectives reach, e.g. 0.8 (1.0 if measured)")
        return cls(str(data.get("name", default_name)), tuple(types), tuple(nodes),
                   float(inter) if inter is not None else math.inf, emulation, master, float(link_efficiency),
                   bridge_from(data.get("bridge")))

