"""Scoring candidates: the uneven layer split under each stage's memory (per-layer costs from the
space's cost table, ``cost_table.py``), the per-stage recompute hard rule and the iteration time.

Candidates are scored a group at a time: one group shares a layout and hyper-parameters and
holds every recompute policy as rows of numpy arrays.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning import (activation_offload, backward_end, context_parallel, costmodel as cm, data_parallel,
                                  elementwise, extra_blocks, schedules, stage_fit)
from memx_launch.planning.lazy_gradients import gradient_relief, lazy_gradient_bytes
from memx_launch.planning.memory_parts import stage_memory_parts
from memx_launch.planning.activations import partial_recompute_working, recomputed_layers
from memx_launch.planning.optimizer_peak import for_loop_temporary_bytes, step_block_bytes, step_temporary_bytes
from memx_launch.planning.loss import logits_bytes
from memx_launch.planning.optimizer_step import optimizer_step_seconds
from memx_launch.planning.grad_accumulation import accumulation_seconds
from memx_launch.planning.peaks import hbm_gbps
from memx_launch.planning.bridge import BridgePricing
from memx_launch.planning.cost_table import CostTable
from memx_launch.planning.collectives import collective_sm_share, overlapped_exposed_seconds
from memx_launch.planning.matmuls import device_sms
from memx_launch.planning.pipeline_buffers import pipeline_buffer_bytes, torch_receive_buffer_bytes
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.hybrid import layers_per_block
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.planning.layer_split import balance_layers
from memx_launch.planning.model_states import (autocast_copy_bytes, ends_split, held_gradient_share, keeps_gathered,
                                               layer_state_bytes, parameters_per_rank, weight_copy_bytes)
from memx_launch.planning.pipeline_sends import StageSends, edge_hidden_bytes
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.hybrid_sharding import ShardLinks, bridged_syncs
from memx_launch.planning.layouts import Layout, first_and_last



class Evaluator:
    """Scores groups of candidates for one model, cluster and training spec."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 cost_model: cm.LayerCostModel, table: CostTable,
                 memory_headroom: float = 0.0, recompute_levels: tuple[str, ...] = cm.RECOMPUTE_LEVELS,
                 recompute_some_layers: bool = False):
        self.model, self.cluster, self.training = model, cluster, training
        self.memory_headroom, self.recompute_levels = memory_headroom, recompute_levels
        self.recompute_some_layers = recompute_some_layers
        # The hard rule and the memory bound only use levels the search may use (memx plan --recompute-levels).
        self.allowed_levels = sorted(cm.RECOMPUTE_LEVELS.index(name) for name in recompute_levels)
        self.cost_model, self.table = cost_model, table
        self.device_types = [cluster.device_type(n) for n in cost_model.device_names]
        self.hbm_gbps = np.array([hbm_gbps(d, cluster.is_emulated) for d in self.device_types])
        # What compute loses beside an overlapped collective; CPU stand-ins run gloo inline.
        self.collective_sm_share = collective_sm_share(device_sms(self.device_types, cluster.is_emulated))
        # Fine-tuning trains only part of the parameters; the offloads' copies to the host.
        self.trained = cm.trained_parameters(model, training)
        staging = cluster.bridge.staging_gbps(cluster.is_emulated)
        self.host_gbps = np.array([d.host_link_gbps or staging for d in self.device_types])
        # A learned model brings the overhead calibration measured for a type (else the default).
        measured = getattr(cost_model, "measured_overhead_bytes", {})
        self.overhead = np.array([measured.get(d.name, d.overhead_bytes) for d in self.device_types])
        # An emulated cluster's communicators are gloo's, in host memory the guard does not count.
        self.communicator_bytes = np.array([0.0 if cluster.is_emulated else cluster.communicator_bytes(d.name)
                                            for d in self.device_types])
        # A learned model brings the bridges calibration measured (else the cluster file's).
        self.bridges = BridgePricing(cluster, getattr(cost_model, "measured_bridges", {}))
        self.sends = StageSends(cluster, self.bridges)
        self.shard_links = ShardLinks(cluster, training)  # hybrid sharding's groups of each layout
        self._uniform_layout, self._uniform_group, self._uniform = None, None, {}
        self._edge_times: dict[tuple, np.ndarray] = {}
        self._level_free_layout, self._level_free = None, {}

    @property
    def tables(self) -> tuple[CostTable, ...]:  # where its stages' layer times come from (the search's bound)
        return (self.table,)

    def usable(self, capacity: np.ndarray) -> np.ndarray:
        """Bytes a stage may plan for: its capacity less the headroom kept free."""
        return capacity * (1.0 - self.memory_headroom)

    def split_inputs(self, layout: Layout, mbs: int, seq: int, v: int, levels: np.ndarray, replica: int = 0,
                     layers: np.ndarray | None = None):
        """Per-stage per-layer bytes, fixed bytes, layer time, fixed time, micro-batches, the block's backward
        working set (part of the fixed bytes: a stage without blocks has none) and, where a later micro-batch's
        backward ends holding its casts' 16-bit gradients (:mod:`backward_end`), that moment's per-layer and fixed
        bytes (else None) for each row, on the device types of row ``replica`` of the layout's ``replica_device``.
        With context parallelism a rank sees ``seq / cp`` tokens of each sequence; with a DP degree per stage a
        stage of fewer replicas runs larger local micro-batches. Dense blocks between a mixture of experts' expert
        ones, and a hybrid model's kinds of layers, are counted where ``layers`` (the split) puts them; without it a
        layer costs their mean (:func:`extra_blocks.mean_block`; a hybrid model's table is its mean layer's)."""
        m = self.model
        tp, device, local, inflight, state, kind_states, fixed_parts, edge_t, lazy, wait, _, g = \
            self._level_free_inputs(layout, mbs, seq, v, replica)
        t_layer, act, work = self.stage_layer_costs(layout, device, tp, local, seq, levels)
        per_layer = state - gradient_relief(lazy, act) + inflight * act
        kind_t, kind_layer, kind_wait = [], [], []  # each kind beside the repeated one (extra_blocks.other_kinds)
        for i, (kind_state, table) in enumerate(zip(kind_states, self.table.kinds)):
            t, kind_act, _ = self.stage_layer_costs(layout, device, tp, local, seq, levels, table)
            kind_t.append(t)
            kind_layer.append(kind_state + inflight * kind_act)
            if wait is not None:
                kind_wait.append(kind_state + (inflight - 1) * kind_act + wait[1][i])
        counts = extra_blocks.kind_counts(m, layout.pp, layers, v)
        # The kept parts added in their order after the working set (sum goes left to right).
        fixed = sum(fixed_parts, work) + extra_blocks.beside_repeated(m, per_layer, kind_layer, counts)
        offloaded, copy_s = self._offload(inflight * act, act, t_layer, device)
        edge_t = edge_t + extra_blocks.beside_repeated(m, t_layer, kind_t, counts)
        later = None  # a later micro-batch's backward end (backward_end): one micro-batch fewer, no working set
        if wait is not None:
            wait_layer = state + (inflight - 1) * act + wait[0]
            wait_fixed = sum(fixed_parts, wait[2]) + extra_blocks.beside_repeated(m, wait_layer, kind_wait, counts)
            later = (wait_layer if layers is not None else extra_blocks.mean_block(m, wait_layer, kind_wait),
                     wait_fixed - offloaded)
        if layers is None:
            per_layer, t_layer = (extra_blocks.mean_block(m, per_layer, kind_layer),
                                  extra_blocks.mean_block(m, t_layer, kind_t))
        return per_layer, fixed - offloaded, t_layer, edge_t + copy_s, g, work, later

    def step_line(self, layout: Layout, mbs: int, seq: int, v: int, replica: int = 0,
                  layers: np.ndarray | None = None) -> tuple:
        """(per-layer, fixed) bytes of each stage's optimizer-step peak (:mod:`optimizer_peak`) on
        the device types of row ``replica``: no recompute level changes them. Blocks of other kinds
        where ``layers`` puts them, else at their mean (as :meth:`split_inputs`)."""
        m = self.model
        step_layer, step_kinds, step_fixed = self._level_free_inputs(layout, mbs, seq, v, replica)[-2]
        counts = extra_blocks.kind_counts(m, layout.pp, layers, v)
        step_fixed = step_fixed + extra_blocks.beside_repeated(m, step_layer, step_kinds, counts)
        if layers is None:
            step_layer = extra_blocks.mean_block(m, step_layer, step_kinds)
        return step_layer, step_fixed

    def _level_free_inputs(self, layout: Layout, mbs: int, seq: int, v: int, replica: int) -> tuple:
        """What :meth:`split_inputs` needs that no recompute level changes, kept for the latest
        layout (the search asks each of its groups at several levels): the stages' TP degree,
        device types, local micro-batch and in-flight micro-batches, a block's model states (and
        each other kind's), the fixed bytes beside the block's working set (the embedding, head
        and logits, the pipeline engine's kept outputs, a fully sharded run's gathered weights
        and their FP8 copies, what the process and its communicators hold above the tensors),
        the embedding's and the head's seconds, the blocks' gradients created after the peak
        (:mod:`lazy_gradients`), what a later micro-batch's backward end holds beside the states
        (:mod:`backward_end`: per block, per other kind's, and fixed, less its micro-batch's ends'; None
        where no cast waits), the optimizer step's bytes per block, each other kind's, and its
        fixed bytes (the ends' states, torch's pipeline receive buffers, the process's and its
        communicators'), and the micro-batches per step."""
        key = (mbs, seq, v, replica)
        if self._level_free_layout is not layout:
            self._level_free_layout, self._level_free = layout, {}
        if key in self._level_free:
            return self._level_free[key]
        m, tr = self.model, self.training
        pp, dp = layout.pp, layout.dp
        tp, shards = layout.tp_degrees, self.shard_links.state_shards(layout)
        device = layout.replica_device[replica]
        g = tr.global_batch_size // (dp * mbs)
        seq_rank, local = seq // layout.cp, layout.local_micro_batch(mbs)
        inflight = schedules.stage_inflight_microbatches(pp, g, v)
        copies_kept, copies_working = weight_copy_bytes(m, tr, tp, pp)
        share = held_gradient_share(tr, pp, g, v)
        state = layer_state_bytes(m, tr, tp, shards, self.trained, pp, share) + copies_kept
        kind_states = [layer_state_bytes(kind, tr, tp, shards, self.trained, pp, share)
                       + weight_copy_bytes(kind, tr, tp, pp)[0] for kind in extra_blocks.other_kinds(m)]
        held = self.overhead[device] + layout.communicators * self.communicator_bytes[device]
        fixed_parts = (self._edge_bytes(layout, local, seq_rank, inflight, share, shards),
                       pipeline_buffer_bytes(m, tr, local, seq_rank, tp, inflight, g, v),
                       cm.fully_sharded_working_bytes(m, tr, tp, shards, pp), copies_working, held)
        edge_t = self._edge_time(layout, device, local, seq_rank)
        lazy = lazy_gradient_bytes(m, tr, tp, self.trained, pp, g, v)
        wait = None
        if backward_end.waits(tr, g):  # its micro-batch's logits and embedding output are gone by then
            first_mbs, last_mbs = first_and_last(local, pp)
            once = self._edge_activations(np.ones(pp), first_mbs, last_mbs, seq_rank)
            once[-1] += logits_bytes(m, last_mbs, seq_rank, ends_split(layout, tr)[1], tr)
            wait = (backward_end.waiting_block_bytes(m, tr, tp, self.trained, v),
                    [backward_end.waiting_block_bytes(kind, tr, tp, self.trained, v)
                     for kind in extra_blocks.other_kinds(m)],
                    backward_end.end_bytes(m, tr, tp, ends_split(layout, tr), pp, self.trained) - once)
        temporary = step_temporary_bytes(tr, self.trained, tp, shards, self.cluster.is_emulated)
        step = (np.broadcast_to(step_block_bytes(m, tr, tp, state, temporary), (pp,)),
                [np.broadcast_to(step_block_bytes(kind, tr, tp, kind_state, temporary), (pp,))
                 for kind, kind_state in zip(extra_blocks.other_kinds(m), kind_states)],
                self._end_state_bytes(layout, share, shards, temporary) + held
                + for_loop_temporary_bytes(m, tr, tp, ends_split(layout, tr), shards, pp, self.cluster.is_emulated)
                + torch_receive_buffer_bytes(m, tr, local, seq_rank, tp, inflight, g, v))
        self._level_free[key] = (tp, device, local, inflight, state, kind_states, fixed_parts, edge_t, lazy, wait, step,
                                 g)
        return self._level_free[key]

    def _offload(self, kept, act, t_layer, device) -> tuple:
        """(bytes off, seconds added per micro-batch) of each stage's activation offloading: a
        stage holds more layers than it offloads (:meth:`min_layers`), so it offloads all it asks."""
        n = self.training.activation_offload_layers
        if not n:
            return 0.0, 0.0
        return (activation_offload.offloaded_bytes(n, kept, act),
                n * activation_offload.exposed_copy_seconds(act, t_layer, self.host_gbps[device]))

    def min_layers(self, schedule: str, v: int) -> int:
        """Fewest layers a stage holds: one per chunk of an interleaved pipeline, and one more than
        activation offloading takes to the host (Megatron: fewer than the layers)."""
        return max(v if schedule == "interleaved" else 1, self.training.activation_offload_layers + 1)

    def stage_min_layers(self, pp: int, schedule: str, v: int) -> np.ndarray:
        """(P,) :meth:`min_layers`, the first stage holding every dense first block in its first chunk."""
        fewest = np.full(pp, self.min_layers(schedule, v))
        chunks = v if schedule == "interleaved" else 1
        fewest[0] = max(fewest[0], extra_blocks.first_stage_min_layers(self.model, chunks))
        return fewest

    def stage_layer_costs(self, layout, device, tp, mbs, seq, levels, table=None):
        """(time, kept activations, backward working set) of a layer on each stage of ``device`` (P,) at
        ``levels`` (C, P), from ``table`` (the space's, or its dense first block's). A CP layer: a ``seq / cp``
        one, the other chunks' attention, the ring's exposed transfers, traffic and buffers (:mod:`context_parallel`)."""
        cp, table = layout.cp, table or self.table
        t_layer, act, work = table.lookup(np.broadcast_to(device, np.shape(levels)), tp, mbs, seq // cp, levels)
        if cp == 1:
            return t_layer, act, work
        ring_s, ring_bytes = context_parallel.ring_layer_costs(
            self.model, self.training, mbs, seq, tp, cp, table.attention(device, tp, mbs, seq // cp),
            layout.cp_gbps * self.cluster.link_efficiency, self.hbm_gbps[device], levels)
        return t_layer + ring_s, act, work + ring_bytes

    def _edge_bytes(self, layout, local, seq, inflight, gradient_share, shards) -> np.ndarray:
        m, tr, last, pp = self.model, self.training, ends_split(layout, self.training)[1], layout.pp
        first_mbs, last_mbs = first_and_last(local, pp)
        out = self._edge_activations(inflight, first_mbs, last_mbs, seq) + self._end_state_bytes(
            layout, gradient_share, shards)
        head = cm.last_stage_params(m, pp) / last
        out[-1] += autocast_copy_bytes(head, tr) + logits_bytes(m, last_mbs, seq, last, tr)
        return out

    def _end_state_bytes(self, layout, gradient_share, shards, extra_per_param=0.0) -> np.ndarray:
        """(P,) the model states of the embedding on the first stage and the head on the last,
        with ``extra_per_param`` (P,) bytes more per parameter (the optimizer step's)."""
        m, (first, last), pp = self.model, ends_split(layout, self.training), layout.pp
        per_param = cm.model_state_bytes_per_param(self.training, shards, self.trained, pp, gradient_share)
        per_param = np.broadcast_to(per_param + np.asarray(extra_per_param, dtype=np.float64), (pp,))
        out = np.zeros(pp)
        out[0] += m.embedding_params / first * per_param[0]
        out[-1] += cm.last_stage_params(m, pp) / last * per_param[-1]
        return out

    def _edge_activations(self, inflight, first_mbs, last_mbs, seq) -> np.ndarray:
        """(P,) what the ends keep per in-flight micro-batch beside the blocks: the embedding's output
        on the first stage (at the hidden state's precision), multi-token prediction's inputs on the last."""
        m, tr = self.model, self.training
        out = np.zeros(len(inflight))
        out[0] = inflight[0] * first_mbs * seq * m.hidden_size * tr.residual_bytes
        out[-1] += extra_blocks.mtp_input_bytes(m, tr, inflight[-1], last_mbs, seq)
        return out

    def _edge_time(self, layout, device, local, seq) -> np.ndarray:
        """(P,) seconds of the embedding on the first stage and the head on the last, read-only:
        kept per query, as the search asks the same ends for group after group."""
        (first, last), (first_mbs, last_mbs) = ends_split(layout, self.training), first_and_last(local, layout.pp)
        key = (layout.pp, int(device[0]), int(device[-1]), first, last, float(first_mbs), float(last_mbs), seq)
        if key not in self._edge_times:
            out = np.zeros(layout.pp)
            out[0] += self.cost_model.embedding_time(device[0], first, first_mbs, seq)
            out[-1] += self.cost_model.head_time(device[-1], last, last_mbs, seq)
            out.flags.writeable = False
            self._edge_times[key] = out
        return self._edge_times[key]

    def replica_inputs(self, layout, mbs, seq, v, levels) -> list[tuple]:
        """:meth:`split_inputs` on each row of the layout's device types."""
        return [self.split_inputs(layout, mbs, seq, v, levels, k) for k in range(len(layout.replica_device))]

    def uniform_inputs(self, layout, mbs, seq, v, level) -> list[tuple]:
        """:meth:`replica_inputs` with every stage at ``level`` (one row, broadcasting against a
        group's rows), kept for the latest group: the search asks the full-recompute bound of a
        group, then the hard rule asks every level of it."""
        group = (mbs, seq, v)
        if self._uniform_layout is not layout or self._uniform_group != group:
            self._uniform_layout, self._uniform_group, self._uniform = layout, group, {}
        if level not in self._uniform:
            self._uniform[level] = self.replica_inputs(layout, mbs, seq, v, np.full((1, layout.pp), level))
        return self._uniform[level]

    def score(self, layout: Layout, mbs: int, seq: int, schedule: str, v: int,
              levels: np.ndarray, layers: np.ndarray | None = None,
              recompute_layers: np.ndarray | None = None, recompute_every: np.ndarray | None = None) -> GroupResult:
        """Split layers (unless given), apply the per-stage hard rule, and score every row.
        ``recompute_layers`` (with ``layers``): how many of each stage's layers recompute at its
        level, the others keeping everything (Megatron's block method: the first K layers); where
        ``recompute_every`` is positive, every that many-th layer instead (``full:everyN``).
        A stage whose DP replicas sit on several device types runs at its slowest type's pace
        and fits only if it fits on each type; its memory is that of the type nearest (or
        furthest over) its capacity."""
        L = self.model.num_layers
        min_layers = self.stage_min_layers(layout.pp, schedule, v)
        replicas = range(len(layout.replica_device))
        if layers is None:
            inputs = self.replica_inputs(layout, mbs, seq, v, levels)
            t_layer, edge_t = (np.max([x[2] for x in inputs], axis=0), np.max([x[3] for x in inputs], axis=0)) \
                if layout.mixed else inputs[0][2:4]
            steps = [self.step_line(layout, mbs, seq, v, k) for k in replicas]
            most = stage_fit.max_layers(self, layout, inputs, steps)
            layers, feasible = balance_layers(t_layer, edge_t, most, L, min_layers,
                                              layers_per_block(self.model))  # Gated DeltaNet blocks stay whole
            levels = stage_fit.lowest_fitting_levels(self, layout, mbs, seq, v, levels, layers)
            if self.recompute_some_layers and v == 1 and (levels == cm.FULL).any() and cm.NONE in self.allowed_levels:
                recompute_layers = stage_fit.fewest_recomputed_layers(self, layout, mbs, seq, v, levels, layers)
        memories, times, fits = [], [], []
        for k in replicas:
            per_layer, fixed, t_layer, edge_t, g, work, later = self.split_inputs(layout, mbs, seq, v, levels, k,
                                                                                  layers)
            memory = layers * per_layer + fixed
            wait = None if later is None else layers * later[0] + later[1]
            stage_time = layers * t_layer + edge_t
            if recompute_layers is not None:
                none_layer, none_fixed, none_t, _, _, none_work, none_later = (
                    self.split_inputs(layout, mbs, seq, v, np.full_like(levels, cm.NONE), k, layers)
                    if extra_blocks.split_places_kinds(self.model)
                    else self.uniform_inputs(layout, mbs, seq, v, cm.NONE)[k])
                r = recomputed_layers(layers, recompute_layers, recompute_every)
                kept_layer = stage_fit.kept_layer_bytes(self, layout, mbs, seq, v, k)
                partial = partial_recompute_working(work, none_work, kept_layer, layers, r, recompute_every)
                memory = r * per_layer + (layers - r) * none_layer + np.where(r > 0, fixed - work + partial, none_fixed)
                if later is not None:
                    wait = r * later[0] + (layers - r) * none_later[0] + np.where(r > 0, later[1], none_later[1])
                stage_time = r * t_layer + (layers - r) * none_t + edge_t
                work = partial
            memory = memory - (layers == 0) * work  # an embedding- or head-only stage runs no block backward
            if wait is not None:  # or a later micro-batch's backward end's (backward_end)
                memory = np.maximum(memory, wait)
            step_layer, step_fixed = self.step_line(layout, mbs, seq, v, k, layers)
            memory = np.maximum(memory, layers * step_layer + step_fixed)  # or the optimizer step's peak
            memories.append(memory)
            times.append(stage_time)
            fits.append(memory <= self.usable(layout.replica_capacity[k]))
        if layout.mixed:
            capacities = np.broadcast_to(layout.replica_capacity[:, None, :], (len(replicas), *levels.shape))
            worst = np.argmax(np.array(memories) / capacities, axis=0)[None]
            memory = np.take_along_axis(np.array(memories), worst, axis=0)[0]
            cap = np.take_along_axis(capacities, worst, axis=0)[0]
            stage_time, fits = np.max(times, axis=0), np.all(fits, axis=0)
            replica = worst[0]
        else:  # the search's layouts: one device type per stage
            memory, stage_time, fits, cap = memories[0], times[0], fits[0], np.broadcast_to(layout.capacity, levels.shape)
            replica = None
        feasible = fits.all(axis=1) & (layers >= min_layers).all(axis=1) & (layers.sum(axis=1) == L)
        T, transfer, sync, parts = self.iteration_parts(layout, mbs, seq, schedule, v, g, stage_time, layers)
        crosses = bool(layout.edge_crossings or layout.group_crossings or layout.ends_crossing)
        # M: the fullest device as a fraction of its capacity (devices of different sizes compare); V: the
        # variance of the devices' memory use in GiB^2, as the paper's (its Table 10: 9.13e5 MB^2): equal use.
        return GroupResult(layout, mbs, seq, schedule, v, levels, layers, memory, stage_time,
                           T, (memory / cap).max(axis=1), (memory / cm.GIB).var(axis=1), feasible, cap,
                           recompute_layers, transfer if crosses else None, sync if crosses else None, replica,
                           self.tied_sync_time(layout),
                           (self.training.expert_parallel, self.training.expert_tensor_parallel),
                           self.training.shard_degree, parts, self.tied_sum_bytes(layout), recompute_every)

    def memory_parts(self, result: GroupResult, row: int = 0) -> list[dict[str, float]]:
        """Per stage, the bytes of ``result.memory[row]`` by part (:data:`MEMORY_PARTS`):
        :func:`~memx_launch.planning.memory_parts.stage_memory_parts`."""
        return stage_memory_parts(self, result, row)

    def fits_with_full_recompute(self, layout, mbs, seq, schedule, v) -> bool:
        """Memory lower bound: can the stages hold every layer even when all recompute fully?"""
        steps = [self.step_line(layout, mbs, seq, v, k) for k in range(len(layout.replica_device))]
        lightest = self.uniform_inputs(layout, mbs, seq, v, self.allowed_levels[-1])
        max_layers = stage_fit.max_layers(self, layout, lightest, steps)
        return bool((max_layers >= self.stage_min_layers(layout.pp, schedule, v)).all()
                    and max_layers.sum() >= self.model.num_layers)

    def send_in(self, parts) -> None:
        """Price each pipeline edge's sends in ``parts`` (a plan file's ``send_parts``); None: choose them."""
        self.sends.given_parts = None if parts is None else np.asarray(parts, dtype=np.int64)

    def tied_sum_bytes(self, layout) -> float:
        """Bytes each rank of the first and the last stage sums with the other end every step,
        after the DP sync: the tied gradient, or where the stages run fully sharded its shard
        (their reduce-scatter left each rank its own; memx-run's FSDP2 sums the local shards)."""
        nbytes = data_parallel.tied_gradient_bytes(self.model, layout.pp, layout.end_tp[0], self.training)
        shards = np.atleast_1d(self.shard_links.state_shards(layout))[0] if self.training.fully_sharded else 1
        return nbytes / float(shards)

    def tied_sync_time(self, layout) -> float:
        """Seconds the first and the last stage sum their tied gradients, after the DP sync."""
        return self.bridges.ends_sum_time(layout, self.tied_sum_bytes(layout))

    def stage_step_parts(self, layout, mbs, seq, v, stage_time, layers) -> tuple:
        """What the schedule combines, per stage: its time with what a fully sharded run leaves
        exposed, the (P,) seconds of one transfer to the next stage (the last: interleaving's
        wrap-around), its gradient sync before any overlap with the backward, the part of it the
        step waits for and its optimizer step on the slowest of its device types (each (C, P)), and
        the (P,) parts each transfer is sent in (:meth:`StageSends.transfers`)."""
        m, tr = self.model, self.training
        hidden_bytes = edge_hidden_bytes(m, tr, layout, mbs, seq)
        def device_types():
            return [self.device_types[d].name for d in layout.replica_device[0]]
        transfer, parts = self.sends.transfers(layout, hidden_bytes, v, tr, device_types)
        stage_params, shards = parameters_per_rank(m, tr, layout, layers, v), self.shard_links.state_shards(layout)
        sm_share = self.collective_sm_share[layout.replica_device].max(axis=0)
        stage_time, sync = data_parallel.stage_gradient_sync(m, tr, layout, layers, v, stage_params, stage_time,
                                                            layout.dp_gbps * self.cluster.link_efficiency, sm_share,
                                                            self.trained, self.shard_links.of(layout))
        # Once-a-step passes over the micro-batches on the slowest memory: gradient adds, a step-wide autocast's casts.
        slowest, g = self.hbm_gbps[layout.replica_device].min(axis=0), tr.global_batch_size // (layout.dp * mbs)
        stage_time = (stage_time + accumulation_seconds(stage_params, tr, slowest, shards, layout.pp, g, self.trained)
                      + elementwise.step_weight_cast_seconds(stage_params, tr, slowest, g))
        sync = bridged_syncs(self.bridges, layout, self.shard_links.of(layout), sync, stage_params, tr, self.trained)
        exposed = sync
        if tr.overlap_grad_reduce and not keeps_gathered(tr, layout.pp):
            # Reduced bucket by bucket during the last micro-batch's backward (2/3 of its time).
            exposed = overlapped_exposed_seconds(exposed, 2.0 / 3.0 * stage_time, sm_share)
        step = optimizer_step_seconds(stage_params[None], tr, self.hbm_gbps[layout.replica_device][:, None],
                                      shards, self.trained, self.host_gbps[layout.replica_device][:, None])
        return stage_time, transfer, sync, exposed, step.max(axis=0), parts

    def iteration_parts(self, layout, mbs, seq, schedule, v, g, stage_time, layers):
        """(T, transfer, sync, parts): the iteration time of each row, and :meth:`stage_step_parts`'
        transfers, gradient syncs and the parts of each transfer."""
        stage_time, transfer, sync, exposed, step, parts = self.stage_step_parts(layout, mbs, seq, v, stage_time, layers)
        ends = np.isin(np.arange(layout.pp), (0, layout.pp - 1))  # after their DP sync they sum tied gradients
        t_dp = (exposed + self.tied_sync_time(layout) * ends).max(axis=1)
        t_fix = step.max(axis=1)  # every stage's optimizer step at once
        if schedule == "interleaved":
            overlapped = np.full(layout.pp, self.training.overlap_p2p_comm)
            overlapped[[edge.stage for edge in layout.edge_crossings]] = False
            T = schedules.iteration_time_interleaved(stage_time, transfer, g, v, t_fix, t_dp, overlapped)
        else:
            T = schedules.iteration_time_1f1b(stage_time, transfer, g, t_fix, t_dp)
        return T, transfer, sync, parts
