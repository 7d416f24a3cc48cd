"""The training a layout runs: ``fully_sharded_with_tp`` (memx-run's, whose DDP cannot hold TP's
DTensor parameters) runs a layout with TP > 1 on a stage and DP > 1 fully sharded, FSDP2 over each
stage's replicas, so it is priced as ``fully_sharded``: its model states sharded over DP, its
16-bit gathers and no autocast. memx-run averages the gradients of a DP group that spans
communication domains itself, whole on every replica (no library spans them): a layout with
such a group keeps the training as given. No torch import.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from memx_launch.planning.bridge import layout_crossings
from memx_launch.planning.costmodel import AnalyticalCostModel
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec


def layout_training(training: TrainingSpec, cluster: ClusterSpec, layout) -> TrainingSpec:
    """``training``, fully sharded where ``fully_sharded_with_tp`` says ``layout`` runs so."""
    if not training.fully_sharded_with_tp or training.fully_sharded or layout.dp < 2 \
            or int(np.max(layout.stage_tp)) < 2:
        return training
    if layout_crossings(cluster, layout.stage_ranks, layout.stage_tp)[1]:  # a DP group spans domains
        return training
    return dataclasses.replace(training, fully_sharded=True)


def cost_model_of_training(cost_model, model, cluster: ClusterSpec, training: TrainingSpec):
    """A cost model of ``training`` like ``cost_model``: the analytical one where none is given or
    the given one is analytical, else the given one's own (a learned model keeps its predictor)."""
    if cost_model is None or isinstance(cost_model, AnalyticalCostModel):
        return AnalyticalCostModel(model, cluster, training)
    return cost_model.for_training(training)
