"""What a stage holds at the end of a later micro-batch's backward under one autocast region a step
(memx-run's, ``autocast_per_step``), when that micro-batch's activations, working set, logits and
embedding output are gone: the other micro-batches in flight, its states, and what the backward's
last nodes make.

Every 16-bit weight gradient of the chunk. torch.autocast caches its cast of each fp32 weight for its region:
the step's first forward makes the casts (one ``ToCopyBackward0`` node each) and the later
micro-batches' forwards, and full recompute's forward again, read the cache. The autograd engine
runs the ready node with the highest sequence number first, and a cast made in the step's first
forward is older than every node of a later micro-batch's graph: it runs after all of them, even
the embedding's. So each weight's 16-bit gradient waits in the engine's buffers until that
backward (of one chunk of a stage: torch's pipeline stages run one backward a chunk and
micro-batch) has run every other node, then the casts run newest first, each making an fp32 copy
(4 bytes a weight) that is added into ``.grad``: the chunk's last linear first, the head on the
last stage. A region per forward (DDP under Accelerate, Lightning's ``bf16-mixed``) casts inside
each forward: its casts run in order.

And, on the first stage, before the casts, the word embedding's gradient: the lookup's backward
writes a dense gradient of the whole V x h table (over TP) in the fp32 of its weight before
AccumulateGrad adds it into ``.grad``. Every setup that adds gradients into held ones makes it (a
DDP step's later micro-batches, Megatron's hook into its ``main_grad``), but there it rises above
the activations' peak only where one micro-batch's activations and working set on the first stage
are smaller than the table (huge vocabularies, short sequences, full recompute): not counted.

Traced on memx's LLaMA stages and on chains of linears, under CPU autocast and in fp32
(``tests/test_backward_end.py``). No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import (TrainedParameters, autocast_copy_bytes, largest_block_matrix,
                                              rank_layer_params)
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

FP32_BYTES = 4


def waiting_weights(model: ModelSpec, transformers_blocks: bool) -> tuple[float, float]:
    """(the weights whose 16-bit gradients wait beside the attention core's backward, those beside the
    MLP's activation's) of one block (of a layer with an MLP), whole (TP splits them), where the casts
    wait: each gradient a block's backward makes waits in the engine's buffers for the backward's end,
    the MLP's and the attention's projections' beside its attention core's backward (but q, k and v's,
    made after it: counted there all the same), the down projection's beside the activation's, or a
    mixture's router's and shared expert's (which runs first), and its experts' where they autocast
    (Transformers' Llama 4's ``torch.bmm``; its grouped GEMMs run in the weights' fp32)."""
    h, matrices = model.hidden_size, 3.0 if model.gated_mlp else 2.0
    if not model.num_experts:
        return matrices * model.ffn_hidden_size * h + model.attention_params, model.ffn_hidden_size * h
    first = matrices * model.shared_expert_ffn_hidden_size * h
    cast_experts = model.num_experts * matrices * model.moe_ffn_hidden_size * h \
        if transformers_blocks and model.experts_take_every_token else 0.0
    return first + h * model.num_experts + cast_experts + model.attention_params, first


def waits(training: TrainingSpec, g: int) -> bool:
    """Whether a step's later micro-batches (``g`` of them a step) wait for their casts: autocast
    over fp32 weights with one region a step (quantized linears cast to their own formats)."""
    return bool(training.autocast and training.autocast_per_step and g > 1 and training.quantized_linears is None)


def waiting_block_bytes(model: ModelSpec, training: TrainingSpec, tp, trained: TrainedParameters, v: int):
    """Bytes of one block's 16-bit weight gradients at a later backward's end, spread over the
    stage's ``v`` chunks (one chunk's wait: its blocks'); frozen weights have none."""
    return autocast_copy_bytes(sum(rank_layer_params(model, training, tp)), training) * trained.share / v


def end_bytes(model: ModelSpec, training: TrainingSpec, tp, end_tp, pp: int, trained: TrainedParameters) -> np.ndarray:
    """(P,) bytes a later backward's end makes beside the blocks' waiting gradients: on the first
    stage the word embedding's gradient, then the first cast's fp32 copy, of the block's largest
    matrix (no block's last linear is larger), on the last stage of the head's (its weight the
    last a forward casts), whose 16-bit gradient waits besides; the larger of the two."""
    tp = np.broadcast_to(np.asarray(tp, dtype=np.float64), (pp,))
    transient, waiting = FP32_BYTES * largest_block_matrix(model, training, tp), np.zeros(pp)
    if model.output_vocab:  # the output layer's matmul casts its weight, tied to the embedding's or not
        head = model.output_vocab * model.hidden_size / end_tp[1]
        transient[-1] = max(transient[-1], FP32_BYTES * head)
        waiting[-1] = training.dtype_bytes * head * trained.share
    # The embedding's gradient, whole, in its fp32 (the lookup does not cast it).
    transient[0] = max(transient[0], FP32_BYTES * model.word_embedding_params / end_tp[0] * trained.base)
    return transient + waiting
