"""What hybrid sharding over a node would do to the plan ``memx plan`` chose without searching it:
one more prediction of the winner's layout, its states sharded within each node's ranks and
replicated across nodes (``--shard-degree``, planning/hybrid_sharding.py), said in one line where
it is markedly faster and still fits. The search tries shard degrees only when asked
(``--shard-degrees``): each doubles its work, and sharding over the whole group is what every
framework does by default. No torch import.
"""

from __future__ import annotations

import dataclasses
import math

from memx_launch.errors import ConfigError
from memx_launch.planning.estimate import evaluate_plan, stage_short_gib
from memx_launch.planning.layouts import MIXED_SEPARATOR
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

# Faster by less than this and the hint is not worth a line: hybrid sharding keeps more states.
WORTH_SAYING = 0.95


def node_shard_degree(plan: Plan, cluster: ClusterSpec) -> int | None:
    """Replicas whose TP x CP groups fill the smallest node of each stage's device type (one
    degree for every stage: their gcd), where each stage's DP degree is a multiple of it and some
    stage's larger; None where no such degree of two or more exists."""
    degrees = []
    for stage, tp in zip(plan.stages, plan.stage_tps):
        if MIXED_SEPARATOR in stage.device_type:
            return None
        degrees.append(min(cluster.devices_per_node(stage.device_type)) // (tp * plan.cp))
    degree = math.gcd(*degrees)
    dps = plan.stage_dps
    if degree < 2 or any(dp % degree for dp in dps) or max(dps) == degree:
        return None
    return degree


def hybrid_sharding_hint(plan: Plan, cluster: ClusterSpec, training: TrainingSpec, cost_model=None,
                         memory_headroom: float = 0.0) -> str | None:
    """The line under ``memx plan``'s winner where it shards over whole DP groups and the same layout
    sharded within a node's ranks would take under :data:`WORTH_SAYING` of its time and still fit."""
    if training.shard_degree is not None or not (training.fully_sharded or training.distributed_optimizer):
        return None
    degree = node_shard_degree(plan, cluster)
    if degree is None:
        return None
    try:  # the flag's refusals: an option hybrid sharding does not combine with, experts it cannot split
        hybrid = evaluate_plan(plan, cluster, dataclasses.replace(training, shard_degree=degree),
                               cost_model=cost_model, memory_headroom=memory_headroom)
    except ConfigError:
        return None
    faster = hybrid.predicted_iteration_time_s / plan.predicted_iteration_time_s
    if faster >= WORTH_SAYING or any(short > 0 for short in stage_short_gib(hybrid, memory_headroom)):
        return None
    peak = max(s.predicted_peak_memory_gib for s in hybrid.stages)
    return (f"hybrid sharding was not searched: this layout sharded within shard groups of {degree} replicas (a "
            f"node's ranks) would take {hybrid.predicted_iteration_time_s:.3g} s ({100 * (faster - 1):+.0f}%) at "
            f"{peak:.1f} GiB peak, and fits; --shard-degrees {degree} searches it")
