"""Gradient accumulation as eager frameworks run it (``grad_accumulation_pass``): each micro-batch
of a step after the first adds its weight gradients into those the earlier ones left (torch's
``AccumulateGrad``: an in-place add that reads both and writes the sum), a memory-bound pass of
its own behind every such backward. Megatron's ``gradient_accumulation_fusion`` accumulates
inside the weight-gradient GEMM instead (no pass). No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import FULL_TRAINING, TrainedParameters, keeps_gathered, reduced_gradient_bytes
from memx_launch.specs.training import TrainingSpec


def accumulated_gradient_bytes(training: TrainingSpec, dp, pp: int) -> np.ndarray:
    """Bytes per parameter of a rank that one accumulation adds into: the gradients it holds
    whole (DDP, a sharded optimizer's replicas) in their dtype; a fully sharded stage's unsharded
    ones where it keeps them through the step (:func:`keeps_gathered`: in the reduction's dtype,
    FSDP2's ``to_accumulated_grad_if_needed``), else its ``1 / dp`` shard of them (reduce-scattered
    every micro-batch: ZeRO-2, ZeRO-3, FSDP without ``no_sync``)."""
    grad = float(reduced_gradient_bytes(training) if keeps_gathered(training, pp)
                 else training.precision_bytes("grad_dtype"))
    sharded = (training.fully_sharded and not keeps_gathered(training, pp)) or training.sharded_gradients
    return grad / np.asarray(dp, dtype=np.float64) if sharded else np.full(np.shape(dp), grad)


def accumulation_seconds(params_on_rank, training: TrainingSpec, hbm_gbps, dp, pp: int, g: int,
                         trained: TrainedParameters = FULL_TRAINING) -> np.ndarray:
    """Seconds per micro-batch a rank's accumulation passes take, averaged over a step's ``g``
    micro-batches (the first adds into nothing): the trained parameters' gradients read twice and
    written once at ``hbm_gbps``; zero without ``grad_accumulation_pass``."""
    if not training.grad_accumulation_pass or g <= 1:
        return np.zeros(np.shape(params_on_rank))
    moved = 3.0 * np.asarray(params_on_rank, dtype=np.float64) * trained.share * accumulated_gradient_bytes(
        training, dp, pp)
    return (g - 1) / g * moved / (np.asarray(hbm_gbps, dtype=np.float64) * 1e9)
