"""Which device this rank trains on: the cluster file's type for the rank (emulated on CPU),
or what the driver reports (NVIDIA through torch.cuda and nvidia-ml-py, ROCm through
torch.version.hip)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memx_launch.errors import ConfigError
from memx_launch.profiling.emulation import EmulatedDevice, device_for_rank
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.efficiency import hopper_or_later


@dataclass
class RankDevice:
    device_type: DeviceType
    emulated: EmulatedDevice | None
    description: str
    """What was detected, for the settings printout (emulation is labelled as such)."""


def _nvml_name(index: int) -> str | None:
    try:
        from memx_launch.profiling.kernel import nvml_device

        pynvml, handle = nvml_device(index)
        name = pynvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # no NVML on this machine (ROCm, CPU, containers without the driver library)
        return None


# Drivers report a little less than the marketed capacity (an "80 GB" H100 shows 79.6 GiB); a
# declared capacity further off than this is another device, or a typo that plans out of memory.
MEMORY_TOLERANCE = 0.10
GPU_VENDORS = ("nvidia", "amd")


def check_declared(declared: DeviceType, rank: int, name: str, vendor: str, memory_bytes: float) -> None:
    """A rank's GPU must be what the cluster file says it is: the vendor (when the file names a GPU
    vendor) and the memory capacity within MEMORY_TOLERANCE."""
    memory_gib = memory_bytes / 2**30
    vendor_differs = declared.vendor in GPU_VENDORS and declared.vendor != vendor
    if vendor_differs or abs(memory_gib - declared.memory_gib) > MEMORY_TOLERANCE * declared.memory_gib:
        raise ConfigError("--cluster", f"rank {rank} has {name} ({vendor}, {memory_gib:.1f} GiB) but the cluster "
                          f"file makes it {declared.name} ({declared.vendor}, {declared.memory_gib:g} GiB)",
                          "fix that node's entry (devices are listed in local-rank order) or its --node-rank")


def capability_hint(declared: DeviceType, capability: float | None) -> str:
    """What the settings line adds when the file leaves out a compute capability that changes the
    plan: a Hopper or newer GPU, which the cost model would take as Ampere (its default
    efficiency, unless the file gives one, and its fused attention kernels' speed)."""
    changes_plan = declared.flash_attention or declared.efficiency is None
    if not hopper_or_later(capability) or not changes_plan or declared.compute_capability is not None:
        return ""
    return f"; the GPU reports compute capability {capability:g}, the file gives none: add compute_capability: {capability:g}"


def power_hint(declared: DeviceType, limits: tuple[float, float] | None) -> str:
    """What the settings line adds when the GPU runs under a power limit below its board's highest
    (``limits``: :func:`~memx_launch.profiling.kernel.power_limits`) and the file says
    neither the limit nor a measured efficiency: its default efficiency assumes the rated power."""
    if limits is None or declared.efficiency is not None or declared.power_limit_w is not None:
        return ""
    enforced, rated = limits
    if enforced >= 0.99 * rated:
        return ""
    return (f"; the GPU's power limit is {enforced:g} W of its board's {rated:g}, the file gives none: "
            f"add power_limit_w: {enforced:g} and rated_power_w: {rated:g}")


def detect_rank_device(cluster: ClusterSpec | None, rank: int, local_rank: int) -> RankDevice:
    """This rank's device type. With a cluster file, its type for ``rank`` (rank order:
    ClusterSpec.rank_device_types()); on a machine without GPUs that type is emulated."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(local_rank)
        vendor = "amd" if torch.version.hip else "nvidia"
        name = (_nvml_name(local_rank) if vendor == "nvidia" else None) or props.name
        if cluster is not None:
            declared = cluster.device_type(cluster.rank_device_types()[rank])
            check_declared(declared, rank, name, vendor, props.total_memory)
            from memx_launch.profiling.kernel import compute_capability, power_limits
            return RankDevice(declared, None, f"{name} (cluster file type {declared.name})"
                              + capability_hint(declared, compute_capability(props))
                              + power_hint(declared, power_limits(local_rank)))
        from memx_launch.profiling.kernel import detect_device_type
        return RankDevice(detect_device_type(f"cuda:{local_rank}", name.replace(" ", "-")), None, name)
    if cluster is not None:
        emulated = device_for_rank(cluster, rank)
        return RankDevice(cluster.device_type(emulated.device_type), emulated,
                          f"{emulated.label}, {emulated.capacity_bytes / 2**30:g} GiB, slowdown x{emulated.slowdown:g}")
    from memx_launch.profiling.kernel import detect_device_type
    cpu = detect_device_type("cpu")
    return RankDevice(cpu, EmulatedDevice(cpu.name, cpu.memory_gib), "cpu (no cluster file: host memory)")


def calibration_tflops(rank_device: RankDevice, from_cluster_file: bool) -> float:
    """The rate this rank's calibration runs at, for the up-front estimate: a GPU's peak (declared
    in the file, or measured when detected); an emulated device runs on the CPU, measured here
    unless it was detected (then it was just measured)."""
    if rank_device.emulated is not None and from_cluster_file:
        from memx_launch.profiling.kernel import detect_device_type
        return detect_device_type("cpu").peak_tflops
    return rank_device.device_type.peak_tflops
