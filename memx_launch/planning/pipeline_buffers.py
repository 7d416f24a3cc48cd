"""What a pipeline engine's own buffers hold on each stage, beyond the layers' activations.

No torch import (planning).
"""

from __future__ import annotations

import numpy as np

from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def pipeline_buffer_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, inflight, num_microbatches,
                          virtual_stages: int = 1) -> np.ndarray:
    """Per stage, the pipeline engine's buffers beyond the layers: :func:`kept_stage_output_bytes`
    and :func:`torch_receive_buffer_bytes`."""
    return (kept_stage_output_bytes(model, training, mbs, seq, tp, inflight, num_microbatches, virtual_stages)
            + torch_receive_buffer_bytes(model, training, mbs, seq, tp, inflight, num_microbatches, virtual_stages))


def _per_stage(x, shape) -> np.ndarray:
    """``x`` (one value, or one per stage: a TP degree, a local micro-batch) for each stage."""
    return np.broadcast_to(np.asarray(x, dtype=np.float64), shape)


def boundary_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, shape) -> np.ndarray:
    """A stage boundary's hidden state (b s h, fp32 under autocast; each TP rank's 1/TP of it with
    sequence parallelism)."""
    split = _per_stage(tp, shape) if training.sequence_parallel else 1.0
    return _per_stage(mbs, shape) * seq * model.hidden_size * training.residual_bytes / split


def kept_stage_output_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, inflight,
                            num_microbatches, virtual_stages: int = 1) -> np.ndarray:
    """Per stage (``tp`` and ``mbs``: one value or one per stage): the stage outputs a pipeline
    engine keeps beyond the layers. With ``keep_stage_outputs`` the output hidden state (b s h,
    over TP with sequence parallelism) of every chunk micro-batch in flight until its gradient
    returns (the last 1F1B stage's goes to the loss at once); Megatron frees that data once sent
    (Korthikanti et al. 2022, appendix B). With ``keep_previous_logits`` the last stage writes each
    micro-batch's logits into one of two buffers and never empties them, so while one
    micro-batch's loss runs the previous one's 16-bit logits (whole or 1/TP, as the loss holds
    them) are still there."""
    tr = training
    inflight = np.asarray(inflight, dtype=np.float64)
    out = np.zeros(inflight.shape)
    if tr.keep_stage_outputs:
        chunks = np.full(inflight.shape, float(virtual_stages))  # each chunk micro-batch in flight keeps its output
        if virtual_stages == 1:
            chunks[-1] = 0.0  # the last stage's goes to the loss at once
        out += chunks * inflight * boundary_bytes(model, tr, mbs, seq, tp, inflight.shape)
    if tr.keep_previous_logits and num_microbatches > 1:
        last_tp, last_mbs = (_per_stage(x, inflight.shape)[-1] for x in (tp, mbs))
        out[-1] += tr.dtype_bytes * last_mbs * seq * model.output_vocab / (last_tp if tr.vocab_parallel_loss else 1)
    return out


def torch_receive_buffer_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, inflight, num_microbatches,
                               virtual_stages: int = 1) -> np.ndarray:
    """Per stage, what torch's pipeline stages (``torch_pipelining``) allocate beyond the layers:
    each of a rank's ``virtual_stages`` model chunks allocates, at its first step, one receive
    buffer per micro-batch for its input (all but the pipeline's first chunk) and one for its
    output's gradient (all but the last), and keeps them for the job (torch 2.13's
    ``PipelineStage``: ``args_recv_info`` and ``grad_recv_info``). A received input is the
    activation its chunk's first layer keeps, counted with the layers while its micro-batch is in
    flight; the rest of the input buffers and every gradient buffer are counted here."""
    inflight = np.asarray(inflight, dtype=np.float64)
    pp, g = inflight.shape[0], float(num_microbatches)
    if not training.torch_pipelining or pp == 1:
        return np.zeros(inflight.shape)
    inputs = np.full(pp, virtual_stages * g)
    grads = inputs.copy()
    inputs[0] -= g
    grads[-1] -= g
    idle_inputs = inputs * (1.0 - np.minimum(inflight, g) / g)
    return (idle_inputs + grads) * boundary_bytes(model, training, mbs, seq, tp, inflight.shape)
