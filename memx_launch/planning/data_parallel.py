"""Data-parallel synchronisation: what a stage's DP group sends each iteration (or, fully sharded,
each micro-batch, or once a step where a pipeline stage keeps its weights gathered), bucket by
bucket, as NCCL runs it (collectives.py). No torch import."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memx_launch.planning.collectives import (NVLINK, bucketed_seconds, collective_seconds, overlapped_exposed_seconds,
                                              summed_seconds)
from memx_launch.planning import quantization
from memx_launch.planning.matmuls import linear_module_params, mlp_shapes
from memx_launch.planning.model_states import (FULL_TRAINING, TrainedParameters, compute_weight_bytes,
                                               expert_data_parallel, expert_parameters_per_rank, keeps_gathered,
                                               rank_layer_params, reduced_gradient_bytes, trained_parameters)
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def updated_weight_bytes(training: TrainingSpec) -> float:
    """Bytes per weight a sharded optimizer all-gathers after its step: the weights' dtype, the
    FP8 recipe's with ``fp8_params`` (Megatron's ``--fp8-param-gather``)."""
    return quantization.element_bytes(training) if training.fp8_params else training.precision_bytes("weights_dtype")


def gradient_bucket_params(training: TrainingSpec, dp) -> np.ndarray:
    """Parameters per gradient bucket, each bucket its own collective: Megatron's default,
    max(40M, 1M x DP) where gradients are reduced as the backward runs (overlap_grad_reduce),
    else one bucket (megatron/core/distributed/distributed_data_parallel.py)."""
    if not training.overlap_grad_reduce:
        return np.inf
    return np.maximum(40e6, 1e6 * np.asarray(dp, dtype=np.float64))


def stage_gradient_sync(model: ModelSpec, training: TrainingSpec, layout, layers, v: int, stage_params, stage_time,
                        gbps, sm_share, trained: TrainedParameters = FULL_TRAINING, shards=None) -> tuple:
    """(stage time, sync) of each stage (C, P): its time with what a fully sharded run waits on
    every micro-batch, and its gradient synchronisation of one iteration before any overlap with
    the backward, over its DP x CP group on ``gbps`` links, its routed experts' over their expert
    data parallel group (:func:`~memx_launch.planning.model_states.expert_data_parallel`). With
    hybrid sharding (``shards``, :class:`~memx_launch.planning.hybrid_sharding.ShardGroups`) the
    sharded collectives run in the shard groups and each reduced shard is all-reduced over its replicas."""
    tp = layout.tp_degrees
    ranks = layout.dp_cp if shards is None else shards.ranks  # what the sharded states spread over
    link = (ranks, gbps, layout.dp_nodes, layout.dp_hop) if shards is None else \
        (ranks, shards.gbps, shards.nodes, layout.dp_hop)
    replicas = None if shards is None else (shards.replicas, shards.replica_gbps, shards.replica_nodes)
    expert_dp = expert_data_parallel(training, tp, ranks)
    if training.fully_sharded:
        dense, experts = rank_layer_params(model, training, tp)
        fetches = deepspeed_fetches(model, training, tp, stage_params) if training.max_live_params else None
        units = (stage_params, dense + experts, layers, stage_time, training, *link, sm_share, experts, expert_dp,
                 fetches, replicas)
        if keeps_gathered(training, layout.pp):  # gathered once a step and reduced after the last backward
            return stage_time, held_fully_sharded_step_time(*units)
        return stage_time + fully_sharded_exposed_time(*units), np.zeros_like(stage_params)
    experts = expert_parameters_per_rank(model, training, layout, layers, v) if model.num_experts else 0.0
    return stage_time, data_parallel_sync_time(stage_params, training, *link, trained, experts, expert_dp, replicas)


def data_parallel_sync_time(stage_params, training: TrainingSpec, dp, gbps, nodes=1, hop=NVLINK,
                            trained: TrainedParameters = FULL_TRAINING, expert_params=0.0, expert_dp=1,
                            replicas=None) -> np.ndarray:
    """Gradient synchronisation of one iteration over a stage's DP group of ``dp`` ranks on
    ``nodes`` nodes, bucket by bucket (:func:`gradient_bucket_params`), each bucket a collective
    as NCCL runs it (collectives.py: its latency grows with the group). The routed experts'
    ``expert_params`` of them sync over their expert data parallel group of ``expert_dp`` ranks
    instead, on the same links, spread over as many nodes as it has ranks at most.

    Plain data parallel: all-reduce of the gradients (their dtype). Sharded optimizer (ZeRO-1/2,
    Megatron's distributed optimizer): reduce-scatter of the gradients and all-gather of the
    updated weights. Fully sharded: the weights all-gathered for the forward and again for the
    backward in the compute dtype, and the gradients reduce-scattered (one micro-batch's;
    :func:`fully_sharded_exposed_time` times them per layer and micro-batch). Only ``trained``
    parameters have gradients and updated weights; a fully sharded run gathers frozen ones too.
    Hybrid sharding (``replicas``: the ranks, links and nodes of a replica group; ``dp`` etc. then
    a shard group's): each reduced bucket's shard is all-reduced over its replicas besides.
    """
    params = np.asarray(stage_params, dtype=np.float64)
    if np.any(expert_params):  # a dense model (the search's hot path) syncs one group
        experts = np.asarray(expert_params, dtype=np.float64)
        return (data_parallel_sync_time(params - experts, training, dp, gbps, nodes, hop, trained, replicas=replicas)
                + data_parallel_sync_time(experts, training, expert_dp, gbps, np.minimum(expert_dp, nodes), hop,
                                          trained, replicas=replicas))
    bucket = gradient_bucket_params(training, dp)
    grad = reduced_gradient_bytes(training) * trained.share
    if not (training.fully_sharded or training.distributed_optimizer):
        return bucketed_seconds("all_reduce", params * grad, bucket * grad, dp, gbps, nodes, hop)
    gathered = 2.0 * compute_weight_bytes(training) * (1.0 + trained.adapters) if training.fully_sharded \
        else updated_weight_bytes(training) * trained.share
    reduce = "all_reduce" if whole_gradients(training) else "reduce_scatter"
    shard_sync = 0.0 if replicas is None else \
        bucketed_seconds("all_reduce", params * grad / dp, bucket * grad / dp, *replicas, hop)
    return (bucketed_seconds(reduce, params * grad, bucket * grad, dp, gbps, nodes, hop) + shard_sync
            + bucketed_seconds("all_gather", params * gathered, bucket * gathered, dp, gbps, nodes, hop))


def whole_gradients(training: TrainingSpec) -> bool:
    """A sharded setup (its callers' branch) that all-reduces the whole gradients
    (``full_gradient_allreduce``) where it would reduce-scatter them; a fully sharded run always
    reduce-scatters."""
    return training.full_gradient_allreduce and not training.fully_sharded


def fully_sharded_exposed_time(stage_params, layer_params, layers, stage_time, training: TrainingSpec, dp, gbps,
                               nodes=1, hop=NVLINK, sm_share=0.0, expert_params=0.0, expert_dp=1,
                               fetches=None, replicas=None) -> np.ndarray:
    """Seconds per micro-batch a fully sharded stage waits on its DP group beyond its compute.
    Each layer (one FSDP unit of ``layer_params`` on a rank), and the stage's other parameters
    (embedding, head: one unit), all-gathers its weights for the forward and again for the
    backward and reduce-scatters its gradients, every micro-batch; the next unit's gather is
    prefetched while this one computes, so the collectives hide behind ``stage_time`` (one
    micro-batch's forward and backward) except what exceeds it, the first unit's gather, and
    what the compute loses to the ``sm_share`` of the SMs they hold (collectives.py). A mixture's
    routed experts (``expert_params`` of a layer's) are gathered and reduced over their expert
    data parallel group of ``expert_dp`` ranks instead, on the same links, spread over as many
    nodes as it has ranks up to the DP group's (EP is the inner dimension of the rank order).
    Weights held from the forward to the backward (``hold_gathered`` weights) are gathered once.
    DeepSpeed ZeRO-3 (``fetches``, :func:`deepspeed_fetches`) gathers a layer's dense weights in one
    all-gather per linear module (a stage within its live budget: per prefetch bucket), each paying
    its own latency, in the passes it fetches them, and reduce-scatters its gradients in buckets;
    None: the layer in one of each. With ZeRO++'s hpZ (``hpz_partition_size``) its backward gathers
    each unit from a second shard within that many ranks. Hybrid sharding (``replicas``): the
    collectives run in a shard group, and each unit's reduced shard is all-reduced over its replicas."""
    dense, expert, rest = _unit_collectives(stage_params, layer_params, layers, training, dp, gbps, nodes, hop,
                                            expert_params, expert_dp, fetches, replicas)
    passes = fetches.passes if fetches is not None else 1.0 if training.hold_gathered == "weights" else 2.0

    def per_unit(forward, backward, reduce_scatter):
        return forward + (passes - 1.0) * backward + reduce_scatter
    per_microbatch = np.asarray(layers, dtype=np.float64) * (per_unit(*dense) + per_unit(*expert)) + per_unit(*rest)
    return overlapped_exposed_seconds(per_microbatch, stage_time, sm_share) + dense[0] + expert[0]


def held_fully_sharded_step_time(stage_params, layer_params, layers, stage_time, training: TrainingSpec, dp, gbps,
                                 nodes=1, hop=NVLINK, sm_share=0.0, expert_params=0.0, expert_dp=1,
                                 fetches=None, replicas=None) -> np.ndarray:
    """Seconds per step a fully sharded pipeline stage that keeps its weights gathered through
    the step (model_states.keeps_gathered) waits on its DP group: each unit of
    :func:`fully_sharded_exposed_time` is gathered once, at the step's first forward, the next
    prefetched while one computes (exposed: the first unit's gather and what the first
    micro-batch's forward, a third of ``stage_time``, cannot hide), and its accumulated gradients
    are reduce-scattered once after the step's last backward, with no compute left to hide them."""
    dense, expert, rest = _unit_collectives(stage_params, layer_params, layers, training, dp, gbps, nodes, hop,
                                            expert_params, expert_dp, fetches, replicas)
    layers = np.asarray(layers, dtype=np.float64)
    gathers, reduces = (layers * (dense[i] + expert[i]) + rest[i] for i in (0, 2))
    return overlapped_exposed_seconds(gathers, stage_time / 3.0, sm_share) + dense[0] + expert[0] + reduces


# ZeRO++'s qwZ sends an fp32 scale per group of up to 8,000 int8 weights (CUDAQuantizer.target_group_size).
QWZ_SCALE_BYTES = 4.0 / 8000


class DeepSpeedFetches(NamedTuple):
    """A block's weights and gradients on a TP rank as DeepSpeed ZeRO-3 moves them (:func:`deepspeed_fetches`)."""
    linears: list
    """Parameters of each linear module, one all-gather each (where the stage outgrows the live budget)."""
    gradients: list
    """Each weight's gradient, the norms' too, in the order the backward adds it to the reduce bucket."""
    passes: np.ndarray
    """Passes that fetch the weights: 1 where the stage fits the live budget, else 2."""


def deepspeed_fetches(model: ModelSpec, training: TrainingSpec, tp, stage_params=np.inf) -> DeepSpeedFetches:
    """A block as DeepSpeed ZeRO-3 fetches and reduces it: one all-gather per linear module
    (:func:`~memx_launch.planning.matmuls.linear_module_params`; a norm's rides with a linear's) in
    the forward and again in the backward; where the stage's ``stage_params`` fit its live budget
    (and reuse distance, the same by default) it keeps them gathered in between and fetches them in
    the forward only, a prefetch bucket at a time (:func:`bucketed_block_seconds`, in the forward's
    order, the reverse of the gradients'); each gradient added to the reduce bucket as its backward
    ends: the MLP's linears, the second norm, attention's linears, the first norm (traced:
    ``benchmarks/results/deepspeed_zero3_fetch.json``)."""
    modules = linear_module_params(model, training, tp)
    mlp = len(mlp_shapes(model, training, tp))
    norm = [float(model.norm_params)] * (model.norms_per_block > 1)
    backward = [*modules[::-1][:mlp], *norm, *modules[::-1][mlp:], float(model.norm_params)]
    return DeepSpeedFetches(modules, backward,
                            np.where(np.asarray(stage_params) <= training.max_live_params, 1.0, 2.0))


def bucketed_block_seconds(parts, bucket: float, price, fill_past: bool = False) -> np.ndarray:
    """Seconds a block's collectives take where ``parts`` (parameters) fill buckets of ``bucket`` in
    order, a collective each: a bucket goes before a part that would overflow it is added
    (DeepSpeed's gradients, ``__add_grad_to_ipg_bucket``) or, ``fill_past``, with the part that
    fills it (its prefetch takes parameters while fewer than the bucket are in flight,
    ``partitioned_param_coordinator.py``). A block smaller than a bucket pays its share of one full
    bucket's, a larger one each bucket it fills, its last with it. ``price(sizes, counts)``: the
    seconds of collectives of ``sizes`` parameters, each taken ``counts`` times."""
    parts = np.broadcast_arrays(*(np.asarray(p, dtype=np.float64) for p in parts))
    total, fill, done = sum(parts), np.zeros_like(parts[0]), []
    for part in parts:
        if fill_past:
            fill = fill + part
            close = fill >= bucket
            done.append(np.where(close, fill, 0.0))
            fill = np.where(close, 0.0, fill)
        else:
            close = (fill > 0) & (fill + part > bucket)
            done.append(np.where(close, fill, 0.0))
            fill = np.where(close, part, fill + part)
    small = total < bucket
    sizes = [np.where(small, 0.0, size) for size in done] + [np.where(small, bucket, fill)]
    return price(sizes, [1.0] * len(done) + [np.where(small, total / bucket, 1.0)])


def _unit_collectives(stage_params, layer_params, layers, training: TrainingSpec, dp, gbps, nodes, hop,
                      expert_params, expert_dp, fetches: DeepSpeedFetches | None = None, replicas=None) -> tuple:
    """(forward all-gather, backward all-gather, reduce-scatter) seconds of a layer's dense unit (one
    collective of each, or DeepSpeed's, ``fetches`` of :func:`deepspeed_fetches`), of its routed
    experts' and of the stage's other parameters (the units of :func:`fully_sharded_exposed_time`).
    DeepSpeed's backward gathers from ZeRO++'s second shard where ``hpz_partition_size`` asks for it:
    over that many ranks of the group, a node's first (traced: ``deepspeed_zero3_fetch.json``); with
    ZeRO++'s ``quantized_weights`` each fetch all-gathers int8 weights and then their fp32 scales
    (``partition_parameters.py``: two collectives, each paying its latency). Hybrid sharding's
    ``replicas`` (ranks, links, nodes) all-reduce each reduce-scatter's shard after it (MiCS's too)."""
    layer_params = np.asarray(layer_params, dtype=np.float64)
    rest = np.maximum(np.asarray(stage_params, dtype=np.float64)
                      - np.asarray(layers, dtype=np.float64) * layer_params, 0.0)

    weight, gradient = compute_weight_bytes(training), reduced_gradient_bytes(training)
    hpz = training.hpz_partition_size if fetches is not None else 1
    quantized = bool(training.quantized_weights) and fetches is not None
    fetched_bytes = (1.0, QWZ_SCALE_BYTES) if quantized else (weight,)  # with qwZ: int8 weights, then their scales

    def unit_seconds(params, ranks, spanned, block: DeepSpeedFetches | None = None):
        def priced(op, bytes_per_param, group=ranks, group_nodes=spanned):
            """``price(sizes, counts)``: a collective of each size for each of ``bytes_per_param``."""
            return lambda sizes, counts: summed_seconds(
                op, [n * b for b in bytes_per_param for n in sizes], group, gbps, group_nodes, hop,
                None if counts is None else list(counts) * len(bytes_per_param))

        def fetched(group=ranks, group_nodes=spanned):
            return priced("all_gather", fetched_bytes, group, group_nodes)

        def backward(sizes):  # ZeRO++'s second shard over hpZ's ranks, within a node where they fit
            secondary = np.minimum(hpz, ranks)
            return fetched(secondary, np.maximum(1.0, spanned * secondary / ranks))(sizes, None)

        def replica_sync(sizes, counts):  # hybrid sharding: each reduced shard all-reduced over its replicas
            return 0.0 if replicas is None else \
                summed_seconds("all_reduce", [n * gradient / ranks for n in sizes], *replicas, hop, counts)

        if block is None:
            forward = fetched()([params], None) if quantized else \
                collective_seconds("all_gather", params * weight, ranks, gbps, spanned, hop)
            return (forward, forward if hpz == 1 else backward([params]),
                    collective_seconds("reduce_scatter", params * gradient, ranks, gbps, spanned, hop)
                    + replica_sync([params], None))

        def bucket(size):  # a stage smaller than a bucket fills one
            return np.minimum(size, np.maximum(np.asarray(stage_params, dtype=np.float64), 1.0))
        per_linear = fetched()(block.linears, None)
        forward = per_linear
        if np.any(block.passes == 1):  # a stage within the live budget prefetches in buckets
            forward = np.where(block.passes == 1, bucketed_block_seconds(
                block.gradients[::-1], bucket(training.prefetch_bucket_params), fetched(), fill_past=True),
                per_linear)
        reduce_bucket = bucket(training.reduce_bucket_params)
        return (forward, per_linear if hpz == 1 else backward(block.linears),
                bucketed_block_seconds(block.gradients, reduce_bucket, priced("reduce_scatter", (gradient,)))
                + (0.0 if replicas is None else bucketed_block_seconds(block.gradients, reduce_bucket, replica_sync)))

    expert = (0.0, 0.0, 0.0)
    if np.any(expert_params):  # a dense model's search (the hot path) prices no second group
        expert = unit_seconds(np.asarray(expert_params, dtype=np.float64), expert_dp, np.minimum(expert_dp, nodes))
    return unit_seconds(layer_params - expert_params, dp, nodes, fetches), expert, unit_seconds(rest, dp, nodes)


def _sharded_sync_bytes_per_param(training: TrainingSpec, trained: TrainedParameters) -> float:
    """Bytes per parameter a sharded setup's reduce-scatters and all-gathers move through the ring."""
    grad = reduced_gradient_bytes(training) * trained.share
    if training.fully_sharded:
        return 2.0 * compute_weight_bytes(training) * (1.0 + trained.adapters) + grad
    # An all-reduce moves its buffer twice through the ring, a reduce-scatter once.
    return grad * (2.0 if whole_gradients(training) else 1.0) + updated_weight_bytes(training) * trained.share


def sync_allreduce_bytes(stage_params, training: TrainingSpec,
                         trained: TrainedParameters = FULL_TRAINING) -> np.ndarray:
    """The all-reduce whose ring traffic equals one iteration's gradient sync: the gradients for
    plain data parallel; half the collectives' volume for a sharded setup (an all-reduce moves
    its buffer twice). What a cross-domain DP group syncs hierarchically."""
    params = np.asarray(stage_params, dtype=np.float64)
    if not (training.fully_sharded or training.distributed_optimizer):
        return params * trained.share * reduced_gradient_bytes(training)
    return params * _sharded_sync_bytes_per_param(training, trained) / 2.0


def tied_gradient_bytes(model: ModelSpec, pp: int, first_tp: int, training: TrainingSpec) -> float:
    """Bytes of the embedding's gradient the first and the last stage sum every step (none unless
    the last stage reads the embedding, nor with one stage, which holds the one weight): its
    trained share (fine-tuning; frozen it has no gradient to sum, as memx-run's runtime skips it)."""
    if not model.last_stage_reads_embedding or pp == 1:
        return 0.0
    trained = trained_parameters(model, training).share
    return model.word_embedding_params * trained / first_tp * training.precision_bytes("grad_dtype")
