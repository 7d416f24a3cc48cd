"""What one step of a scored plan sends between communication domains (plans' ``crossings``)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from memx_launch.planning import costmodel as cm, data_parallel
from memx_launch.planning.hybrid_sharding import shard_groups, shards_in_part
from memx_launch.planning.model_states import parameters_per_rank, reduced_gradient_bytes
from memx_launch.planning.plan import Crossing
from memx_launch.planning.pipeline_sends import edge_hidden_bytes
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.layout_training import training_precision_senders
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def crossings_of(result: GroupResult, row: int, model: ModelSpec, training: TrainingSpec,
                 cluster: ClusterSpec) -> list[Crossing]:
    """What one step of a scored row sends between communication domains, per crossing
    pipeline edge (forward and backward, every micro-batch) and DP group (its gradients, or
    sharded within its domains, a rank's reduced shard: planning/hybrid_sharding.py), with its seconds."""
    layout = result.layout
    if result.transfer is None:
        return []
    g = training.global_batch_size // (layout.dp * result.mbs)
    # Each edge sends what its sender holds (from a stage memx-run shards on, 16-bit hidden states),
    # each TP rank a TP-th of it where the plan partitions the edge.
    sharded = dataclasses.replace(training, fully_sharded=True)
    hidden_bytes = np.where(training_precision_senders(training, layout),
                            edge_hidden_bytes(model, training, layout, result.mbs, result.seq),
                            edge_hidden_bytes(model, sharded, layout, result.mbs, result.seq)) / result.send_parts
    out = []
    ranks = [list(r) for r in layout.stage_ranks]
    for edge in layout.edge_crossings:
        wrap = edge.stage == layout.pp - 1
        passes = result.v - 1 if wrap else result.v  # per micro-batch and direction
        if passes:  # each rank pair sends both ways: the sender its activations, the receiver their gradients
            nxt = (edge.stage + 1) % layout.pp
            out.append(Crossing("pipeline", [edge.stage, nxt], sorted({d for p in edge.domain_pairs for d in p}),
                                float(g * passes * hidden_bytes[edge.stage]),
                                float(2.0 * g * result.v * result.transfer[edge.stage]),
                                senders=2 * min(len(ranks[edge.stage]), len(ranks[nxt]))))
    params = parameters_per_rank(model, training, layout, result.layers[row:row + 1], result.v)[0]
    trained = cm.trained_parameters(model, training)
    shards = shard_groups(cluster, layout, training) if layout.group_crossings and shards_in_part(training, layout) \
        else None
    for group in layout.group_crossings:
        replicas = shards.bridged.get(group.stage) if shards is not None else None
        if replicas is None:
            sent = group.bridge_bytes(data_parallel.sync_allreduce_bytes(params[group.stage], training, trained))
        else:
            sent = replicas.bridge_bytes(params[group.stage] * trained.share * reduced_gradient_bytes(training)
                                         / shards.ranks[group.stage])
        shard = 1 if replicas is None else int(shards.ranks[group.stage])
        out.append(Crossing("data_parallel", [group.stage], sorted(d for d, _ in group.domain_sizes),
                            float(sent), float(result.sync[row, group.stage]), None if replicas is None else shard,
                            sync_senders(cluster.rank_domains(), ranks[group.stage],
                                         int(layout.stage_tp[group.stage]), shard)))
    if result.tied_bytes and layout.ends_crossing is not None:
        edge = layout.ends_crossing
        out.append(Crossing("tied_embeddings", [0, layout.pp - 1], sorted({d for p in edge.domain_pairs for d in p}),
                            result.tied_bytes, result.tied_sync_s, senders=2 * min(len(ranks[0]), len(ranks[-1]))))
    return out


def sync_senders(domain: list[str], ranks: list[int], tp: int, shard: int) -> int:
    """The ranks of a stage (``ranks``, replica after replica) that send over the bridge in its
    gradient sync, as memx-run sums across domains (runtime/communication.py): in each DP group
    (one per TP rank) and, where it is sharded within its domains over ``shard`` ranks, among the
    replicas of each shard, every member where each domain holds as many (each sums its piece of
    the buffer over the bridge), else each domain's first."""
    senders = 0
    for t in range(tp):
        group = ranks[t::tp]
        for position in range(shard):
            members = group[position::shard]
            sizes = Counter(domain[r] for r in members)
            if len(sizes) > 1:
                senders += len(members) if len(set(sizes.values())) == 1 else len(sizes)
    return senders
