"""Gradient accumulation as eager frameworks run it (``grad_accumulation_pass``): each micro-batch
of a step after the first adds its weight gradients into those the earlier ones left (torch's
``AccumulateGrad``: an in-place add that reads both and writes the sum), a memory-bound pass of
its own behind every such backward. Megatron's ``gradient_accumulation_fusion`` accumulates
inside the weight-gradient GEMM instead (no pass). No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import FULL_TRAINING, TrainedParameters, keeps_gathered, reduced_gradient_bytes
from memx_launch.specs.training import TrainingSpec


def accumulation_bytes(training: TrainingSpec, dp, pp: int, g: int) -> np.ndarray:
    """HBM bytes per parameter of a rank a step's ``g`` micro-batches move accumulating their
    gradients, by what the rank holds. Whole gradients (DDP, a sharded optimizer's replicas): each
    add after the first reads the held and the new gradient and writes the sum, 3 x their dtype.
    A fully sharded stage that keeps its unsharded gradients through the step
    (:func:`keeps_gathered`) holds them in the reduction's dtype r while each backward writes the
    compute dtype d: the first is upcast (d + r), each later one added (d + 2r), as torch 2.13's
    FSDP2 does (``FSDPParam.to_accumulated_grad_if_needed``, ``accumulate_unsharded_grad_if_needed``).
    Gradients reduce-scattered every micro-batch (ZeRO-2, ZeRO-3, FSDP without ``no_sync``): the
    rank's ``1 / dp`` shard, added as whole ones are."""
    adds = g - 1
    if keeps_gathered(training, pp):
        held, new = float(reduced_gradient_bytes(training)), float(training.dtype_bytes)
        upcast = held + new if held != new else 0.0
        return np.full(np.shape(dp), adds * (2.0 * held + new) + upcast)
    whole = adds * 3.0 * training.precision_bytes("grad_dtype")
    if training.fully_sharded or training.sharded_gradients:
        return whole / np.asarray(dp, dtype=np.float64)
    return np.full(np.shape(dp), whole)


def accumulation_seconds(params_on_rank, training: TrainingSpec, hbm_gbps, dp, pp: int, g: int,
                         trained: TrainedParameters = FULL_TRAINING) -> np.ndarray:
    """Seconds per micro-batch a rank's accumulation takes where the training accumulates in a
    pass of its own (``grad_accumulation_pass``): :func:`accumulation_bytes` of its trained
    parameters at ``hbm_gbps``, spread over the step's ``g`` micro-batches; zero with one
    micro-batch a step or without the pass."""
    if g <= 1 or not training.grad_accumulation_pass:
        return np.zeros(np.shape(params_on_rank))
    moved = np.asarray(params_on_rank, dtype=np.float64) * trained.share * accumulation_bytes(training, dp, pp, g)
    return moved / g / (np.asarray(hbm_gbps, dtype=np.float64) * 1e9)
