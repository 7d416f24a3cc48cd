"""The matmul rate a device type sustains for a training setup: its peak for the dtype (TF32
where fp32 runs on tensor cores) at its efficiency. No torch import."""

from __future__ import annotations

from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.training import TrainingSpec

# NVIDIA Ampere (A100, A10, A40; Ada's L4 and L40S are 8.9): the first with TF32 tensor cores.
AMPERE_COMPUTE_CAPABILITY = 8.0


def has_tf32(device: DeviceType) -> bool:
    """TF32 tensor cores: NVIDIA Ampere and later; an unset compute capability is taken as Ampere."""
    return device.vendor == "nvidia" and (device.compute_capability is None
                                          or device.compute_capability >= AMPERE_COMPUTE_CAPABILITY)


def training_tflops(device: DeviceType, training: TrainingSpec) -> float:
    """Sustained TFLOPS of ``device``'s matmuls in ``training``: with ``tf32`` on a TF32 device,
    fp32 at the TF32 tensor-core peak, half the dense 16-bit peak (A100 156 of 312, H100 SXM 495
    of 989), at the 16-bit efficiency; else :meth:`DeviceType.effective_tflops_for`."""
    if training.dtype == "fp32" and training.tf32 and has_tf32(device):
        return device.effective_tflops / 2.0
    return device.effective_tflops_for(training.dtype)
