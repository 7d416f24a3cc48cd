"""The host's time to issue a layer's forward and backward on an accelerator. The device runs
behind the host, so no layer takes less (the cost model's layer time is the larger of the two),
and ``memx estimate`` says which stages' layers the host, not the device, sets. No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning import experts
from memx_launch.planning.activations import selective_modules
from memx_launch.planning.plan import FULL, SELECTIVE
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

# Host time to launch one kernel of a fused block's ~40 forward and backward (Megatron-LM with
# Transformer Engine): a small block is host bound. A host time per layer replaces the product.
KERNEL_LAUNCH_S = 5e-6
KERNELS_PER_LAYER = 40
FUSED_BLOCK_HOST_S = KERNELS_PER_LAYER * KERNEL_LAUNCH_S


def block_host_seconds(device_type: DeviceType, training: TrainingSpec) -> float:
    """A block's host time on ``device_type``: the run's flag, else the type's (cluster file or
    calibration), else a fused block's."""
    ms = training.host_ms_per_layer or device_type.host_ms_per_layer
    return ms / 1e3 if ms else FUSED_BLOCK_HOST_S


def moe_forward_again(model: ModelSpec, training: TrainingSpec, recompute) -> np.ndarray:
    """Where a mixture's MoE layer runs its forward again: full recompute, or selective recompute
    of its ``moe`` module."""
    recompute = np.asarray(recompute)
    whole_moe = "moe" in selective_modules(model, training) and bool(model.num_experts)
    return (recompute == FULL) | ((recompute == SELECTIVE) & whole_moe)


def layer_host_seconds(model: ModelSpec, training: TrainingSpec, block_s, recompute) -> np.ndarray:
    """Seconds the host takes to issue one layer at each ``recompute`` level, its block taking
    ``block_s`` (half again where the forward runs again: full or op-level recompute) and a
    mixture's MoE layer its own eager ops (:func:`experts.host_seconds`), slower or faster as
    ``block_s`` is against a fused block's."""
    recompute = np.asarray(recompute)
    op_level = (recompute == SELECTIVE) & (training.selective_recompute == "op")
    seconds = block_s * np.where((recompute == FULL) | op_level, 1.5, 1.0)
    if model.num_experts:
        again = moe_forward_again(model, training, recompute)
        seconds = seconds + experts.host_seconds(model, training, again) * block_s / FUSED_BLOCK_HOST_S
    return seconds
