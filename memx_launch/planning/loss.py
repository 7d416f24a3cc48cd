"""The language-model loss on the last stage: the memory its logits take at their peak and the
HBM bytes its passes move, by the kernel that runs it.

Four kernels: torch's cross entropy on logits gathered over TP (every rank holds the whole
vocabulary), Megatron's vocab-parallel cross entropy (each TP rank its 1/TP, softmax in place),
torch's loss parallel (DTensor's ``loss_parallel()``, torchtitan's default under TP: each rank
its 1/TP, in torch ops that keep their temporaries) and a fused kernel. No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.activations import fresh_gradient_bytes
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

# HBM bytes torch's cross entropy moves per logit, forward and backward: the fp32 cast (read 2,
# write 4), log-softmax (two reads and a write of 4), the argmax/target read (4), its backward
# (zero-filled gradient 4; read gradient and output, write 4 each) and the cast back (4 + 2).
LOSS_BYTES_PER_LOGIT = 48.0
# Torch's loss parallel runs its log-softmax as separate ops (torch/distributed/tensor/parallel/
# loss.py): forward the fp32 cast (2 + 4), the max (4), the shift (4 + 4), exp (4 + 4), the sum
# (4) and the shifted log-softmax (4 + 4); backward a zeroed gradient (4), exp of the log-softmax
# again (4 + 4), their sum (8 + 4), its product with the incoming gradient (4 + 4) and the cast
# back (4 + 2).
LOSS_PARALLEL_BYTES_PER_LOGIT = 76.0
# A soft cap, cap * tanh(x / cap) in three eager ops (Gemma 2's logits and attention scores), in
# passes over x in its dtype, forward and backward: forward the divide, tanh and multiply each read
# and write it (6), backward the product's and the quotient's gradients (2 each) and tanh's from
# its kept output and the incoming gradient (3).
SOFTCAP_PASSES = (6.0, 7.0)


def logits_bytes(model: ModelSpec, mbs, seq, tp, training: TrainingSpec | None = None) -> np.ndarray:
    """The last stage's logits for the loss at their peak, in the backward of the loss.

    Vocab-parallel (Megatron), per logit of the rank's 1/TP: fp32 loss 8 bytes (16-bit
    logits, the fp32 copy its softmax is computed in place in, the 16-bit gradient), loss in
    the training dtype 2 x its bytes. Torch's loss parallel, per logit of the rank's 1/TP: 16
    bytes in fp32 (the log-softmax kept for the backward, and in the backward the zeroed
    gradient, exp of the log-softmax and their sum at once; tests/test_loss.py measures it), 4 x
    the training dtype when the loss runs in it; at TP 1 it is torch's cross entropy. Torch's
    cross entropy on gathered logits (every TP rank holds the whole vocabulary): the logits, the
    fp32 log-softmax kept for the backward, and in the backward the gradient nll_loss writes and
    the one log_softmax's backward writes from it (the ``.float()`` copy is freed after the
    forward): d + 12, 14 bytes in 16 bits, 16 in fp32 (as measured, tests/test_costmodel.py), or
    3 x the training dtype when the loss runs in it. A fused cross entropy kernel keeps the
    16-bit logits and their gradient: 2 x the dtype. A soft cap on the logits (Gemma 2 and 3)
    keeps its tanh's output for the backward, one logit of the dtype more (as measured,
    tests/test_costmodel.py). Each multi-token prediction module keeps
    logits of its own for its loss. Counted beside a block's backward working set: they take
    turns in allocated memory, but the measured runs' peaks keep both (docs/setups.md, "The loss
    beside the blocks' working set"). At least the head's backward where it makes a fresh gradient
    (:func:`head_gradient_bytes`).
    """
    tr = training or TrainingSpec()
    d = tr.dtype_bytes
    fp32 = tr.loss_dtype == "fp32"
    tp = np.asarray(tp, dtype=np.float64)
    share = tp if tr.vocab_parallel_loss else 1.0
    gathered = d + 12.0 if fp32 else 3.0 * d
    if tr.fused_loss:
        per_logit = 2.0 * d
    elif tr.vocab_parallel_loss and tr.torch_loss_parallel:
        per_logit = np.where(_loss_parallel_runs(tr, tp), 16.0 if fp32 else 4.0 * d, gathered)
    elif tr.vocab_parallel_loss:
        per_logit = 8.0 if fp32 else 2.0 * d
    else:
        per_logit = gathered
    per_logit = per_logit + (d if model.logit_softcapping else 0.0)
    loss = per_logit * np.asarray(mbs) * np.asarray(seq) * model.output_vocab / share * (1 + model.mtp_layers)
    return np.maximum(loss, head_gradient_bytes(model, mbs, seq, tp, tr))


def head_gradient_bytes(model: ModelSpec, mbs, seq, tp, training: TrainingSpec) -> np.ndarray:
    """The head's backward where gradients accumulate into fp32 weights
    (:func:`~memx_launch.planning.activations.fresh_gradient_bytes`): the output layer's weight's
    whole gradient in fp32 (its 1/TP), beside the logits' fp32 gradient the GEMM reads in fp32
    training (under autocast the cast of the GEMM's 16-bit gradient, once the node freed it, the
    logits' gradient and the weight's 16-bit copy). Where few tokens meet a large vocabulary it
    passes the loss's peak (tests/test_loss.py); 0 elsewhere (memx-run in 16 bits: the gradient
    waits for the backward's end, planning/backward_end.py)."""
    fresh = fresh_gradient_bytes(training)
    tp = np.asarray(tp, dtype=np.float64)
    logits_gradient = 4.0 * np.asarray(mbs) * np.asarray(seq) * model.output_vocab if training.dtype_bytes == 4 else 0.0
    share = tp if training.vocab_parallel_loss else 1.0
    return fresh * model.output_vocab * model.hidden_size / tp + (fresh > 0) * logits_gradient / share


def loss_hbm_bytes_per_logit(model: ModelSpec, training: TrainingSpec, tp) -> np.ndarray:
    """HBM bytes the loss moves per logit the rank holds, forward and backward: a fused kernel
    reads the 16-bit logits forward and again backward, writing the gradient; a soft cap's passes
    come before it."""
    softcap = sum(SOFTCAP_PASSES) * training.dtype_bytes if model.logit_softcapping else 0.0
    if training.fused_loss:
        return np.full(np.shape(tp), 3.0 * training.dtype_bytes + softcap)
    return np.where(_loss_parallel_runs(training, tp), LOSS_PARALLEL_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT) + softcap


def _loss_parallel_runs(training: TrainingSpec, tp) -> np.ndarray:
    """Where torch's loss parallel runs: asked for, on vocabulary shards (TP > 1); at TP 1 the
    loss is torch's cross entropy."""
    return (training.vocab_parallel_loss and training.torch_loss_parallel) & (np.asarray(tp) > 1)
