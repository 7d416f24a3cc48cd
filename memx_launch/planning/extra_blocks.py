"""Blocks beside a model's repeated block: a mixture of experts' dense blocks, the first ones
(DeepSeek's ``first_k_dense_replace``), which the first stage holds, or those between its
expert blocks (Llama 4 Maverick's ``interleave_moe_layer_step``), wherever the split puts them;
and the multi-token prediction modules' blocks, which the last stage runs after the head. A
split counts the model's blocks, dense ones included; a stage's bytes and seconds are its
layers at the repeated block's cost plus :func:`beside_repeated`. No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.layer_split import chunk_layers
from memx_launch.specs.model import ModelSpec


def first_stage_min_layers(model: ModelSpec, v: int) -> int:
    """Blocks the first stage must hold for every dense first block to be in its first chunk
    (Megatron builds the blocks in order, chunk by chunk), its other chunks a block each (the
    export puts them there: ``exporters.first_chunk_at_least``)."""
    return model.dense_layers + v - 1 if model.dense_layers else 0


def interleaved_dense_counts(model: ModelSpec, layers, v: int) -> np.ndarray:
    """(..., P) dense blocks among each stage's ``layers`` (..., P) where they sit between the
    expert ones (``moe_layer_step``): its chunks (:func:`chunk_layers`) hold blocks in model
    order, virtual-stage major (chunk k on stage k mod P), and block ``i`` is an expert one where
    ``(i + 1) % step`` is 0."""
    chunks = chunk_layers(layers, v)                   # (..., P, v)
    ordered = np.swapaxes(chunks, -1, -2)              # (..., v, P): model order once flattened
    flat = ordered.reshape(*ordered.shape[:-2], -1)
    end = np.cumsum(flat, axis=-1)
    experts = end // model.moe_layer_step - (end - flat) // model.moe_layer_step
    return (flat - experts).reshape(ordered.shape).sum(axis=-2)


def dense_blocks_per_stage(model: ModelSpec, pp: int, layers=None, v: int = 1) -> np.ndarray:
    """Each stage's dense blocks: (P,) the first stage's dense first blocks, which no split moves,
    or (..., P) the interleaved ones the split ``layers`` (..., P) in ``v`` chunks gives each
    stage. Before the split is known (``layers`` None) interleaved ones count 0 here:
    :func:`mean_block` prices them."""
    if model.moe_layer_step > 1 and layers is not None:
        return interleaved_dense_counts(model, layers, v).astype(np.float64)
    dense = np.zeros(pp)
    dense[0] = model.dense_layers
    return dense


def stage_block_counts(model: ModelSpec, layers, v: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(dense, repeated) blocks of each stage of ``layers`` (..., P) in ``v`` chunks each
    (:func:`dense_blocks_per_stage`), every other block the repeated one, with the last stage's
    multi-token prediction blocks."""
    dense = dense_blocks_per_stage(model, np.shape(layers)[-1], layers, v)
    repeated = layers - dense
    repeated[..., -1] += model.mtp_layers
    return dense, repeated


def mean_block(model: ModelSpec, repeated_cost, dense_cost):
    """A block's cost on average over a model whose dense blocks sit between its expert ones: what
    a split weighs each block at before it knows which of a stage's blocks are dense."""
    if model.moe_layer_step == 1:
        return repeated_cost
    share = model.dense_block_count / model.num_layers
    return repeated_cost + share * (np.asarray(dense_cost) - repeated_cost)


def beside_repeated(model: ModelSpec, repeated_cost, dense_cost, dense_blocks):
    """What a stage's blocks cost beyond ``layers x repeated_cost``: its ``dense_blocks`` (..., P)
    at their difference (``dense_cost`` a dense block's), and on the last stage the multi-token
    prediction blocks. Per-block costs broadcast to (..., P): bytes or seconds. 0 for a model
    without either."""
    if not (model.dense_block_count or model.mtp_layers):
        return 0.0
    repeated = np.asarray(repeated_cost, dtype=np.float64)
    out = np.zeros(np.broadcast_shapes(repeated.shape, np.shape(dense_blocks)))
    if model.dense_block_count:
        out += dense_blocks * (np.asarray(dense_cost, dtype=np.float64) - repeated)
    out[..., -1] += model.mtp_layers * repeated[..., -1]
    return out


def mtp_input_bytes(model: ModelSpec, training, inflight, mbs, seq):
    """Bytes the multi-token prediction modules keep beside their blocks on the last stage, per
    micro-batch in flight: each module's embedding lookup (h) and the two normed inputs its
    projection reads (2h)."""
    if not model.mtp_layers:
        return 0.0
    return model.mtp_layers * inflight * mbs * seq * 3.0 * model.hidden_size * training.dtype_bytes
