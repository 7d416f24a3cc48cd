"""The training a layout runs: ``fully_sharded_with_tp`` (memx-run's, whose DDP cannot hold TP's
DTensor parameters) runs a stage with TP > 1 and DP > 1 fully sharded, FSDP2 over its replicas,
so it is priced as ``fully_sharded``: its model states sharded over DP, its 16-bit gathers and no
autocast. A layout whose DP groups each stay in one communication domain runs every stage so (its
plan records the training fully sharded). memx-run averages the gradients of a DP group that spans
domains itself, whole on every replica (no library spans them): in a layout with such a group only
the other stages with TP > 1 shard, and it is priced stage by stage (``mixed_sharding.py``).
No torch import.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from memx_launch.planning.costmodel import AnalyticalCostModel
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec


def sharded_stages(training: TrainingSpec, dp: int, stage_tp, crossing_stages) -> np.ndarray:
    """(P,) which stages run fully sharded where ``training`` does not say so itself: none without
    ``fully_sharded_with_tp`` or without TP > 1 and DP > 1; every stage when no DP group spans
    domains (``crossing_stages``: the stages whose DP group does); else the other stages with TP > 1."""
    stage_tp, crossing = np.asarray(stage_tp), list(crossing_stages)
    if not training.fully_sharded_with_tp or training.fully_sharded or dp < 2 or stage_tp.max() < 2:
        return np.zeros(len(stage_tp), dtype=bool)
    if not crossing:
        return np.ones(len(stage_tp), dtype=bool)
    sharded = stage_tp > 1
    sharded[crossing] = False
    return sharded


def layout_sharded_stages(training: TrainingSpec, layout) -> np.ndarray:
    """:func:`sharded_stages` of a layout."""
    return sharded_stages(training, layout.dp, layout.stage_tp, [group.stage for group in layout.group_crossings])


def tied_ends_sharded_alike(model, training: TrainingSpec, layout) -> bool:
    """Whether memx-run would run the first and the last stage of ``layout`` both fully sharded or
    both whole where they sum the tied embeddings' gradients: each rank sums what it holds, a shard
    or the whole gradient, and the two cannot be summed (``runtime/tied_weights.py`` refuses)."""
    if not model.last_stage_reads_embedding or layout.pp == 1:
        return True
    sharded = layout_sharded_stages(training, layout)
    return bool(sharded[0] == sharded[-1])


def training_precision_senders(training: TrainingSpec, layout) -> np.ndarray:
    """(P,) the stages that send hidden states at ``training``'s own precision (``residual_bytes``:
    fp32 under autocast): those before the first stage memx-run shards. A sharded stage sends its
    16-bit compute precision, and a whole stage behind it passes 16-bit states on (under autocast
    a residual add keeps the received dtype)."""
    return np.cumsum(layout_sharded_stages(training, layout)) == 0


def plan_sharded_stages(training: TrainingSpec, plan) -> list[int]:
    """The stages of ``plan``, priced with ``training``, that memx-run runs fully sharded where
    ``training`` does not say so."""
    crossing = [c.stages[0] for c in plan.crossings if c.kind == "data_parallel"]
    return np.flatnonzero(sharded_stages(training, plan.dp, plan.stage_tps, crossing)).tolist()


def layout_training(training: TrainingSpec, layout) -> TrainingSpec:
    """``training``, fully sharded where every stage of ``layout`` runs so."""
    if layout_sharded_stages(training, layout).all():
        return dataclasses.replace(training, fully_sharded=True)
    return training


def cost_model_of_training(cost_model, model, cluster: ClusterSpec, training: TrainingSpec):
    """A cost model of ``training`` like ``cost_model``: the analytical one where none is given or
    the given one is analytical, else the given one's own (a learned model keeps its predictor)."""
    if cost_model is None or isinstance(cost_model, AnalyticalCostModel):
        return AnalyticalCostModel(model, cluster, training)
    return cost_model.for_training(training)
