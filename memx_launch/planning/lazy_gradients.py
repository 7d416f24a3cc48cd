"""Gradients created by the step's first backward. Where a framework keeps them as each
parameter's ``.grad`` (torch's DDP and memx-run: ``grad_accumulation_pass``, torch's
AccumulateGrad), torch's autograd creates them in the backward and ``zero_grad``
(``set_to_none=True``, torch's default since 2.0) frees them before the next step's forward. A
stage whose most micro-batches in flight come before its first backward holds none of them then:
every stage of a step of one micro-batch, and under 1F1B a stage with no second forward after
its first backward (the first stage of a pipeline with as many micro-batches as stages). Its
first backward frees that micro-batch's activations block by block as it creates the block's
gradients, and no forward follows, so a block holds at most n of its kept activations, or n - 1
and its gradients: its peak leaves out the smaller of its gradients and one micro-batch's
activations. The optimizer step's peak, the activations freed and every gradient there, is
:mod:`optimizer_peak`'s. DDP's buckets, Megatron's and DeepSpeed's gradient buffers are allocated
once: held throughout. No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.extra_blocks import beside_repeated
from memx_launch.planning.model_states import model_state_bytes_by_part, rank_layer_params
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def peak_precedes_backward(pp: int, g: int, v: int) -> np.ndarray:
    """(P,) whether each stage reaches its most micro-batches in flight only before its first
    backward: under 1F1B stage i runs min(P - i - 1, g) forwards before it, then one more; its
    in-flight count comes back only with a second forward after a backward. Interleaved
    schedules: False (not derived)."""
    if v > 1:
        return np.zeros(pp, dtype=bool)
    warmup = np.minimum(pp - np.arange(pp) - 1, g)
    return g - warmup <= 1


def lazy_gradient_bytes(model: ModelSpec, training: TrainingSpec, tp, trained, pp: int, g: int,
                        v: int) -> np.ndarray | None:
    """(P,) bytes of one block's ``.grad`` tensors on stages whose peak precedes their creation (0
    elsewhere); None where no stage has such a peak (sharded or bucketed gradients, a distributed
    optimizer's, a stage forwarding again after its backward, the last step's gradients freed only
    after the forward: ``zero_grad_after_forward``, Lightning's): the search's scoring skips it."""
    precedes = peak_precedes_backward(pp, g, v)
    if not training.grad_accumulation_pass or training.fully_sharded or training.sharded_gradients \
            or training.zero_grad_after_forward or not precedes.any():
        return None
    grad_per_param = model_state_bytes_by_part(training, 1, trained)[1]  # one copy, DDP's bucket aside
    params = np.broadcast_to(sum(rank_layer_params(model, training, tp)), (pp,))
    return np.where(precedes, params * grad_per_param, 0.0)


def gradient_relief(lazy: np.ndarray | None, activations):
    """Per block, the gradient bytes its stage's peak leaves out: the smaller of
    :func:`lazy_gradient_bytes`' and ``activations`` (the block's kept bytes of one micro-batch,
    which the first backward frees as it creates them); 0.0 without any."""
    if lazy is None:
        return 0.0
    return np.minimum(lazy, np.asarray(activations, dtype=np.float64))


def stage_relief(model: ModelSpec, lazy: np.ndarray | None, activations, layers, counts):
    """The gradient bytes a stage of ``layers`` blocks leaves out of its peak: each repeated
    block's :func:`gradient_relief`, none of another kind's (``counts``, extra_blocks.kind_counts:
    their activations are not weighed here) and a multi-token prediction block's as a block's, as
    the scoring's per-layer bytes count them."""
    if lazy is None:
        return 0.0
    block = gradient_relief(lazy, activations)
    return layers * block + beside_repeated(model, block, [0.0] * len(counts), counts)
