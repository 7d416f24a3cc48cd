"""The uneven layer split of a pipeline: as many layers per stage as its memory holds, the
slowest stage as fast as it can be. No torch import."""

from __future__ import annotations

import numpy as np

_BISECTION_STEPS = 30


def balance_layers(t_layer, edge_t, max_layers, num_layers, min_layers=1, unit=1):
    """Uneven split minimising the slowest stage under each stage's memory limit.

    Bisection on the bottleneck time T: stage i can take min(max_layers_i, (T - edge_i)/t_i)
    layers; the smallest T whose capacities add up to ``num_layers`` wins, then the surplus
    is taken back from the slowest stages. Rows are independent candidates. ``unit``: layers
    that stay on one stage together (a Gated DeltaNet model's blocks, 2), each stage a multiple.
    Returns (layers (C, P) int, feasible (C,) bool).
    """
    if unit > 1:
        layers, feasible = balance_layers(t_layer * unit, edge_t, max_layers // unit, num_layers // unit,
                                          -(-min_layers // unit))
        return layers * unit, feasible
    max_layers = np.minimum(np.maximum(max_layers, 0), num_layers)
    feasible = (max_layers >= min_layers).all(axis=1) & (max_layers.sum(axis=1) >= num_layers)
    inv_t = 1.0 / t_layer
    offset = edge_t * inv_t
    upper = np.maximum(max_layers, min_layers)
    lo = np.zeros((t_layer.shape[0], 1))
    hi = (num_layers * t_layer + edge_t).max(axis=1, keepdims=True) + 1e-12
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) * 0.5
        take = np.minimum(np.maximum(np.floor(mid * inv_t - offset), min_layers), upper)
        enough = take.sum(axis=1, keepdims=True) >= num_layers
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid)
    layers = np.minimum(np.maximum(np.floor(hi * inv_t - offset), min_layers), upper)
    surplus = layers.sum(axis=1) - num_layers
    rows = np.arange(len(layers))
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
