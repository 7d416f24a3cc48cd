"""Per-layer costs of every signature a search (or estimate) can ask, from one cost-model call:
device type x TP x local micro-batch x rank sequence x recompute level, looked up by index."""

from __future__ import annotations

import numpy as np

from memx_launch.planning import costmodel as cm


class CostTable:
    """Per-layer costs of every signature in the space, from one cost-model call."""

    def __init__(self, cost_model: cm.LayerCostModel, n_devices: int, tps, mbss, seqs):
        self.tps, self.mbss, self.seqs = list(tps), list(mbss), list(seqs)
        self.cost_model, self.n_devices, self._attention = cost_model, n_devices, None
        grid = np.meshgrid(np.arange(n_devices), self.tps, self.mbss, self.seqs, [0, 1, 2], indexing="ij")
        shape = grid[0].shape
        cost = cost_model.layer_costs(*(g.ravel() for g in grid))
        self.time = np.asarray(cost.time_s, dtype=float).reshape(shape)
        self.act = np.asarray(cost.activation_bytes, dtype=float).reshape(shape)
        self.work = np.asarray(cost.working_bytes, dtype=float).reshape(shape)
        self.misses = self.time.size
        self.hits = 0
        # Layers priced beside the repeated one (a mixture's dense blocks, a hybrid model's kinds): their own costs.
        self.kinds = [CostTable(other, n_devices, tps, mbss, seqs) for other in getattr(cost_model, "other_kinds", [])]

    def lookup(self, device, tp, mbs, seq, level):
        """Index arrays broadcast together (``tp`` and ``mbs`` a value or an array of them);
        counts every element served as a hit."""
        key = (device, _index(self.tps, tp), _index(self.mbss, mbs), self.seqs.index(seq), level)
        t, a, w = self.time[key], self.act[key], self.work[key]
        self.hits += np.size(t)
        return t, a, w

    def attention(self, device, tp, mbs, seq):
        """The fused attention kernel's (forward, backward) seconds (``attention_seconds``), for
        the whole grid at the first call: only CP layouts ask."""
        if self._attention is None:
            grid = np.meshgrid(np.arange(self.n_devices), self.tps, self.mbss, self.seqs, indexing="ij")
            seconds = self.cost_model.attention_seconds(*(g.ravel() for g in grid))
            self._attention = [np.reshape(t, grid[0].shape) for t in seconds]
        key = (device, _index(self.tps, tp), _index(self.mbss, mbs), self.seqs.index(seq))
        return self._attention[0][key], self._attention[1][key]


def _index(values: list, wanted):
    """Where ``wanted`` (a value or an array of them) sits in ``values``."""
    if np.ndim(wanted) == 0:
        return values.index(wanted)
    return np.array([values.index(w) for w in np.ravel(wanted)]).reshape(np.shape(wanted))
