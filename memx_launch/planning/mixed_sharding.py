"""Layouts whose stages run two trainings: memx-run shards a stage with TP > 1 and DP > 1 (FSDP2)
unless its DP group spans communication domains, whose gradients it averages itself, whole
(``layout_training.py``). Such a layout is scored stage by stage: each stage's memory, layer and
stage times, gradient sync and optimizer step from the evaluator of the training it runs, its send
and the hidden states its pipeline engine keeps at the precision they have there
(:func:`training_precision_senders`, :meth:`MixedShardingEvaluator.hidden_precision_bytes`).
No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.activations import recomputed_layers, training_activation_bytes
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.layout_training import layout_sharded_stages, training_precision_senders
from memx_launch.planning.memory_parts import with_later_moments
from memx_launch.planning.pipeline_buffers import boundary_bytes, kept_stage_output_bytes
from memx_launch.planning.plan import NONE
from memx_launch.planning.scoring import Evaluator


class MixedShardingEvaluator(Evaluator):
    """Scores layouts some of whose stages run fully sharded (``sharded``'s training) and the
    others as given (``whole``'s); the layout's training is the given one, as its plan records."""

    def __init__(self, whole: Evaluator, sharded: Evaluator):
        super().__init__(whole.model, whole.cluster, whole.training, whole.cost_model, whole.table,
                         whole.memory_headroom, whole.recompute_levels, whole.recompute_some_layers)
        self.whole, self.sharded = whole, sharded
        self._kinds_layout, self._kinds = None, {}

    @property
    def tables(self):
        return self.whole.table, self.sharded.table

    def _stage_kinds(self, layout) -> dict:
        """The latest layout's sharded stages, its senders at the training's precision, its whole
        stages that receive narrower hidden states than their own pricing's (``narrowed``: behind a
        sharded stage, under autocast) and, by (mbs, seq, v), :meth:`hidden_precision_bytes`: kept,
        as the search asks each of its groups at several recompute levels."""
        if self._kinds_layout is not layout:
            sharded = layout_sharded_stages(self.training, layout)
            senders = training_precision_senders(self.training, layout)
            wider = self.training.residual_bytes > self.sharded.training.residual_bytes
            self._kinds_layout = layout
            self._kinds = {"sharded": sharded, "senders": senders, "narrowed": ~senders & ~sharded & wider,
                           "buffers": {}}
        return self._kinds

    def _schedule(self, layout, mbs, seq, v) -> tuple:
        """(local micro-batch, TP degrees, in-flight micro-batches, micro-batches per step) of the
        whole training's evaluator, which keeps them for the layout it last priced."""
        tp, _, local, inflight, *_, g = self.whole._level_free_inputs(layout, mbs, seq, v, 0)
        return local, tp, inflight, g

    def _by_stage(self, layout, whole: tuple, sharded: tuple) -> tuple:
        stages = self._stage_kinds(layout)["sharded"]
        return tuple(np.where(stages, s, w) for w, s in zip(whole, sharded))

    def send_in(self, parts) -> None:
        self.whole.send_in(parts)
        self.sharded.send_in(parts)

    def tied_sum_bytes(self, layout) -> float:
        """The first stage's training's: a whole first stage sums its whole tied gradient, a sharded
        one its shard."""
        ends = self.sharded if self._stage_kinds(layout)["sharded"][0] else self.whole
        return ends.tied_sum_bytes(layout)

    def split_inputs(self, layout, mbs, seq, v, levels, replica=0, layers=None):
        whole = self.whole.split_inputs(layout, mbs, seq, v, levels, replica, layers)
        sharded = self.sharded.split_inputs(layout, mbs, seq, v, levels, replica, layers)
        per_layer, fixed, t_layer, edge_t, work = self._by_stage(layout, whole[:4] + whole[5:6],
                                                                 sharded[:4] + sharded[5:6])
        kept, working = self.narrowed_stream_bytes(layout, mbs, seq, v, levels)
        hidden = self.hidden_precision_bytes(layout, mbs, seq, v)
        later = None  # a stage whose casts do not wait: its activations' line there, which binds anyway
        if whole[6] is not None or sharded[6] is not None:
            later = self._by_stage(layout, whole[6] or whole[:2], sharded[6] or sharded[:2])
            later = (later[0] + kept, later[1] + hidden)
        return per_layer + kept, fixed + working + hidden, t_layer, edge_t, whole[4], work + working, later  # one g

    def step_line(self, layout, mbs, seq, v, replica=0, layers=None):
        return self._by_stage(layout, self.whole.step_line(layout, mbs, seq, v, replica, layers),
                              self.sharded.step_line(layout, mbs, seq, v, replica, layers))

    def narrowed_stream_bytes(self, layout, mbs, seq, v, levels) -> tuple:
        """((C, P) kept bytes per layer, its in-flight micro-batches' worth, and (C, P) working bytes)
        that a whole stage behind a sharded one holds apart from its own pricing: its blocks
        receive and add 16-bit hidden states (:func:`training_precision_senders`), so full
        recompute keeps a 16-bit block input and the backward's residual gradients are 16-bit
        (``stream_bytes`` of :func:`~memx_launch.planning.activations.activation_bytes`); zero on
        the other stages. Its time is its own pricing's, whose element-wise traffic is counted in
        the training dtype either way."""
        narrowed = self._stage_kinds(layout)["narrowed"]
        if not narrowed.any():
            return np.zeros(np.shape(levels)), np.zeros(np.shape(levels))
        local, tp, inflight, _ = self._schedule(layout, mbs, seq, v)
        block = (self.model, self.training, local, seq // layout.cp, tp, levels)
        received = training_activation_bytes(*block, stream_bytes=self.sharded.training.residual_bytes)
        priced = training_activation_bytes(*block)
        return (np.where(narrowed, inflight * (received.activation_bytes - priced.activation_bytes), 0.0),
                np.where(narrowed, received.working_bytes - priced.working_bytes, 0.0))

    def stage_step_parts(self, layout, mbs, seq, v, stage_time, layers) -> tuple:
        whole = self.whole.stage_step_parts(layout, mbs, seq, v, stage_time, layers)
        sharded = self.sharded.stage_step_parts(layout, mbs, seq, v, stage_time, layers)
        stage_time, _, sync, exposed, step, _ = self._by_stage(layout, whole, sharded)
        senders = self._stage_kinds(layout)["senders"]
        transfer, parts = (np.where(senders, whole[k], sharded[k]) for k in (1, 5))
        return stage_time, transfer, sync, exposed, step, parts

    def hidden_precision_bytes(self, layout, mbs, seq, v) -> np.ndarray:
        """(P,) how the pipeline engine's buffers change where hidden states change precision (fp32
        under autocast, 16 bits from the first sharded stage on). The first sharded stage behind
        whole ones keeps each received fp32 input until its micro-batch's backward (torch's pipeline
        stage's ``fwd_cache``) beside FSDP2's 16-bit cast of it, which its first block keeps with the
        layers; interleaved, only its first chunk receives them, at most P micro-batches in flight.
        A whole stage behind a sharded one keeps its outputs (``keep_stage_outputs``) in the 16 bits
        it received, not at the fp32 its own pricing counts: negative."""
        kinds = self._stage_kinds(layout)
        if (mbs, seq, v) not in kinds["buffers"]:
            change = self._hidden_precision_bytes(layout, mbs, seq, v, kinds["senders"], kinds["narrowed"])
            change.flags.writeable = False
            kinds["buffers"][mbs, seq, v] = change
        return kinds["buffers"][mbs, seq, v]

    def _hidden_precision_bytes(self, layout, mbs, seq, v, senders, narrowed) -> np.ndarray:
        pp, tr = layout.pp, self.training
        if senders.all() or tr.residual_bytes <= self.sharded.training.residual_bytes:
            return np.zeros(pp)
        local, tp, inflight, g = self._schedule(layout, mbs, seq, v)
        seq_rank = seq // layout.cp
        whole_kept, sharded_kept = (kept_stage_output_bytes(self.model, training, local, seq_rank, tp, inflight, g, v)
                                    for training in (tr, self.sharded.training))
        out = np.where(narrowed, sharded_kept - whole_kept, 0.0)
        first = int(np.argmin(senders))  # the first sharded stage
        if first > 0:
            first_chunk = inflight[first] if v == 1 else min(pp, g)
            out[first] += first_chunk * boundary_bytes(self.model, tr, local, seq_rank, tp, (pp,))[first]
        return out

    def memory_parts(self, result: GroupResult, row: int = 0) -> list[dict[str, float]]:
        layout = result.layout
        stages = self._stage_kinds(layout)["sharded"]
        change = self.hidden_precision_bytes(layout, result.mbs, result.seq, result.v)
        parts = [dict(s if shards else w) for w, s, shards in zip(self.whole.memory_parts(result, row),
                                                                  self.sharded.memory_parts(result, row), stages)]
        layers, levels = result.layers[row], result.levels[row:row + 1]
        per_layer, working = (x[0] for x in self.narrowed_stream_bytes(layout, result.mbs, result.seq, result.v, levels))
        kept = layers * per_layer
        if result.recompute_layers is not None:  # r layers at the level (the first, or every N-th), the rest at none
            none_layer, none_working = (x[0] for x in self.narrowed_stream_bytes(
                layout, result.mbs, result.seq, result.v, np.full_like(levels, NONE)))
            r = recomputed_layers(layers, result.recompute_layers[row],
                                  None if result.recompute_every is None else result.recompute_every[row])
            kept, working = r * per_layer + (layers - r) * none_layer, np.where(r > 0, working, none_working)
        for stage, extra, activations in zip(parts, change, kept + working * (layers > 0)):
            stage["pipeline_buffers"] += float(extra)
            stage["activations"] += float(activations)
        return with_later_moments(self, result, row, parts)
