"""Layouts whose stages run two trainings: memx-run shards a stage with TP > 1 and DP > 1 (FSDP2)
unless its DP group spans communication domains, whose gradients it averages itself, whole
(``layout_training.py``). Such a layout is scored stage by stage: each stage's memory, layer and
stage times, send, gradient sync and optimizer step from the evaluator of the training it runs.
No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.layout_training import layout_sharded_stages
from memx_launch.planning.scoring import Evaluator


class MixedShardingEvaluator(Evaluator):
    """Scores layouts some of whose stages run fully sharded (``sharded``'s training) and the
    others as given (``whole``'s); the layout's training is the given one, as its plan records."""

    def __init__(self, whole: Evaluator, sharded: Evaluator):
        super().__init__(whole.model, whole.cluster, whole.training, whole.cost_model, whole.table,
                         whole.memory_headroom, whole.recompute_levels, whole.recompute_some_layers)
        self.whole, self.sharded = whole, sharded

    @property
    def tables(self):
        return self.whole.table, self.sharded.table

    def _by_stage(self, layout, whole: tuple, sharded: tuple) -> tuple:
        stages = layout_sharded_stages(self.training, layout)
        return tuple(np.where(stages, s, w) for w, s in zip(whole, sharded))

    def split_inputs(self, layout, mbs, seq, v, levels, replica=0, layers=None):
        whole = self.whole.split_inputs(layout, mbs, seq, v, levels, replica, layers)
        sharded = self.sharded.split_inputs(layout, mbs, seq, v, levels, replica, layers)
        per_layer, fixed, t_layer, edge_t, work = self._by_stage(layout, whole[:4] + whole[5:], sharded[:4] + sharded[5:])
        return per_layer, fixed, t_layer, edge_t, whole[4], work  # g: the micro-batches per step, one for both

    def stage_step_parts(self, layout, mbs, seq, v, stage_time, layers) -> tuple:
        return self._by_stage(layout, self.whole.stage_step_parts(layout, mbs, seq, v, stage_time, layers),
                              self.sharded.stage_step_parts(layout, mbs, seq, v, stage_time, layers))

    def memory_parts(self, result: GroupResult, row: int = 0) -> list[dict[str, float]]:
        stages = layout_sharded_stages(self.training, result.layout)
        return [s if shards else w for w, s, shards in zip(self.whole.memory_parts(result, row),
                                                           self.sharded.memory_parts(result, row), stages)]
