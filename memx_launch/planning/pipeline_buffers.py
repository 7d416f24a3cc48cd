"""What a pipeline engine's own buffers hold on each stage, beyond the layers' activations.

No torch import (planning).
"""

from __future__ import annotations

import numpy as np

from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def kept_stage_output_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, inflight,
                            num_microbatches) -> np.ndarray:
    """Per stage (``tp`` and ``mbs``: one value or one per stage): what a pipeline engine that keeps its buffers (``keep_stage_outputs``) holds
    beyond the layers. Every stage but the last keeps each in-flight micro-batch's output hidden
    state (b s h, over TP with sequence parallelism) until its gradient returns; Megatron frees
    that data once sent (Korthikanti et al. 2022, appendix B). The last stage writes each
    micro-batch's logits into one of two buffers and never empties them, so while one
    micro-batch's loss runs the previous one's 16-bit logits (whole or 1/TP, as the loss
    holds them) are still there."""
    tr = training
    inflight = np.asarray(inflight, dtype=np.float64)
    out = np.zeros(inflight.shape)
    if not tr.keep_stage_outputs:
        return out
    tp = np.broadcast_to(np.asarray(tp, dtype=np.float64), inflight.shape)  # one degree or one per stage
    mbs = np.broadcast_to(np.asarray(mbs, dtype=np.float64), inflight.shape)
    hidden = mbs * seq * model.hidden_size * tr.dtype_bytes / (tp if tr.sequence_parallel else np.ones_like(tp))
    out[:-1] = inflight[:-1] * hidden[:-1]
    if num_microbatches > 1:
        out[-1] = tr.dtype_bytes * mbs[-1] * seq * model.output_vocab / (tp[-1] if tr.vocab_parallel_loss else 1)
    return out
