"""What one pipeline edge costs per micro-batch and direction: the stage boundary's activation
(or its gradient) sent to the next stage, whole, or partitioned over the TP ranks (DeepSpeed's
pipeline engine: ``pipe_partitioned`` / ``grad_partitioned``, on by default with TP; memx-run,
where a partitioned edge between vendors stages a TP-th of the bytes through the host): each TP
rank sends 1/TP of it and the receiving stage all-gathers it over its TP group. Between stages
of different TP degrees each rank pair sends the whole once and the larger stage broadcasts it
over its TP group (memx-run's links, runtime/pipeline_stage.py). memx-run partitions only the
edges where that is priced faster (``partition_where_faster``): where a TP group's own link is no
faster than the link between stages, the all-gather costs what the smaller send saved. No torch
import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.bridge import BridgePricing
from memx_launch.planning.collectives import NVLINK, PCI, collective_seconds
from memx_launch.planning.costmodel import p2p_time
from memx_launch.planning.tp_links import tp_link
from memx_launch.planning.layouts import Layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def send_parts(training: TrainingSpec, stage_tp) -> np.ndarray:
    """(P,) the parts each stage's send to the next (the last: the wrap-around) may be split into:
    the TP degree where both ends have it and the setup partitions its sends (``partitioned_sends``),
    else 1, the whole tensor from every TP rank (a resharding sender between TP degrees; sequence
    parallelism, whose sends are split over TP already)."""
    tp = np.asarray(stage_tp, dtype=np.int64)
    if not training.partitioned_sends or training.sequence_parallel:
        return np.ones_like(tp)
    return np.where(tp == np.roll(tp, -1), tp, 1)


class StageSends:
    """The sends between pipeline stages on one cluster (memx-run's, runtime/pipeline_stage.py):
    TP rank t of a stage sends to TP rank t of the next, for t below the smaller TP degree, a
    part or the whole, and the receiving stage completes it over its TP group: all-gathers the
    parts of a partitioned edge, or, over an edge between TP degrees, broadcasts from the ranks
    that received to the rest. Each receiving group's collective is kept once priced: the search
    asks the same ones again."""

    def __init__(self, cluster: ClusterSpec, bridges: BridgePricing):
        self.cluster = cluster
        self.bridges = bridges
        self.given_parts: np.ndarray | None = None
        """(P,) the parts to price each edge's sends in (a plan file's ``send_parts``); None: chosen."""
        self._collectives: dict[tuple[str, float, str, int], float] = {}

    def receiving_seconds(self, nbytes, stage_tp, parts, device_types) -> np.ndarray:
        """(P,) seconds each edge's receiving stage takes to complete one transfer of ``nbytes``
        (one value, or one per edge) over its TP group: the all-gather of a partitioned edge's
        ``parts``; on an edge between TP degrees the broadcast over the larger group, which only
        the transfers toward it run (half of it is charged each way); else 0. ``device_types()``:
        each stage's device type name, asked only where some edge needs a collective (the
        search's hot path needs none)."""
        tp, parts = np.asarray(stage_tp), np.asarray(parts)
        nxt = np.roll(tp, -1)
        if (parts == 1).all() and (tp == nxt).all():
            return np.zeros(tp.shape)
        names = list(device_types())
        seconds = np.zeros(tp.shape)
        for k, edge_bytes in enumerate(np.broadcast_to(nbytes, tp.shape)):
            if parts[k] > 1:
                seconds[k] = self._collective("all_gather", edge_bytes, names[(k + 1) % len(names)], int(parts[k]))
            elif tp[k] != nxt[k]:
                larger = names[(k + 1) % len(names)] if nxt[k] > tp[k] else names[k]
                seconds[k] = 0.5 * self._collective("broadcast", edge_bytes, larger, int(max(tp[k], nxt[k])))
        return seconds

    def _collective(self, op: str, nbytes: float, device_type: str, tp: int) -> float:
        key = (op, float(nbytes), device_type, tp)
        if key not in self._collectives:
            link = tp_link(self.cluster, device_type, tp)
            hop = PCI if link.over_pcie else NVLINK
            self._collectives[key] = float(collective_seconds(op, nbytes, tp, link.gbps * self.cluster.link_efficiency,
                                                              1, hop))
        return self._collectives[key]

    def transfers(self, layout: Layout, nbytes, v: int, training: TrainingSpec, device_types) -> tuple:
        """((P,) seconds of one transfer of ``nbytes`` (one value, or one per edge) from each stage
        to the next (the last: interleaving's wrap-around), (P,) the parts each is sent in): every
        edge in :func:`send_parts`' parts, or with ``partition_where_faster`` those where that is
        faster than whole sends; ``given_parts`` where set."""
        if self.given_parts is not None:
            return self._transfers(layout, nbytes, v, self.given_parts, device_types), self.given_parts
        parts = send_parts(training, layout.stage_tp)
        split = self._transfers(layout, nbytes, v, parts, device_types)
        if not training.partition_where_faster or (parts == 1).all():
            return split, parts
        whole = self._transfers(layout, nbytes, v, np.ones_like(parts), device_types)
        faster = split < whole
        return np.where(faster, split, whole), np.where(faster, parts, 1)

    def _transfers(self, layout: Layout, nbytes, v: int, parts, device_types) -> np.ndarray:
        """(P,) :meth:`seconds` of each edge, where it crosses domains over the bridge instead: its
        part staged through host memory and sent, then completed natively."""
        nbytes = np.broadcast_to(nbytes, (layout.pp,))
        receiving = self.receiving_seconds(nbytes, layout.stage_tp, parts, device_types)
        transfer = self._over_links(nbytes, layout.next_stage_gbps, parts, receiving)
        for edge in layout.edge_crossings:
            k = edge.stage
            if k < layout.pp - 1 or v > 1:
                # The wrap-around carries v - 1 of each micro-batch's v passes; the schedule charges v.
                share = (v - 1) / v if k == layout.pp - 1 else 1.0
                transfer[k] = share * (self.bridges.edge_link(edge).transfer_time(nbytes[k] / parts[k]) + receiving[k])
        return transfer

    def seconds(self, nbytes, next_stage_gbps, stage_tp, parts, device_types) -> np.ndarray:
        """(P,) seconds of one send of ``nbytes`` (one value, or one per edge) from each stage to
        the next (``next_stage_gbps``, inf for none) in :func:`send_parts`' ``parts``: a part over
        the link, then the receiving stage's collective (:meth:`receiving_seconds`)."""
        return self._over_links(nbytes, next_stage_gbps, parts,
                                self.receiving_seconds(nbytes, stage_tp, parts, device_types))

    def _over_links(self, nbytes, next_stage_gbps, parts, receiving) -> np.ndarray:
        gbps = np.asarray(next_stage_gbps, dtype=np.float64) * self.cluster.link_efficiency
        return p2p_time(np.asarray(nbytes) / parts, gbps) + np.where(np.isinf(gbps), 0.0, receiving)


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
    ``seq_length // tp``). A mixture's load-balancing sums go along (``router_aux_loss``: 2 x
    experts fp32, whatever the training's precision)."""
    nbytes = edge_micro_batch(layout, mbs) * (seq // layout.cp) * model.hidden_size * training.residual_bytes
    router_sums = 8.0 * model.num_experts if model.router_aux_loss else 0.0
    return (nbytes / layout.tp if training.sequence_parallel and layout.uniform_tp else nbytes) + router_sums
