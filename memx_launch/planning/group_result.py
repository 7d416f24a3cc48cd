"""One scored group of candidates: a layout and its hyper-parameters with every recompute policy
as rows of numpy arrays (``scoring.Evaluator.score``'s result). No torch import."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memx_launch.planning import costmodel as cm
from memx_launch.planning.activations import recomputed_layers
from memx_launch.planning.layouts import Layout
from memx_launch.planning.plan import recompute_text


@dataclass
class GroupResult:
    """All recompute policies of one (layout, micro-batch, seq, schedule, v): rows are policies."""

    layout: Layout
    mbs: int
    seq: int
    schedule: str
    v: int
    levels: np.ndarray      # (C, P) recompute level per stage
    layers: np.ndarray      # (C, P)
    memory: np.ndarray      # (C, P) bytes, on the stage's device type nearest its capacity
    stage_time: np.ndarray  # (C, P) seconds per micro-batch
    T: np.ndarray           # (C,)
    M: np.ndarray           # (C,) max memory fraction
    V: np.ndarray           # (C,) variance of per-device memory, GiB^2
    feasible: np.ndarray    # (C,)
    capacity: np.ndarray    # (C, P) bytes of the device type ``memory`` is on
    recompute_layers: np.ndarray | None = None
    """(C, P) layers of each stage recomputing at its level, the first ones (the rest keep
    everything); None: all of them."""
    transfer: np.ndarray | None = None
    """(P,) seconds of one transfer to the next stage (:meth:`Evaluator.iteration_parts`);
    kept where the layout crosses communication domains."""
    sync: np.ndarray | None = None
    """(C, P) seconds of each stage's gradient sync; kept where the layout crosses domains."""
    memory_replica: np.ndarray | None = None
    """(C, P) the row of the layout's ``replica_device`` that ``memory`` is on, where a stage's
    replicas sit on several device types; None: the first (the only one)."""
    tied_sync_s: float = 0.0
    """Seconds the first and the last stage sum their tied gradients (:meth:`Evaluator.tied_sync_time`)."""
    experts: tuple[int, int] = (1, 1)
    """The expert-parallel and expert-tensor-parallel degrees the group was scored at (a mixture of
    experts' search tries several)."""
    shard_degree: int | None = None
    """Hybrid sharding's degree the group was scored at (``SearchSpace.shard_degrees`` tries several)."""
    send_parts: np.ndarray | None = None
    """(P,) the parts each stage's transfer to the next is sent in (1: whole), as priced
    (:meth:`~memx_launch.planning.pipeline_sends.StageSends.transfers`)."""
    tied_bytes: float = 0.0
    """Bytes each rank of the first and the last stage sums with the other end (:meth:`Evaluator.tied_sum_bytes`)."""
    recompute_every: np.ndarray | None = None
    """(C, P) where positive, the stage recomputes every that many-th layer (``full:everyN``)
    instead of its first ``recompute_layers``; None: the first ones on every stage."""

    def stage_recompute(self, row: int, stage: int) -> str:
        """The plan's text for a stage's recompute: its level, ``full:K`` for its first K layers or
        ``full:everyN``."""
        level = cm.RECOMPUTE_LEVELS[int(self.levels[row, stage])]
        if self.recompute_layers is None:
            return level
        every = 0 if self.recompute_every is None else int(self.recompute_every[row, stage])
        layers = self.layers[row, stage]
        return recompute_text(level, int(recomputed_layers(layers, self.recompute_layers[row, stage], every)),
                              int(layers), every)
