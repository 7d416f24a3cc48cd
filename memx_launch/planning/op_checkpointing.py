"""Op-level selective activation checkpointing, as torchtitan runs it (``[activation_checkpoint]
mode = "selective"``, ``selective_ac_option = "op"``; ``--selective-recompute op``).

A block runs under ``torch.utils.checkpoint`` with a policy that saves the outputs of the fused
attention kernel (its output and logsumexp), of sequence parallelism's reduce-scatters, and of
every other matmul (the first, third, ...: torchtitan counts the block's ``aten.mm`` calls and
recomputes the even ones); everything else is recomputed in the backward from the block's
input, which the checkpoint keeps. A block's matmuls are its separate projections in forward
order (torchtitan's LLaMA: wq, wk, wv, wo, then w1, w3, w2; a GELU MLP's fc1, fc2), so it keeps
q, v, the MLP's gate and the down projection's output, and runs k, o and up again. Each output
is the rank's: a column-parallel projection's is 1/TP of its width, a row-parallel one's (o,
down) the whole hidden size of partial sums.
"""

from __future__ import annotations

import numpy as np


def projections(model, tp) -> list[tuple]:
    """(output width, input width) of each projection of a block, in the order its matmuls run."""
    h, q, kv, f = model.hidden_size, model.q_hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    attention = [(q / tp, h), (kv / tp, h), (kv / tp, h), (h, q / tp)]
    mlp = [(f / tp, h), (f / tp, h), (h, f / tp)] if model.gated_mlp else [(f / tp, h), (h, f / tp)]
    return attention + mlp


def saved_projections(model, tp) -> list[tuple]:
    return projections(model, tp)[0::2]


def recomputed_projections(model, tp) -> list[tuple]:
    return projections(model, tp)[1::2]


def kept_units(model, tp, block_input, sequence_parallel: bool, flash, lse):
    """(what a block keeps, the part of it a block without recompute does not keep), in units
    of ``s b h`` elements of the training dtype x 2 (the unit of
    :func:`~memx_launch.planning.costmodel.activation_bytes`): its input (``block_input``, what
    full recompute keeps), the saved projections' outputs, the fused attention kernel's output and
    ``lse`` (its logsumexp, in the same unit), and the two reduce-scatters' outputs under
    sequence parallelism. Autograd alone keeps neither the down projection's output nor the
    reduce-scatters' (their backward needs no input)."""
    tp = np.asarray(tp, dtype=np.float64)
    h = model.hidden_size
    saved = [2.0 * n / h for n, _ in saved_projections(model, tp)]
    attention = np.where(flash, 2.0 * model.q_hidden_size / h / tp + lse, 0.0)
    reduce_scattered = np.where(tp > 1, 2.0 * 2.0 / tp, 0.0) if sequence_parallel else 0.0
    only_here = saved[-1] + reduce_scattered if model.gated_mlp else reduce_scattered
    return block_input + sum(saved) + attention + reduce_scattered, only_here
