"""Blocks beside a model's repeated block: a mixture of experts' dense first blocks (DeepSeek's
``first_k_dense_replace``), which the first stage holds, and the multi-token prediction modules'
blocks, which the last stage runs after the head. A split counts the model's blocks, dense
first ones included; a stage's bytes and seconds are its layers at the repeated block's cost
plus :func:`beside_repeated`. No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.specs.model import ModelSpec


def first_stage_min_layers(model: ModelSpec, v: int) -> int:
    """Blocks the first stage must hold for every dense first block to be in its first chunk
    (Megatron builds the blocks in order, chunk by chunk), its other chunks a block each (the
    export puts them there: ``exporters.stage_chunks``)."""
    return model.dense_layers + v - 1 if model.dense_layers else 0


def stage_block_counts(model: ModelSpec, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense first, repeated) blocks of each stage of ``layers`` (..., P): the first stage's
    dense ones, and every other block with the last stage's multi-token prediction blocks."""
    first = np.zeros(np.shape(layers))
    first[..., 0] = model.dense_layers
    repeated = layers - first
    repeated[..., -1] += model.mtp_layers
    return first, repeated


def beside_repeated(model: ModelSpec, repeated_cost, dense_cost):
    """What a stage's blocks cost beyond ``layers x repeated_cost``: on the first stage its dense
    blocks' difference (``dense_cost`` a dense block's), on the last the multi-token prediction
    blocks. Per-block costs broadcast to (..., P): bytes or seconds. 0 for a model without either."""
    if not (model.dense_layers or model.mtp_layers):
        return 0.0
    dense = np.asarray(dense_cost if model.dense_layers else 0.0, dtype=np.float64)
    repeated, dense = np.broadcast_arrays(np.asarray(repeated_cost, dtype=np.float64), dense)
    out = np.zeros(repeated.shape)
    out[..., 0] += model.dense_layers * (dense[..., 0] - repeated[..., 0])
    out[..., -1] += model.mtp_layers * repeated[..., -1]
    return out


def mtp_input_bytes(model: ModelSpec, training, inflight, mbs, seq):
    """Bytes the multi-token prediction modules keep beside their blocks on the last stage, per
    micro-batch in flight: each module's embedding lookup (h) and the two normed inputs its
    projection reads (2h)."""
    if not model.mtp_layers:
        return 0.0
    return model.mtp_layers * inflight * mbs * seq * 3.0 * model.hidden_size * training.dtype_bytes
