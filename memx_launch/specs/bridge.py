"""Communication domains and the bridge between them (the cluster file's ``bridge:``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import reject_unknown, require_number, require_type


# The collective library each vendor's torch build brings. Libraries of different vendors cannot
# join one communicator (ROCm's torch calls RCCL "nccl" too), so each is a domain of its own.
DOMAIN_BY_VENDOR = {"nvidia": "nccl", "amd": "rccl", "intel": "xccl", "ascend": "hccl", "cpu": "gloo"}


# What the bridge between communication domains reaches where the cluster file does not say.
# gloo over TCP moves about 1.1 GB/s per process pair: a 20 MB ring all-reduce of two processes
# on 40 GbE, one core each, averaged 1.07 GB/s, a fifth of the line rate
# (github.com/pytorch/gloo/issues/248); NCCL's own socket transport reaches 60% of a 32 Gb/s
# wire (github.com/NVIDIA/nccl/issues/209).
BRIDGE_TCP_GBPS = 1.1
# Per message: a 1 KB gloo ring all-reduce of two processes over TCP took 0.354 ms, two
# messages (github.com/pytorch/gloo/issues/158, test2).
BRIDGE_LATENCY_US = 175.0
# Pinned device<->host copies over PCIe Gen4 x16: 25.1 of the link's 32 GB/s on A100
# (nvbandwidth host_to_device_memcpy, github.com/NVIDIA/nvbandwidth/issues/42).
HOST_COPY_GBPS = 25.0
# An emulated device's tensors already live in host memory: its staging copy is one memcpy on
# one core, about 10 GB/s on a server core.
EMULATED_HOST_COPY_GBPS = 10.0
BRIDGE_BACKENDS = ("gloo", "mpi", "ucc")


@dataclass(frozen=True)
class Bridge:
    """How traffic between communication domains travels (the cluster file's ``bridge:``): a
    backend every rank shares, tensors staged through pinned host memory. Unset numbers take
    the defaults below (:meth:`network_gbps`, :attr:`latency_s`, :meth:`staging_gbps`);
    calibration's measurements replace ``gbps`` and ``latency_us`` per pair of domains."""

    backend: str = "gloo"
    gbps: float | None = None
    """Network bandwidth of one bridge transfer (GB/s), as reached, not the datasheet's."""
    latency_us: float | None = None
    """Overhead of one bridge message (microseconds)."""
    host_copy_gbps: float | None = None
    """Bandwidth of the device->host and host->device staging copies (GB/s)."""

    def __post_init__(self):
        if self.backend not in BRIDGE_BACKENDS:
            raise ConfigError("cluster.bridge.backend", f"unknown backend {self.backend!r}",
                              f"use one of {', '.join(BRIDGE_BACKENDS)}")
        fixes = {"gbps": "the GB/s one bridge transfer reaches, e.g. 1.1 for gloo over TCP",
                 "latency_us": "the microseconds one bridge message costs, e.g. 175",
                 "host_copy_gbps": "the pinned device<->host copy GB/s, e.g. 25 for PCIe Gen4 x16"}
        for name, fix in fixes.items():
            value = getattr(self, name)
            if value is not None:
                require_number(value, f"cluster.bridge.{name}", lo=0, lo_open=name != "latency_us", fix=fix)

    @property
    def latency_s(self) -> float:
        return (self.latency_us if self.latency_us is not None else BRIDGE_LATENCY_US) * 1e-6

    def network_gbps(self, link_gbps: float, link_efficiency: float) -> float:
        """Network bandwidth of a bridge transfer over a link of ``link_gbps`` (as the cost model
        takes links, before ``link_efficiency``): ``gbps``, else the link at link_efficiency, at
        most what one TCP stream reaches (:data:`BRIDGE_TCP_GBPS`; MPI and UCC over RDMA may
        reach more: measure, or give ``gbps``)."""
        if self.gbps is not None:
            return self.gbps
        return min(link_gbps * link_efficiency, BRIDGE_TCP_GBPS)

    def staging_gbps(self, emulated: bool) -> float:
        """Bandwidth of one staging copy (device->host or host->device)."""
        if self.host_copy_gbps is not None:
            return self.host_copy_gbps
        return EMULATED_HOST_COPY_GBPS if emulated else HOST_COPY_GBPS


def bridge_from(raw: Any) -> Bridge:
    """The cluster file's ``bridge:`` mapping (absent: every default)."""
    if raw is None:
        return Bridge()
    if not isinstance(raw, dict):
        raise ConfigError("cluster.bridge", "must be a mapping", "e.g. bridge: {backend: gloo, gbps: 1.1}")
    reject_unknown(raw, {"backend", "gbps", "latency_us", "host_copy_gbps"}, "cluster.bridge")
    backend = raw.get("backend", "gloo")
    require_type(backend, str, "cluster.bridge.backend", f"one of {', '.join(BRIDGE_BACKENDS)}")
    return Bridge(**{**raw, "backend": backend})
