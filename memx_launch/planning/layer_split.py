"""The uneven layer split of a pipeline: as many layers per stage as its memory holds, the
slowest stage as fast as it can be. No torch import."""

from __future__ import annotations

import numpy as np


def balance_layers(t_layer, edge_t, max_layers, num_layers, min_layers=1, unit=1):
    """Uneven split minimising the slowest stage under each stage's memory limit.

    Stage i can hold its k-th layer once the bottleneck time T reaches k t_i + edge_i; the least
    T at which the stages, each between its minimum and its memory limit, hold ``num_layers``
    is the smallest of these times that counts them all, and any surplus (stages whose times
    tie there) is taken back from the slowest stages. Rows are independent candidates.
    ``unit``: layers that stay on one stage together (a Gated DeltaNet model's blocks, 2), each
    stage a multiple. Returns (layers (C, P) int, feasible (C,) bool).
    """
    if unit > 1:
        layers, feasible = balance_layers(t_layer * unit, edge_t, max_layers // unit, num_layers // unit,
                                          -(-min_layers // unit))
        return layers * unit, feasible
    max_layers = np.minimum(np.maximum(max_layers, 0), num_layers)
    lower = np.broadcast_to(np.asarray(min_layers, dtype=np.float64), max_layers.shape)
    # Each stage's minimum fits, the limits hold every layer, the minimums do not exceed them.
    feasible = ((max_layers >= lower).all(axis=1) & (max_layers.sum(axis=1) >= num_layers)
                & (lower.sum(axis=1) <= num_layers))
    upper = np.maximum(max_layers, lower)
    # When each stage could take each layer count above its minimum, up to its limit: the
    # (num_layers - minimums)-th soonest of them all is the bottleneck time (inf: never).
    counts = np.arange(lower.min() + 1.0, upper.max() + 1.0) if upper.size else np.zeros(0)
    when = counts * t_layer[..., None] + np.broadcast_to(edge_t, t_layer.shape)[..., None]
    allowed = (counts > lower[..., None]) & (counts <= upper[..., None])
    when = np.where(allowed, when, np.inf)
    rows = np.arange(len(when))
    need = num_layers - lower.sum(axis=1)
    ordered = np.sort(when.reshape(len(when), -1), axis=1)
    ordered = np.concatenate([ordered, np.full((len(when), 1), np.inf)], axis=1)  # past the last: never
    pick = np.clip(need - 1, 0, ordered.shape[1] - 1).astype(np.int64)
    bottleneck = np.where(need > 0, ordered[rows, pick], -np.inf)
    layers = lower + (allowed & (when <= bottleneck[:, None, None])).sum(axis=2)  # no time: every allowed
    surplus = layers.sum(axis=1) - num_layers
    while (surplus > 0).any():
        active = surplus > 0
        time_now = np.where(layers > min_layers, layers * t_layer + edge_t, -np.inf)
        worst = time_now.argmax(axis=1)
        layers[rows[active], worst[active]] -= 1
        surplus = surplus - active
    # Infeasible rows: spread the layers by memory room, so the shortfall can be reported.
    room = np.maximum(max_layers, 0) + 1e-9
    spread = np.floor(room / room.sum(axis=1, keepdims=True) * num_layers)
    spread[:, 0] += num_layers - spread.sum(axis=1)
    layers = np.where(feasible[:, None], layers, np.maximum(spread, min_layers))
    return layers.astype(np.int64), feasible


def chunk_layers(layers, v: int) -> np.ndarray:
    """(..., P, v) the layers of each virtual chunk of each stage of ``layers`` (..., P): as even
    as possible, larger chunks first; on the first of several stages smaller ones first, as the
    embedding takes a layer's place in its first chunk (Megatron's
    ``account_for_embedding_in_pipeline_split``; a chunk of the embedding alone where the stage
    holds one layer less than its chunks). The split the exports write and scoring counts by."""
    layers = np.asarray(layers, dtype=np.int64)
    base, extra = np.divmod(layers[..., None], v)
    chunks = base + (np.arange(v) < extra)
    if layers.shape[-1] > 1:
        chunks[..., 0, :] = chunks[..., 0, ::-1].copy()
    return chunks
