"""Model states in memory: weights, gradients and optimizer states per parameter on one rank,
by how the training setup shards them, and what a fully sharded run gathers per layer.

Read through :mod:`~memx_launch.planning.costmodel` (``cm.model_state_bytes_per_param``). No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def model_state_bytes_per_param(training: TrainingSpec, dp) -> np.ndarray:
    """Bytes of weights + gradients + master weights + optimizer moments per parameter on one rank.

    Megatron mixed precision with Adam: bf16 weight 2 + fp32 main grad 4 + fp32 master 4 and
    moments 8 = 18; the distributed optimizer shards the 12 over DP (Megatron's
    ``theoretical_memory_usage.py``: 6 + 12/DP). ZeRO-1 keeps bf16 grads (4 + 12/DP), ZeRO-2
    shards them too (2 + 14/DP); full sharding divides everything by DP. fp32 weights
    (autocast, FSDP2's fp32 shards) are their own master: fp32 training is 4 + 4 + 8 = 16.
    By part: :func:`model_state_bytes_by_part`.
    """
    if training.fully_sharded:  # the whole divided once: the parts' quotients would round apart
        return sum(_unsharded_state_bytes(training)) / np.asarray(dp, dtype=np.float64)
    return sum(model_state_bytes_by_part(training, dp))


def model_state_bytes_by_part(training: TrainingSpec, dp) -> tuple:
    """(weights, gradients, optimizer states) bytes per parameter on one rank, the parts of
    :func:`model_state_bytes_per_param`; optimizer states are the fp32 master copy of 16-bit
    weights and the moments."""
    dp = np.asarray(dp, dtype=np.float64)
    weight, grad, optim = _unsharded_state_bytes(training)
    if training.fully_sharded:
        return weight / dp, grad / dp, optim / dp
    if training.distributed_optimizer:
        optim = optim / dp
    if training.sharded_gradients:
        grad = grad / dp
    return weight, grad, optim


def _unsharded_state_bytes(training: TrainingSpec) -> tuple[float, float, float]:
    """Weights, gradients, master weights + moments per parameter before any sharding."""
    weight = float(training.precision_bytes("weights_dtype"))
    grad = float(training.precision_bytes("grad_dtype"))
    master = 4.0 if weight < 4 else 0.0
    moments = 8.0 if training.optimizer == "adam" else 4.0  # Adam m and v; SGD momentum
    return weight, grad, master + moments


def fully_sharded_working_bytes(model: ModelSpec, training: TrainingSpec, tp) -> float:
    """FSDP / ZeRO-3: one layer's weights gathered in the compute dtype while the next is
    prefetched, and one layer's unsharded gradient before its reduce-scatter."""
    return sum(fully_sharded_working_parts(model, training, tp))


def fully_sharded_working_parts(model: ModelSpec, training: TrainingSpec, tp) -> tuple:
    """(gathered weights, unsharded gradient) bytes of :func:`fully_sharded_working_bytes`."""
    if not training.fully_sharded:
        return 0.0, 0.0
    layer = model.layer_params / np.asarray(tp, dtype=np.float64)
    return layer * (2.0 * training.dtype_bytes), layer * training.precision_bytes("grad_dtype")
