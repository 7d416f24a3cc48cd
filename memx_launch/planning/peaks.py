"""The rates a device type sustains for a training setup: its matmul peak for the dtype (TF32
where fp32 runs on tensor cores, FP8 or FP4 for the linear layers of an FP8 or FP4 run) at its
efficiency, and its memory bandwidth at what streaming kernels reach of the datasheet's.
No torch import."""

from __future__ import annotations

from memx_launch.errors import ConfigError
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.efficiency import blackwell_or_later
from memx_launch.specs.training import TrainingSpec

# Blackwell Ultra (B300, GB300): FP4 tensor cores at 1.5 times Blackwell's rate.
BLACKWELL_ULTRA_COMPUTE_CAPABILITY = 10.3
# NVIDIA Ampere (A100, A10, A40; Ada's L4 and L40S are 8.9): the first with TF32 tensor cores.
AMPERE_COMPUTE_CAPABILITY = 8.0
# NVIDIA Ada (L4, L40S) and Hopper: the first with FP8 tensor cores, at twice the dense 16-bit
# rate (H100 SXM 1,979 of 989 TFLOPS; L4 242 of 121).
FP8_COMPUTE_CAPABILITY = 8.9
# Share of the datasheet memory bandwidth that streaming kernels sustain, by vendor: the median
# BabelStream triad over the datasheet figure of the public runs in benchmarks/data/hbm_stream.csv
# (NVIDIA A100, H100, H200: 0.83-0.89; AMD MI300X: 0.75-0.77). Other vendors: none at hand.
SUSTAINED_HBM_SHARE = {"nvidia": 0.86, "amd": 0.76}
# FLOPs per byte before element-wise work is memory bound, for a type without a memory bandwidth.
_DEFAULT_FLOPS_PER_BYTE = 150.0


def datasheet_hbm(device: DeviceType) -> float:
    """The device's datasheet memory bandwidth in GB/s, or what its peak FLOPs suggest when the
    file gives none."""
    return device.memory_bandwidth_gbps or device.peak_tflops * 1e3 / _DEFAULT_FLOPS_PER_BYTE


def hbm_gbps(device: DeviceType, stand_in: bool = False) -> float:
    """GB/s the device's kernels move to and from its memory: its :func:`datasheet_hbm` at its
    vendor's :data:`SUSTAINED_HBM_SHARE`; a CPU's, a vendor's without a measured share and a
    ``stand_in``'s (a CPU process of an emulated cluster) as given."""
    return datasheet_hbm(device) * (1.0 if stand_in else SUSTAINED_HBM_SHARE.get(device.vendor, 1.0))


def datasheet_of_sustained_gbps(sustained_gbps: float, vendor: str) -> float:
    """The datasheet bandwidth a measured copy rate stands for: :func:`hbm_gbps` of it gives it back."""
    return sustained_gbps / SUSTAINED_HBM_SHARE.get(vendor, 1.0)


def has_tf32(device: DeviceType) -> bool:
    """TF32 tensor cores: NVIDIA Ampere and later; an unset compute capability is taken as Ampere."""
    return device.vendor == "nvidia" and (device.compute_capability is None
                                          or device.compute_capability >= AMPERE_COMPUTE_CAPABILITY)


def runs_as_tf32(device: DeviceType, training: TrainingSpec) -> bool:
    """``training``'s fp32 matmuls run on ``device``'s TF32 tensor cores (``--tf32`` on a TF32 device)."""
    return training.dtype == "fp32" and training.tf32 and has_tf32(device)


def matmul_peak_tflops(device: DeviceType, training: TrainingSpec) -> float:
    """The datasheet peak of ``training``'s block matmuls: TF32's (half the dense 16-bit peak) where
    fp32 runs on TF32 tensor cores, the fp32 peak for fp32 where the file gives it, else the
    16-bit peak. No timing of a block can beat its FLOPs at this rate."""
    if runs_as_tf32(device, training):
        return device.peak_tflops / 2.0
    if training.dtype == "fp32" and device.peak_tflops_fp32 is not None:
        return device.peak_tflops_fp32
    return device.peak_tflops


def training_tflops(device: DeviceType, training: TrainingSpec) -> float:
    """Sustained TFLOPS of ``device``'s matmuls in ``training``: with ``tf32`` on a TF32 device,
    fp32 at the TF32 tensor-core peak, half the dense 16-bit peak (A100 156 of 312, H100 SXM 495
    of 989), at the 16-bit efficiency; else :meth:`DeviceType.effective_tflops_for`."""
    if runs_as_tf32(device, training):
        return device.effective_tflops / 2.0
    return device.effective_tflops_for(training.dtype)


def fp8_peak_tflops(device: DeviceType) -> float | None:
    """The dense FP8 matmul peak: ``peak_tflops_fp8`` when given, else twice the 16-bit peak on
    NVIDIA compute capability 8.9 and later; None for a device without FP8 matmuls."""
    if device.peak_tflops_fp8 is not None:
        return device.peak_tflops_fp8
    capable = device.compute_capability is not None and device.compute_capability >= FP8_COMPUTE_CAPABILITY
    return 2.0 * device.peak_tflops if device.vendor == "nvidia" and capable else None


def fp4_peak_tflops(device: DeviceType) -> float | None:
    """The dense FP4 matmul peak: ``peak_tflops_fp4`` when given, else on NVIDIA Blackwell four
    times the 16-bit peak (B200 9,000 of 2,250 TFLOPS, GB200 10,000 of 2,500) and six times on
    Blackwell Ultra, compute capability 10.3 (GB300 15,000 of 2,500); None before Blackwell."""
    if device.peak_tflops_fp4 is not None:
        return device.peak_tflops_fp4
    if device.vendor != "nvidia" or not blackwell_or_later(device.compute_capability):
        return None
    return (6.0 if device.compute_capability >= BLACKWELL_ULTRA_COMPUTE_CAPABILITY else 4.0) * device.peak_tflops


def linear_tflops(device: DeviceType, training: TrainingSpec) -> float:
    """Sustained TFLOPS of the blocks' linear layers: with ``fp8`` the FP8 peak, with ``fp4`` the
    FP4 peak, at the 16-bit efficiency (a device without them is refused, and MXFP8 before
    Blackwell); else :func:`training_tflops`."""
    if training.quantized_linears is None:
        return training_tflops(device, training)
    flag = "--fp8" if training.fp8 else "--fp4"
    capability = f"compute capability {device.compute_capability:g}" if device.compute_capability else \
        "no compute_capability given"
    peak = fp8_peak_tflops(device) if training.fp8 else fp4_peak_tflops(device)
    if peak is None:
        field, since = ("peak_tflops_fp8", "8.9") if training.fp8 else ("peak_tflops_fp4", "10.0")
        raise ConfigError(flag, f"device type {device.name} ({device.vendor}, {capability}) has no "
                          f"{flag[2:].upper()} matmuls",
                          f"drop {flag}, or give the type's compute_capability ({since} or later) or {field}")
    if training.fp8 == "mxfp8" and device.vendor == "nvidia" and not blackwell_or_later(device.compute_capability):
        raise ConfigError(flag, f"device type {device.name} ({capability}) has no block-scaled FP8 matmuls "
                          "(MXFP8: NVIDIA Blackwell, compute capability 10.0 or later)",
                          "use --fp8 current, or give the type's compute_capability")
    return peak * device.effective_tflops / device.peak_tflops
