"""Gradient accumulation as eager frameworks run it (``grad_accumulation_pass``): each micro-batch
of a step after the first adds its weight gradients into those the earlier ones left (torch's
``AccumulateGrad``: an in-place add that reads both and writes the sum), a memory-bound pass of
its own behind every such backward, and until it adds, the fresh gradient is held beside the
sum. Megatron's ``gradient_accumulation_fusion`` accumulates inside the weight-gradient GEMM
instead (no pass, no fresh gradient). No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.lazy_gradients import peak_precedes_backward
from memx_launch.planning.model_states import (FULL_TRAINING, TrainedParameters, keeps_gathered, largest_block_matrix,
                                               output_layer_params, reduced_gradient_bytes)
from memx_launch.specs.model import ModelSpec
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


def fresh_gradient_bytes(model: ModelSpec, training: TrainingSpec, tp, last_tp, pp: int, g: int,
                         v: int) -> np.ndarray:
    """(P,) bytes at each stage's activations' peak of the weight gradient a backward has computed
    and not yet added into the parameter's ``.grad``: torch's ``AccumulateGrad`` holds it beside
    the sum until its in-place add, one parameter at a time (measured: ``tests/test_lazy_gradients.py``).
    Where gradients accumulate in a pass of their own on whole stages, from the step's second
    backward on (the first's become ``.grad``), on stages whose peak comes back after a backward
    (:func:`~memx_launch.planning.lazy_gradients.peak_precedes_backward`: every later backward
    starts with as many micro-batches in flight and every gradient held): a block's largest
    matrix (its last block's down projection comes first), on the last stage the output layer's
    if larger (its gradient comes first, beside the logits' gradient). An upper bound where only
    part trains (LoRA, frozen layers)."""
    if g <= 1 or not training.grad_accumulation_pass or training.fully_sharded or training.sharded_gradients:
        return np.zeros(pp)
    elements = np.broadcast_to(largest_block_matrix(model, training, tp), (pp,)).copy()
    elements[-1] = max(elements[-1], output_layer_params(model, pp) / last_tp)
    later = ~peak_precedes_backward(pp, g, v)
    return np.where(later, elements * training.precision_bytes("grad_dtype"), 0.0)
