"""What one pipeline edge costs per micro-batch and direction: the stage boundary's activation
(or its gradient) sent to the next stage, whole, or partitioned over the TP ranks as DeepSpeed's
pipeline engine sends it (``pipe_partitioned`` / ``grad_partitioned``, on by default with TP):
each TP rank sends 1/TP of it and the receiving stage all-gathers it over its TP group. No torch
import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.collectives import NVLINK, PCI, collective_seconds
from memx_launch.planning.costmodel import p2p_time
from memx_launch.planning.tp_links import tp_link_gbps, tp_over_pcie
from memx_launch.planning.layouts import Layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def stage_send_seconds(cluster: ClusterSpec, training: TrainingSpec, nbytes, next_stage_gbps, receivers,
                       tp: int | None) -> np.ndarray:
    """(P,) seconds of one send of ``nbytes`` (one value, or one per edge) from each stage to the
    next (``next_stage_gbps``, inf for none).
    ``receivers()``: the device type name of each stage's next stage, asked only for partitioned
    sends (the search's hot path needs none); ``tp``: the TP degree of every stage, None where
    stages differ (the whole tensor crosses once: a resharding sender). Partitioned sends
    (``training.partitioned_sends``) with TP > 1: 1/TP of the bytes over the link, then the
    receiver's TP all-gather of the whole."""
    gbps = np.asarray(next_stage_gbps, dtype=np.float64) * cluster.link_efficiency
    if not training.partitioned_sends or tp is None or tp == 1:
        return p2p_time(nbytes, gbps)
    gather = np.array([collective_seconds("all_gather", edge_bytes, tp, tp_link_gbps(cluster, name, tp)
                                          * cluster.link_efficiency, 1,
                                          PCI if tp_over_pcie(cluster, name, tp) else NVLINK)
                       for edge_bytes, name in zip(np.broadcast_to(nbytes, gbps.shape), receivers())])
    return p2p_time(nbytes / tp, gbps) + np.where(np.isinf(gbps), 0.0, gather)


def edge_micro_batch(layout: Layout, mbs: int):
    """Sequences a rank sends or receives per micro-batch over each pipeline edge (the last: the
    wrap-around): ``mbs``, or (P,) the larger side's local micro-batch where stages' DP differ."""
    if layout.stage_dp is None:
        return mbs
    local = layout.local_micro_batch(mbs)
    return np.maximum(local, np.roll(local, -1))


def edge_hidden_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, mbs: int, seq: int):
    """Hidden-state bytes (fp32 under autocast) a rank sends per micro-batch over each edge
    (:func:`edge_micro_batch`), whole between stages of different TP (a resharding sender, as
    Sailor's); a CP rank's seq / cp tokens. With sequence parallelism each TP rank sends its own
    1/TP of the sequence to its peer of the next stage (Megatron's pipeline tensor shapes:
    ``seq_length // tp``)."""
    nbytes = edge_micro_batch(layout, mbs) * (seq // layout.cp) * model.hidden_size * training.residual_bytes
    return nbytes / layout.tp if training.sequence_parallel and layout.uniform_tp else nbytes
