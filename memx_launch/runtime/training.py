"""The torch-native backend: applies a Plan on this rank and trains with it.

Training scripts use it in three lines::

    runtime = memx_launch.runtime.from_env()          # or build(plan, rank); or prepare(model, ...)
    batch = runtime.local_batch(tokens)               # this DP replica's share
    stats = runtime.step(tokens, targets)             # one optimizer step, all micro-batches

Per rank: a [pp][dp][tp] DeviceMesh from the plan's stage ranks, the rank's model chunks (memx's
LlamaStage, or the user's model cut by models/adapters.py, with the stage's uneven layer count and
recompute level), DTensor tensor parallel inside the stage, DDP (FSDP2 with TP) across the stage's DP replicas, and torch.distributed.pipelining with
Schedule1F1B or ScheduleInterleaved1F1B (plan.virtual_stages chunks per rank).
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F

from memx_launch.errors import ConfigError
from memx_launch.models.adapters import ModelParts
from memx_launch.models.llama import LlamaStage, apply_tensor_parallel
from memx_launch.planning.plan import Plan, layer_recompute_levels
from memx_launch.runtime.emulation import GIB, EmulatedDevice
from memx_launch.runtime.layout import RankLayout, process_rank, rank_layout
from memx_launch.runtime.precision import Precision
from memx_launch.runtime.watchdog import StepWatchdog


DEFAULT_LR = 3e-4
SCHEDULER_KEY = "memx.lr_scheduler"


@dataclass
class StepStats:
    """One optimizer step as every rank sees it; the per-stage lists are filled on all ranks."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    stage_peak_gib: list[float] = field(default_factory=list)
    """Measured peak memory per stage (max over the stage's ranks); NaN where unmeasured."""
    stage_compute_s: list[float] = field(default_factory=list)
    """Measured compute time of one micro-batch per stage (emulated devices only; NaN otherwise)."""


def default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over the micro-batch's tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def init_distributed(plan: Plan | None = None) -> None:
    """Join the job's process group from torchrun's variables, under a per-generation key prefix:
    after an in-place restart the agent's store still holds the previous generation's keys.
    With a plan, this device takes its stage-major process rank (layout.process_rank)."""
    if dist.is_initialized():
        return
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise ConfigError(exc.args[0], "not set", "start the script with memx-run or torchrun") from None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store,
                          multi_tenant=not agent_store)
    from memx_launch.runtime.worker import restart_generation
    generation = restart_generation()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # CPU stand-ins share the host's cores: oversubscribed threads make every rank crawl
        # The cores this process may use (its affinity where the OS has one), shared by the node's ranks.
        process = psutil.Process()
        cores = len(process.cpu_affinity()) if hasattr(process, "cpu_affinity") else psutil.cpu_count()
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend, store=dist.PrefixStore(f"memx/generation{generation}", store),
                            rank=rank if plan is None else process_rank(plan, rank), world_size=world)


class Runtime:
    """The plan applied on one rank. Build it with :func:`build` or :func:`from_env`."""

    def __init__(self, plan: Plan, rank: int, *, model: torch.nn.Module | None = None, blocks: str | None = None,
                 optimizer=None, loss_fn=None, lr_scheduler=None, max_grad_norm: float | None = None,
                 dtype: str | None = None, emulated: EmulatedDevice | None = None, lr: float = DEFAULT_LR,
                 seed: int = 0, data_parallel: str = "auto"):
        """``model``: the user's module (runtime/prepare.py explains it and the optimizer, loss,
        scheduler and clipping arguments); None trains memx's LLaMA of the plan's shape. ``dtype``:
        fp32, bf16 or fp16 (runtime/precision.py; default: the plan's training dtype, else fp32)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

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
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.step_count = 0
        self.supervisor = None
        """memx-run's monitor, fault injection and re-planning around each step (from_env sets it)."""
        grid = torch.arange(plan.world_size).view(plan.pp, plan.dp, plan.tp)  # process ranks, stage-major
        self.mesh = DeviceMesh(self.device.type, grid, mesh_dim_names=("pp", "dp", "tp"))
        self.parts = None if model is None else self._model_parts(model, blocks)
        original = {}  # id of the user's parameter -> its rank-local name (wrapping replaces the objects)
        with self._measured():
            self.chunks = [self._build_chunk(i, c, seed, data_parallel, original)
                           for i, c in enumerate(self.layout.chunks)]
        if self.parts is not None and emulated is not None:  # created before the guard was on
            emulated.track(p for m in self.chunks for p in m.parameters())
        num_virtual = plan.pp * plan.virtual_stages
        pp_group = self.mesh["pp"].get_group()
        stages = [PipelineStage(module, chunk.virtual_stage, num_virtual, self.device, group=pp_group)
                  for module, chunk in zip(self.chunks, self.layout.chunks)]
        self.precision = Precision(dtype or plan.training.get("dtype", "fp32"), self.device)
        user_loss = self.precision.scaled(loss_fn or default_loss)
        if plan.virtual_stages == 1:
            self.schedule = Schedule1F1B(stages[0], plan.num_microbatches, loss_fn=user_loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, plan.num_microbatches, loss_fn=user_loss)
        from memx_launch.runtime.prepare import local_optimizer, local_scheduler, parameter_names

        self.optimizer = local_optimizer(optimizer, parameter_names(self.chunks), original, lr)
        self.lr_scheduler = local_scheduler(lr_scheduler, self.optimizer)
        self.max_grad_norm = max_grad_norm

    def _model_parts(self, model: torch.nn.Module, blocks: str | None) -> ModelParts:
        parts = ModelParts(model, blocks)
        if parts.num_layers != self.plan.model_spec.num_layers:
            raise ConfigError("model", f"{type(model).__name__} has {parts.num_layers} blocks at {parts.path} but "
                              f"the plan is for {self.plan.model} with {self.plan.model_spec.num_layers} layers",
                              "plan for this model (memx-run --model its config.json) or pass blocks='path'")
        if not parts.kind.knows_attention:  # memx reads an unknown model's forward: check that reading
            parts.verify()
        return parts

    def _build_chunk(self, index: int, chunk, seed: int, data_parallel: str, original: dict) -> torch.nn.Module:
        # full:K recomputes the stage's first K layers, counted through its chunks in order.
        levels = layer_recompute_levels(self.stage_plan.recompute, self.stage_plan.num_layers)
        start = sum(c.num_layers for c in self.layout.chunks[:index])
        recompute = levels[start:start + chunk.num_layers]
        if self.parts is None:
            module = LlamaStage(self.plan.model_spec, chunk.num_layers, first=chunk.first, last=chunk.last,
                                recompute=recompute, layer_offset=chunk.layer_offset, seed=seed)
        else:
            module = self.parts.stage(chunk.layer_offset, chunk.num_layers, first=chunk.first, last=chunk.last,
                                      recompute=recompute)
            original.update({id(p): f"{index}.{name}" for name, p in module.named_parameters()})
        module = module.to(self.device)
        if self.plan.tp > 1:
            if self.parts is None:
                apply_tensor_parallel(module, self.mesh["tp"])
            else:
                self.parts.apply_tensor_parallel(module, self.mesh["tp"])
        if self.plan.dp > 1:
            # DDP keeps whole gradients and optimizer state per replica, as the cost model assumes
            # without a distributed optimizer; DDP cannot hold DTensor parameters, so TP uses FSDP2.
            sharded = self.plan.training.get("fully_sharded", False) or self.plan.tp > 1
            if data_parallel == "fsdp" or (data_parallel == "auto" and sharded):
                from torch.distributed.fsdp import fully_shard
                fully_shard(module, mesh=self.mesh["dp"])
            else:
                from torch.nn.parallel import DistributedDataParallel
                # The pipeline runs one backward per micro-batch: DDP's one-time bucket rebuild
                # would record every micro-batch's hooks and fail an internal assert at step 2;
                # find_unused_parameters skips that rebuild.
                module = DistributedDataParallel(module, process_group=self.mesh["dp"].get_group(),
                                                 find_unused_parameters=True)
        return module

    def _measured(self):
        return self.emulated if self.emulated is not None else nullcontext()

    # ---- data
    @property
    def local_batch_size(self) -> int:
        """Sequences this DP replica processes per step (all its micro-batches)."""
        return self.plan.num_microbatches * self.plan.micro_batch_size

    def local_batch(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This rank's DP replica's rows of a [global_batch_size, ...] tensor."""
        n = self.local_batch_size
        return global_batch[self.layout.dp_index * n:(self.layout.dp_index + 1) * n]

    # ---- training
    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepStats:
        """One optimizer step over plan.num_microbatches micro-batches of this DP replica's
        [local_batch_size, seq] tokens and targets. Every rank passes the same tensors for its
        replica; only the first stage reads tokens and only the last reads targets."""
        with self.watchdog.armed(self.step_count + 1):  # a hang becomes a one-line error (runtime/watchdog.py)
            return self._step(tokens, targets)

    def _step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepStats:
        losses: list[torch.Tensor] = []
        try:
            if self.supervisor is not None:
                self.supervisor.before_step(self.step_count + 1)
            if self.emulated is not None:
                self.emulated.reset_peak()
            elif self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with self._measured():
                self.optimizer.zero_grad(set_to_none=True)
                args = (tokens.to(self.device),) if self.layout.is_first_stage else ()
                target = targets.to(self.device) if self.layout.is_last_stage else None
                self.precision.begin_step()
                with self.precision.autocast():
                    self.schedule.step(*args, target=target, losses=losses if self.layout.is_last_stage else None)
                if self.precision.unscale(p for m in self.chunks for p in m.parameters()):
                    if self.max_grad_norm is not None:
                        from memx_launch.runtime.prepare import clip_grad_norm
                        clip_grad_norm(self.chunks, self.max_grad_norm, self.mesh["pp"].get_group())
                    self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        except Exception as exc:
            if self.supervisor is None:
                raise
            oom = _out_of_memory(exc)
            if oom is not None:
                self.supervisor.on_out_of_memory(oom)
            self.supervisor.on_peer_failure(exc)
        step_time = time.perf_counter() - start
        self.step_count += 1
        return self._gather_stats(losses, step_time)

    def _gather_stats(self, losses: list[torch.Tensor], step_time: float) -> StepStats:
        # One loss per pipeline: the last stage's TP rank 0 of each DP replica contributes it.
        contributes = self.layout.is_last_stage and self.layout.tp_index == 0
        local_loss = torch.stack([l.detach().float() for l in losses]).mean().item() / self.precision.step_scale \
            if contributes else 0.0
        if self.emulated is not None:
            peak = self.emulated.peak_bytes / GIB
            compute = (self.emulated.compute_s + self.emulated.slept_s) / self.plan.num_microbatches
        elif self.device.type == "cuda":
            peak, compute = torch.cuda.max_memory_allocated() / GIB, float("nan")
        else:
            peak = compute = float("nan")
        # The last column: a stop signal this rank saw, so that every rank stops at the same step.
        signal_seen = self.supervisor.signal_received if self.supervisor is not None else 0
        row = torch.tensor([local_loss, peak, compute, step_time, signal_seen], dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        table = torch.stack(rows)
        stage_peak, stage_compute = [], []
        per_stage = self.plan.tp * self.plan.dp
        for i in range(self.plan.pp):
            sub = table[i * per_stage:(i + 1) * per_stage]
            stage_peak.append(sub[:, 1].max().item())
            stage_compute.append(sub[:, 2].max().item())
        step_time = table[:, 3].max().item()
        if self.supervisor is not None:
            self.supervisor.stop_signal = int(table[:, 4].max().item())
        tokens = self.plan.global_batch_size * self.plan.seq_len
        return StepStats(self.step_count, table[:, 0].sum().item() / self.plan.dp, step_time,
                         tokens / step_time, stage_peak, stage_compute)

    # ---- checkpoints
    def save_checkpoint(self, directory: str, data_state: dict | None = None, keep: int | None = None) -> str:
        """Every rank: model, optimizer, LR scheduler, RNG and ``data_state`` after step ``step_count``
        (memx_launch.runtime.checkpoint: loads under another plan; ``keep`` newest step folders).
        Returns the step's folder."""
        from memx_launch.runtime.checkpoint import save_checkpoint

        if self.lr_scheduler is not None:  # a few numbers, the same on every rank: kept with the data state
            data_state = {**(data_state or {}), SCHEDULER_KEY: self.lr_scheduler.state_dict()}
        return save_checkpoint(directory, self.chunks, self.optimizer, self.step_count, data_state, self.plan, keep)

    def load_checkpoint(self, directory: str):
        """Every rank: the latest checkpoint in ``directory``, whatever plan wrote it; sets
        ``step_count`` to its step and returns its Resumed (None when there is none)."""
        from memx_launch.runtime.checkpoint import load_checkpoint

        resumed = load_checkpoint(directory, self.chunks, self.optimizer)
        if resumed is not None:
            self.step_count = resumed.step
            scheduler_state = resumed.data_state.pop(SCHEDULER_KEY, None)
            if self.lr_scheduler is not None and scheduler_state is not None:
                self.lr_scheduler.load_state_dict(scheduler_state)
            if self.emulated is not None:  # the optimizer state was created outside the guard
                self.emulated.track(t for state in self.optimizer.state.values() for t in state.values()
                                    if isinstance(t, torch.Tensor))
        return resumed

    # ---- reporting
    def progress_line(self, stats: StepStats) -> str:
        """Step, loss, step time, tokens/s, and per stage measured vs predicted peak memory and
        micro-batch compute time (emulated devices are labelled)."""
        parts = [f"step {stats.step}", f"loss {stats.loss:.6f}",
                 f"{stats.step_time_s:.3f} s/step (predicted {self.plan.predicted_iteration_time_s:.3f})",
                 f"{stats.tokens_per_s:,.0f} tok/s"]
        for i, stage in enumerate(self.plan.stages):
            label = f"{stage.device_type}{' emulated' if self.plan.emulated else ''}"
            parts.append(f"s{i} {label}: mem {stats.stage_peak_gib[i] * 1024:.1f}/"
                         f"{stage.predicted_peak_memory_gib * 1024:.1f} MiB, mb "
                         f"{stats.stage_compute_s[i] * 1e3:.1f}/{stage.predicted_stage_time_s * 1e3:.1f} ms")
        return " | ".join(parts) + "  (measured/predicted)"


def _out_of_memory(exc: BaseException | None) -> torch.OutOfMemoryError | None:
    """The out-of-memory error behind ``exc`` (pipelining wraps a stage's error in a RuntimeError)."""
    while exc is not None and not isinstance(exc, torch.OutOfMemoryError):
        exc = exc.__cause__ or exc.__context__
    return exc


def build(plan: Plan, rank: int | None = None, **kwargs) -> Runtime:
    """The runtime of device ``rank`` of the plan (default: torchrun's RANK)."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    if not dist.is_initialized():
        init_distributed(plan)
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
    init_distributed(plan)
    cluster = ClusterSpec.from_yaml(os.environ["MEMX_CLUSTER"]) if os.environ.get("MEMX_CLUSTER") else None
    if cluster is not None and cluster.world_size != dist.get_world_size():
        raise ConfigError("MEMX_CLUSTER", f"{cluster.name} declares {cluster.world_size} devices but the job has "
                          f"{dist.get_world_size()} ranks", "launch one process per declared device")
    rank = int(os.environ["RANK"])
    device = detect_rank_device(cluster, rank, int(os.environ.get("LOCAL_RANK", "0")))
    runtime = build(plan, rank, emulated=device.emulated, **kwargs)
    if os.environ.get("MEMX_RUN_DIR"):
        from memx_launch.runtime.supervisor import Supervisor
        runtime.supervisor = Supervisor(runtime, os.environ["MEMX_RUN_DIR"])
        runtime.supervisor.resume()
    return runtime
