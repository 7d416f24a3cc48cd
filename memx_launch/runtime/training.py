"""The torch-native backend: applies a Plan on this rank and trains with it.

Training scripts use it in three lines::

    runtime = memx_launch.runtime.from_env()          # or build(plan, rank); or prepare(model, ...)
    batch = runtime.local_batch(tokens)               # this DP replica's share
    stats = runtime.step(tokens, targets)             # one optimizer step, all micro-batches

Per rank: a [pp][dp][tp] DeviceMesh from the plan's stage ranks, the rank's model chunks (memx's
LlamaStage, or the user's model cut by models/adapters.py, with the stage's uneven layer count and
recompute level), DTensor tensor parallel inside the stage, DDP (FSDP2 with TP; HSDP with the plan's
shard_degree: runtime/meshes.py) across the stage's DP replicas, and torch.distributed.pipelining with
Schedule1F1B or ScheduleInterleaved1F1B (plan.virtual_stages chunks per rank).
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from memx_launch.errors import ConfigError
from memx_launch.models.adapters import ModelParts
from memx_launch.models.llama import LlamaStage, apply_tensor_parallel
from memx_launch.planning.plan import Plan, layer_recompute_levels
from memx_launch.runtime.batches import BatchLoss, StepBatch, replica_rows, step_batch
from memx_launch.runtime.communication import Communicator, bridge_backend, init_distributed, local_device, strict_mode
from memx_launch.profiling.emulation import GIB, EmulatedDevice
from memx_launch.runtime.layout import (RankLayout, process_domains, process_grid, process_rank, rank_layout,
                                       stage_runs_fully_sharded)
from memx_launch.runtime.fsdp_units import shard_stage
from memx_launch.runtime.meshes import stage_meshes
from memx_launch.runtime.monitor import device_memory
from memx_launch.runtime.pipeline_stage import DomainPipelineStage, PipelineLinks
from memx_launch.runtime.optimizer import clip_grad_norm, local_optimizer, local_scheduler, parameter_names
from memx_launch.runtime.precision import Precision
from memx_launch.runtime.run_record import RunRecord
from memx_launch.runtime.stage_clock import StageClock
from memx_launch.runtime.step_stats import StepStats, progress_line
from memx_launch.runtime.tied_weights import TiedGradients
from memx_launch.runtime.watchdog import StepWatchdog
from memx_launch.specs.training import TrainingSpec


DEFAULT_LR = 3e-4
SCHEDULER_KEY = "memx.lr_scheduler"
RUN_KEY = "memx.run"
"""The run so far (runtime/run_record.py), kept with the data state."""


class Runtime:
    """The plan applied on one rank. Build it with :func:`build` or :func:`from_env`."""

    def __init__(self, plan: Plan, rank: int, *, model: torch.nn.Module | None = None, blocks: str | None = None,
                 optimizer=None, loss_fn=None, lr_scheduler=None, max_grad_norm: float | None = None,
                 dtype: str | None = None, emulated: EmulatedDevice | None = None, lr: float = DEFAULT_LR,
                 seed: int = 0, data_parallel: str = "auto", cluster=None):
        """``model``: the user's module (runtime/prepare.py explains it and the optimizer, loss,
        scheduler and clipping arguments); None trains memx's LLaMA of the plan's shape. ``dtype``:
        fp32, bf16 or fp16 (runtime/precision.py; default: the plan's training dtype, else fp32).
        ``cluster``: the job's ClusterSpec, whose communication domains decide which groups are
        native and which traffic takes the bridge (runtime/communication.py); None: one domain."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

        if plan.virtual_stages == 1 and plan.num_microbatches < plan.pp:  # memx plan allows it, Megatron runs it
            raise ConfigError("plan.global_batch_size", f"{plan.num_microbatches} micro-batches for {plan.pp} stages: "
                              "torch's Schedule1F1B needs at least one per stage", "raise the global batch size, or "
                              "run the plan with Megatron-LM (memx export)")
        if dist.get_world_size() != plan.world_size:
            raise ConfigError("plan.world_size", f"the plan needs {plan.world_size} ranks but the job has "
                              f"{dist.get_world_size()}", f"launch with --nproc-per-node {plan.world_size} "
                              "or re-plan for this job")
        if dist.get_rank() != process_rank(plan, rank):
            raise ConfigError("rank", f"device rank {rank} must join the process group as rank "
                              f"{process_rank(plan, rank)}, not {dist.get_rank()}",
                              "initialise it with memx_launch.runtime.init_distributed(plan)")
        self.plan = plan
        self.layout: RankLayout = rank_layout(plan, rank)
        self.stage_plan = plan.stages[self.layout.stage]
        self.watchdog = StepWatchdog(rank, self.layout.stage, self.stage_plan.device_type,
                                     plan.predicted_iteration_time_s)
        self.emulated = emulated
        self.device = local_device()
        self.step_count = 0
        self.run_record = RunRecord()
        """The run over every generation (checkpoints carry it): ``run_record.summary(step_count)``."""
        self.supervisor = None
        self.data = None  # prepare(data=...)'s batches as this DP replica reads them (runtime/batches.py)
        self.metrics = None  # memx-run's metrics file on rank 0 (runtime/metrics_file.py; from_env sets it)
        """memx-run's monitor, fault injection and re-planning around each step (from_env sets it)."""
        self.comm = Communicator(process_domains(plan, cluster), self.device, strict=strict_mode(emulated is not None),
                                 emulated=emulated, bridge_backend=bridge_backend(cluster))
        if emulated is not None:  # strict mode's check inside the device's own dispatch mode: one Python layer
            strict = self.comm.strict_check()
            emulated.collective_check = strict.check if strict is not None else None
        self._make_groups()
        self.tp = len(self._tp_ranks)
        """This stage's TP degree (the plan's stage_tp may give each stage its own)."""
        # _averaged_ranks: what memx averages where the DP group spans domains (the group, or a shard's replicas).
        self.tp_mesh, self.dp_mesh, self._averaged_ranks = stage_meshes(
            self.comm, process_grid(plan), self._stage_grid, self._dp_ranks, self._tp_ranks, self.tp_group,
            self.device.type, self.dp_crosses_domains, plan)
        # FSDP2 over the replicas (across domains, over a shard group's mesh where there is one), else DDP
        # or, across domains, memx's average over the whole group.
        self.sharded = self.dp_mesh is not None and stage_runs_fully_sharded(plan, self.tp, self.dp_crosses_domains,
                                                                             data_parallel)
        if self.dp_crosses_domains and not self.sharded:
            self._averaged_ranks = self._dp_ranks
        self.precision = Precision(dtype or plan.training.get("dtype", "fp32"), self.device,
                                   tf32=plan.training.get("tf32", False))
        self.parts = None if model is None else self._model_parts(model, blocks)
        self.tied = TiedGradients(self.comm, plan, bool(self.parts and self.parts.tied), data_parallel)
        original = {}  # id of the user's parameter -> its rank-local name (wrapping replaces the objects)
        tied_names: list[str] = []
        with self._measured():
            self.chunks = [self._build_chunk(i, c, seed, original, tied_names)
                           for i, c in enumerate(self.layout.chunks)]
        self.tied.parameters = [parameter_names(self.chunks)[name] for name in tied_names]
        if self.parts is not None and emulated is not None:  # created before the guard was on
            emulated.track(p for m in self.chunks for p in m.parameters())
        num_virtual = plan.pp * plan.virtual_stages
        self.stage_clock = StageClock(self.device, emulated)
        self.memory = device_memory(emulated, self.device)
        stages = [DomainPipelineStage(module, chunk.virtual_stage, num_virtual, self.device, group=self.pp_group,
                                      communicator=self.comm, links=self.links, clock=self.stage_clock)
                  for module, chunk in zip(self.chunks, self.layout.chunks)]
        self.loss = BatchLoss(loss_fn)
        user_loss = self.stage_clock.timed(self.precision.scaled(self.loss))
        if plan.virtual_stages == 1:
            self.schedule = Schedule1F1B(stages[0], plan.num_microbatches, loss_fn=user_loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, plan.num_microbatches, loss_fn=user_loss)
        self.optimizer = local_optimizer(optimizer, parameter_names(self.chunks), original, lr)
        self.lr_scheduler = local_scheduler(lr_scheduler, self.optimizer)
        self.max_grad_norm = max_grad_norm
        self.comm.verify_groups()

    def _make_groups(self) -> None:
        """This rank's TP, DP and pipeline groups. Every rank creates every group of the plan in
        one order (torch numbers groups by creation); only members build one, so a native group
        exists only on its domain."""
        p, comm = self.plan, self.comm
        grid = process_grid(p)
        me = comm.rank
        stage, dp_index, tp_index = next((s, d, replica.index(me)) for s, replicas in enumerate(grid)
                                         for d, replica in enumerate(replicas) if me in replica)
        self._stage_grid = grid[stage]
        self._tp_ranks = tuple(grid[stage][dp_index])
        self._dp_ranks = tuple(replica[tp_index] for replica in grid[stage])
        self.dp_crosses_domains = comm.spans_domains(self._dp_ranks)
        self.tp_group = None
        for replicas in grid:
            for replica in replicas:
                if len(replica) > 1:
                    self.tp_group = comm.native(replica) or self.tp_group  # None outside the replica
        if p.dp > 1:
            for replicas in grid:
                for t in range(len(replicas[0])):
                    comm.prepare_all_reduce([replica[t] for replica in replicas])
        # Each edge between adjacent stages of a replica (the last feeds the first when interleaved).
        edge_groups = {}
        for d in range(p.dp):
            for s in range(p.pp if p.virtual_stages > 1 and p.pp > 1 else p.pp - 1):
                a, b = grid[s][d], grid[(s + 1) % p.pp][d]
                group = comm.group(sorted(set(a) | set(b)))
                if me in a or me in b:
                    edge_groups.update({r: group for r in (b if me in a else a)})
        # torch numbers the stages by a group with one rank per stage: this rank's lane.
        for d in range(p.dp):
            for lane in range(max(len(replicas[0]) for replicas in grid)):
                group = comm.group([grid[s][d][lane % len(grid[s][d])] for s in range(p.pp)])
                if d == dp_index and lane == tp_index:
                    self.pp_group = group
        self.links = PipelineLinks.of(grid, stage, dp_index, tp_index, edge_groups, self.tp_group,
                                      [planned.send_parts for planned in p.stages])

    def _model_parts(self, model: torch.nn.Module, blocks: str | None) -> ModelParts:
        parts = ModelParts(model, blocks)
        if parts.num_layers != self.plan.model_spec.num_layers:
            raise ConfigError("model", f"{type(model).__name__} has {parts.num_layers} blocks at {parts.path} but "
                              f"the plan is for {self.plan.model} with {self.plan.model_spec.num_layers} layers",
                              "plan for this model (memx-run --model its config.json) or pass blocks='path'")
        if not parts.kind.knows_attention:  # memx reads an unknown model's forward: check that reading
            parts.verify()
        return parts

    def _build_chunk(self, index: int, chunk, seed: int, original: dict,
                     tied_names: list[str]) -> torch.nn.Module:
        # full:K recomputes the stage's first K layers, counted through its chunks in order.
        levels = layer_recompute_levels(self.stage_plan.recompute, self.stage_plan.num_layers)
        start = sum(c.num_layers for c in self.layout.chunks[:index])
        recompute = levels[start:start + chunk.num_layers]
        policy = TrainingSpec(**self.plan.training).selective_recompute  # what "selective" runs again
        if self.parts is None:
            module = LlamaStage(self.plan.model_spec, chunk.num_layers, first=chunk.first, last=chunk.last,
                                recompute=recompute, layer_offset=chunk.layer_offset, seed=seed, selective_policy=policy)
        else:
            module = self.parts.stage(chunk.layer_offset, chunk.num_layers, first=chunk.first, last=chunk.last,
                                      recompute=recompute, selective_policy=policy)
            original.update({id(p): f"{index}.{name}" for name, p in module.named_parameters()})
            if self.plan.pp > 1:
                tied_names += [f"{index}.{name}" for name in self.parts.tied_names(module)]
        module = module.to(self.device)
        if self.tp > 1:
            if self.parts is None:
                apply_tensor_parallel(module, self.tp_mesh)
            else:
                self.parts.apply_tensor_parallel(module, self.tp_mesh)
        if self.plan.dp > 1 and self.dp_crosses_domains and not self.sharded:
            return module  # no library spans the replicas: step() averages the gradients itself
        if self.plan.dp > 1:
            # DDP keeps whole gradients and optimizer state per replica, as the cost model assumes
            # without a distributed optimizer; DDP cannot hold DTensor parameters, so TP uses FSDP2.
            if self.sharded:  # across domains over each domain's shard groups, step() averaging the shards
                shard_stage(module, self.dp_mesh, self.precision.dtype)
            else:
                from torch.nn.parallel import DistributedDataParallel
                module = DistributedDataParallel(module, process_group=self.comm.native(self._dp_ranks))
                # One backward per micro-batch: DDP's one-time bucket rebuild would record them all
                # and fail an assert at step 2. Rebuilt now, in parameter order, it records nothing
                # (find_unused_parameters skipped it too, but searched every step and warned per rank).
                module.reducer._push_all_rebuilt_params()
                module.reducer._rebuild_buckets()
        return module

    def _measured(self):
        """The emulated device's guard around rank work (strict mode's bridge check runs inside it),
        or strict mode's check alone."""
        if self.emulated is not None:
            return self.emulated
        return self.comm.strict_check() or nullcontext()

    def _sum_over_stages(self, value: torch.Tensor) -> None:
        """Sum (in place) a quantity every rank of a stage holds alike over the stages: one
        contribution per stage, job-wide as a host tensor (lanes differ when TP degrees do)."""
        contributes = self.layout.dp_index == 0 and self.layout.tp_index == 0
        value.copy_(self.comm.sum_over_job(value if contributes else torch.zeros_like(value)))

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient tensors (a DTensor's local shard)."""
        grads = [p.grad for m in self.chunks for p in m.parameters() if p.grad is not None]
        return [getattr(g, "_local_tensor", g) for g in grads]

    # ---- data
    @property
    def local_batch_size(self) -> int:
        """Sequences this DP replica processes per step (all its micro-batches)."""
        return self.plan.num_microbatches * self.plan.micro_batch_size

    def local_batch(self, global_batch):
        """This rank's DP replica's rows of a [global_batch_size, ...] tensor, dict or pair."""
        return replica_rows(global_batch, self.layout.dp_index, self.local_batch_size)

    # ---- training
    def step(self, batch, targets: torch.Tensor | None = None) -> StepStats:
        """One optimizer step over plan.num_microbatches micro-batches of this DP replica's
        local_batch_size rows: ``(inputs, targets)`` or a dict (runtime/batches.py), the same on
        every rank of the replica (the first stage reads inputs, the last targets, all the mask)."""
        takes_mask = self.parts is not None and self.parts.takes_mask
        batch = step_batch(batch, targets, self.local_batch_size, takes_mask)
        with self.watchdog.armed(self.step_count + 1):  # a hang becomes a one-line error (runtime/watchdog.py)
            stats = self._step(batch)
        self.run_record.add(stats.loss, stats.step_time_s)
        if self.metrics is not None:
            self.metrics.append(stats, self.plan)
        return stats

    def _step(self, batch: StepBatch) -> StepStats:
        losses: list[torch.Tensor] = []
        try:
            if self.supervisor is not None:
                self.supervisor.before_step(self.step_count + 1)
            self.stage_clock.reset()
            if self.memory is not None:
                self.memory.reset()
            start = time.perf_counter()
            with self._measured():
                self.optimizer.zero_grad(set_to_none=True)
                args = (batch.inputs.to(self.device),) if self.layout.is_first_stage else ()
                target = batch.targets.to(self.device) if self.layout.is_last_stage else None
                mask = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask.to(self.device)}
                counts = self.layout.is_last_stage and self.layout.tp_index == 0  # one count per replica
                self.loss.begin(batch, lambda n: self.comm.sum_over_job(torch.tensor([n if counts else 0.0],
                                dtype=torch.float64)).item(), self.plan.num_microbatches * self.plan.dp)
                self.precision.begin_step()
                with self.precision.autocast():
                    # return_outputs=False: torch's schedules otherwise keep every micro-batch's logits on
                    # the last stage until the next step, which no plan counts.
                    self.schedule.step(*args, target=target, losses=losses if self.layout.is_last_stage else None,
                                       return_outputs=False, **mask)
                if self.plan.dp > 1 and self.dp_crosses_domains:
                    self.comm.all_reduce_mean(self._local_grads(), self._averaged_ranks)
                self.tied.sum_grads(self.layout.tp_index)
                if self.precision.unscale((p for m in self.chunks for p in m.parameters()), self.comm.sum_over_job):
                    if self.max_grad_norm is not None:
                        counted_elsewhere = self.tied.parameters if self.layout.is_last_stage else []
                        clip_grad_norm(self.chunks, self.max_grad_norm, self._sum_over_stages, counted_elsewhere)
                    self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            step_time = time.perf_counter() - start
            self.step_count += 1
            # Inside the handler too: a peer that ran out of memory in its optimizer step leaves
            # for a re-plan while this rank, done with its step, waits here for its statistics.
            return self._gather_stats(losses, step_time)
        except Exception as exc:
            if self.supervisor is None:
                raise
            oom = _out_of_memory(exc)
            if oom is not None:
                self.supervisor.on_out_of_memory(oom)
            self.supervisor.on_peer_failure(exc)  # a planned restart, or the error raised again

    def _gather_stats(self, losses: list[torch.Tensor], step_time: float) -> StepStats:
        # One loss per pipeline: the last stage's TP rank 0 of each DP replica contributes it.
        contributes = self.layout.is_last_stage and self.layout.tp_index == 0
        local_loss = torch.stack([l.detach().float() for l in losses]).mean().item() / self.precision.step_scale \
            if contributes else 0.0
        compute = self.stage_clock.read() / self.plan.num_microbatches
        peak = self.memory.read().peak_bytes / GIB if self.memory is not None else float("nan")
        # The last column: a stop signal this rank saw, so that every rank stops at the same step.
        signal_seen = self.supervisor.signal_received if self.supervisor is not None else 0
        traffic = self.comm.traffic
        row = torch.tensor([local_loss, peak, compute, step_time, signal_seen, traffic.messages, traffic.bytes,
                            traffic.staging_s, traffic.collective_s], dtype=torch.float64)
        table = torch.stack(self.comm.all_gather_host(row))
        traffic.reset()
        stage_peak, stage_compute = [], []
        start = 0
        for tp in self.plan.stage_tps:
            sub = table[start:start + tp * self.plan.dp]
            start += tp * self.plan.dp
            stage_peak.append(sub[:, 1].max().item())
            stage_compute.append(sub[:, 2].max().item())
        step_time = table[:, 3].max().item()
        if self.supervisor is not None:
            self.supervisor.stop_signal = int(table[:, 4].max().item())
        tokens = self.plan.global_batch_size * self.plan.seq_len
        return StepStats(self.step_count, table[:, 0].sum().item() / self.plan.dp, step_time,
                         tokens / step_time, stage_peak, stage_compute, int(table[:, 5].sum().item()),
                         int(table[:, 6].sum().item()), table[:, 7].max().item(), table[:, 8].max().item())

    # ---- checkpoints
    def save_checkpoint(self, directory: str, data_state: dict | None = None, keep: int | None = None) -> str:
        """Every rank: model, optimizer, LR scheduler, RNG and ``data_state`` after step ``step_count``
        (memx_launch.runtime.checkpoint: loads under another plan; ``keep`` newest step folders).
        Returns the step's folder."""
        from memx_launch.runtime.checkpoint import save_checkpoint

        data_state = {**(data_state or {}), RUN_KEY: self.run_record.to_dict()}
        if self.lr_scheduler is not None:  # a few numbers, the same on every rank: kept with the data state
            data_state[SCHEDULER_KEY] = self.lr_scheduler.state_dict()
        return save_checkpoint(directory, self.chunks, self.optimizer, self.step_count, data_state, self.plan, keep)

    def load_checkpoint(self, directory: str):
        """Every rank: the latest checkpoint in ``directory``, whatever plan wrote it; sets
        ``step_count`` to its step and returns its Resumed (None when there is none)."""
        from memx_launch.runtime.checkpoint import load_checkpoint

        resumed = load_checkpoint(directory, self.chunks, self.optimizer)
        if resumed is not None:
            self.step_count = resumed.step
            self.run_record = RunRecord.from_dict(resumed.data_state.pop(RUN_KEY, None), f"{resumed.path}/memx.json")
            self.run_record.resumed_at.append(resumed.step + 1)
            scheduler_state = resumed.data_state.pop(SCHEDULER_KEY, None)
            if self.lr_scheduler is not None and scheduler_state is not None:
                self.lr_scheduler.load_state_dict(scheduler_state)
            if self.emulated is not None:  # the optimizer state was created outside the guard
                self.emulated.track(t for state in self.optimizer.state.values() for t in state.values()
                                    if isinstance(t, torch.Tensor))
        return resumed

    # ---- reporting
    def progress_line(self, stats: StepStats) -> str:
        return progress_line(stats, self.plan)


def _out_of_memory(exc: BaseException | None) -> torch.OutOfMemoryError | None:
    """The out-of-memory error behind ``exc`` (pipelining wraps a stage's error in a RuntimeError)."""
    while exc is not None and not isinstance(exc, torch.OutOfMemoryError):
        exc = exc.__cause__ or exc.__context__
    return exc


def build(plan: Plan, rank: int | None = None, **kwargs) -> Runtime:
    """The runtime of device ``rank`` of the plan (default: torchrun's RANK)."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    if not dist.is_initialized():
        cluster = kwargs.get("cluster")
        init_distributed(plan, cluster)
    return Runtime(plan, rank, **kwargs)


def from_env(**kwargs) -> Runtime:
    """The runtime for a worker started by memx-run (or torchrun with MEMX_PLAN set): joins the
    process group, loads the plan from MEMX_PLAN and, on a machine without GPUs, emulates this
    rank's device type from MEMX_CLUSTER. Under memx-run (MEMX_RUN_DIR set) it also watches
    memory and re-plans around each step (runtime/supervisor.py) and resumes from the run's
    latest checkpoint after a restart."""
    from memx_launch.runtime.devices import detect_rank_device
    from memx_launch.specs.cluster import ClusterSpec

    path = os.environ.get("MEMX_PLAN")
    if not path:
        raise ConfigError("MEMX_PLAN", "not set", "start the script with memx-run, or set MEMX_PLAN to a plan file")
    plan = Plan.load(path)
    cluster = ClusterSpec.from_yaml(os.environ["MEMX_CLUSTER"]) if os.environ.get("MEMX_CLUSTER") else None
    init_distributed(plan, cluster)
    if cluster is not None and cluster.world_size != dist.get_world_size():
        raise ConfigError("MEMX_CLUSTER", f"{cluster.name} declares {cluster.world_size} devices but the job has "
                          f"{dist.get_world_size()} ranks", "launch one process per declared device")
    rank = int(os.environ["RANK"])
    device = detect_rank_device(cluster, rank, int(os.environ.get("LOCAL_RANK", "0")))
    runtime = build(plan, rank, emulated=device.emulated, cluster=cluster, **kwargs)
    if os.environ.get("MEMX_RUN_DIR"):
        from memx_launch.runtime.supervisor import Supervisor
        runtime.supervisor = Supervisor(runtime, os.environ["MEMX_RUN_DIR"])
        runtime.supervisor.resume()
        if dist.get_rank() == 0:
            from memx_launch.runtime.metrics_file import MetricsFile
            runtime.metrics = MetricsFile(os.environ["MEMX_RUN_DIR"], runtime.supervisor.generation)
    return runtime
