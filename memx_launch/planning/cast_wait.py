"""The end of a later micro-batch's backward under one autocast region a step (memx-run's,
``autocast_per_step``). torch.autocast caches its cast of each fp32 weight for its region: the
step's first forward makes the casts (one ``ToCopyBackward0`` node each) and the later
micro-batches' forwards, and full recompute's forward again, read the cache. The autograd engine
runs the ready node with the highest sequence number first, and a cast made in the step's first
forward is older than every node of a later micro-batch's graph: it runs after all of them. So
each weight's 16-bit gradient waits in the engine's buffers until that backward (of one chunk of
a stage: torch's pipeline stages run one backward a chunk and micro-batch) has run every other
node, then the casts run newest first, each making an fp32 copy (4 bytes a weight) that is added
into ``.grad``: the chunk's last linear first, the head on the last stage. At the first cast the
chunk holds every trained weight's 16-bit gradient and that fp32 copy, beside the other
micro-batches in flight, its states and autocast's copies; the micro-batch's own activations and
its working set are gone. Traced on memx's LLaMA block and on chains of linears, under CPU
autocast (``tests/test_cast_wait.py``). A region per forward (DDP under Accelerate, Lightning's
``bf16-mixed``) casts inside each forward: its casts run in order. No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import (TrainedParameters, autocast_copy_bytes, largest_block_matrix,
                                              rank_layer_params)
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

FP32_BYTES = 4


def waits(training: TrainingSpec, g: int) -> bool:
    """Whether a step's later micro-batches (``g`` of them a step) wait for their casts: autocast
    over fp32 weights with one region a step (quantized linears cast to their own formats)."""
    return bool(training.autocast and training.autocast_per_step and g > 1 and training.quantized_linears is None)


def waiting_block_bytes(model: ModelSpec, training: TrainingSpec, tp, trained: TrainedParameters, v: int):
    """Bytes of one block's 16-bit weight gradients at a later backward's end, spread over the
    stage's ``v`` chunks (one chunk's wait: its blocks'); frozen weights have none."""
    return autocast_copy_bytes(sum(rank_layer_params(model, training, tp)), training) * trained.share / v


def first_cast_bytes(model: ModelSpec, training: TrainingSpec, tp, end_tp, pp: int,
                     trained: TrainedParameters) -> np.ndarray:
    """(P,) bytes beside the blocks' waiting gradients at the first cast: its fp32 copy, of the
    block's largest matrix (no block's last linear is larger), and on the last stage the head's
    16-bit gradient and its fp32 copy instead (its weight the last a forward casts)."""
    tp = np.broadcast_to(np.asarray(tp, dtype=np.float64), (pp,))
    out = FP32_BYTES * largest_block_matrix(model, training, tp)
    if model.output_vocab:  # the output layer's matmul casts its weight, tied to the embedding's or not
        head = model.output_vocab * model.hidden_size / end_tp[1]
        out[-1] = max(out[-1], FP32_BYTES * head) + training.dtype_bytes * head * trained.share
    return out
