"""Prediction cache: per-block cost predictions keyed by the configuration's signature.

A row's signature packs (device type, TP, micro-batch, sequence length, recompute) into one
int64; the model shape, the device-type set and the batch settings form the context
signature of the whole store, and a change of context empties it (invalidation). Lookups
are vectorised: query rows are deduplicated with ``np.unique``, found in the sorted key
array with ``np.searchsorted``, and only the misses go to the wrapped cost model.
No torch import here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np

from memx_launch.planning.costmodel import TP_DEGREES, LayerCost
from memx_launch.planning.tp_links import tp_link_gbps
from memx_launch.errors import ConfigError

# Bit widths of the packed row signature: device | tp | micro-batch | seq len | recompute.
_FIELDS = (("device", 8), ("tp", 12), ("mbs", 16), ("seq", 24), ("recompute", 2))


def pack_keys(device, tp, mbs, seq, recompute) -> np.ndarray:
    """One int64 signature per row; raises when a value does not fit its field."""
    out = np.zeros(np.broadcast(device, tp, mbs, seq, recompute).shape, dtype=np.int64)
    for (name, bits), values in zip(_FIELDS, (device, tp, mbs, seq, recompute)):
        v = np.asarray(values, dtype=np.int64)
        if v.size and (v.min() < 0 or v.max() >= 1 << bits):
            raise ConfigError(name, f"value {int(v.max())} outside the prediction cache's range",
                              f"keep {name} below {1 << bits}")
        out = (out << bits) | v
    return out


def unpack_keys(keys: np.ndarray) -> list[np.ndarray]:
    """Inverse of :func:`pack_keys`: [device, tp, mbs, seq, recompute]."""
    fields, rest = [], np.asarray(keys, dtype=np.int64)
    for _, bits in reversed(_FIELDS):
        fields.append(rest & ((1 << bits) - 1))
        rest = rest >> bits
    return fields[::-1]


def context_signature(inner) -> str:
    """What every cached value depends on besides its row: model shape, device types and their
    TP links, batch settings, and the predictor's training signature when there is one."""
    payload = {"cost_model": type(inner).__name__, "device_names": list(inner.device_names)}
    model, cluster, training = (getattr(inner, a, None) for a in ("model", "cluster", "training"))
    if model is not None:
        payload["model"] = model.signature()
    if cluster is not None:
        payload["devices"] = [asdict(d) for d in cluster.device_types]
        payload["tp_links"] = [[tp_link_gbps(cluster, d.name, t) for t in TP_DEGREES] for d in cluster.device_types]
        payload["emulation"] = asdict(cluster.emulation) if cluster.emulation else None
    if training is not None:
        payload["training"] = asdict(training)
    predictor = getattr(inner, "predictor", None)
    if predictor is not None:
        payload["predictor"] = predictor.meta.get("training")
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


class PredictionCache:
    """Sorted int64 keys and their [time, activation, working] values; shareable across searches."""

    def __init__(self):
        self.context: str | None = None
        self.keys = np.zeros(0, dtype=np.int64)
        self.values = np.zeros((0, 3))
        self.hits = 0
        """Query rows answered without asking the cost model."""
        self.misses = 0
        """Distinct configurations the cost model had to predict."""
        self.invalidations = 0

    def bind(self, context: str) -> None:
        """Use the store for ``context``; a different context empties it."""
        if context != self.context:
            if self.context is not None:
                self.invalidations += 1
            self.context = context
            self.keys = np.zeros(0, dtype=np.int64)
            self.values = np.zeros((0, 3))

    def __len__(self) -> int:
        return len(self.keys)

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"entries": len(self), "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / total if total else 0.0, "invalidations": self.invalidations}


class CachedCostModel:
    """A ``LayerCostModel`` answering repeated configurations from a :class:`PredictionCache`."""

    def __init__(self, inner, cache: PredictionCache | None = None):
        self.inner = inner
        self.device_names = inner.device_names
        self.cache = cache if cache is not None else PredictionCache()
        self.cache.bind(context_signature(inner))

    def __getattr__(self, name):
        # model, cluster, training, embedding_time, head_time...: whatever the inner model offers.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def for_training(self, training) -> "CachedCostModel":
        """The inner model of ``training``, with a cache of its own."""
        return CachedCostModel(self.inner.for_training(training))

    def layer_costs(self, device, tp, mbs, seq, recompute) -> LayerCost:
        arrays = np.broadcast_arrays(*(np.asarray(a) for a in (device, tp, mbs, seq, recompute)))
        shape = arrays[0].shape
        keys = pack_keys(*(a.reshape(-1) for a in arrays))
        unique, inverse = np.unique(keys, return_inverse=True)
        cache = self.cache
        pos = np.searchsorted(cache.keys, unique)
        found = pos < len(cache.keys)
        found[found] = cache.keys[pos[found]] == unique[found]
        missing = unique[~found]
        if missing.size:
            d, t, b, s, r = unpack_keys(missing)
            cost = self.inner.layer_costs(d, t, b, s, r)
            new_values = np.column_stack([cost.time_s, cost.activation_bytes, cost.working_bytes])
            merged_keys = np.concatenate([cache.keys, missing])
            order = np.argsort(merged_keys, kind="stable")
            cache.keys = merged_keys[order]
            cache.values = np.concatenate([cache.values, new_values])[order]
            pos = np.searchsorted(cache.keys, unique)
        cache.misses += int(missing.size)
        cache.hits += int(keys.size - np.count_nonzero(~found[inverse]))
        values = cache.values[pos][inverse.reshape(-1)]
        return LayerCost(time_s=values[:, 0].reshape(shape), activation_bytes=values[:, 1].reshape(shape),
                         working_bytes=values[:, 2].reshape(shape))
