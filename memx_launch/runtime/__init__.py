"""The torch-native backend: applies a Plan on this rank and trains with it.

Training scripts use it in three lines::

    runtime = memx_launch.runtime.from_env()          # or build(plan, rank)
    batch = runtime.local_batch(tokens)               # this DP replica's share
    stats = runtime.step(tokens, targets)             # one optimizer step, all micro-batches

Per rank: a [pp][dp][tp] DeviceMesh from the plan's stage ranks, the rank's model chunks
(LlamaStage with the stage's uneven layer count and recompute level), DTensor tensor parallel
inside the stage, DDP (FSDP2 with TP) across the stage's DP replicas, and torch.distributed.pipelining with
Schedule1F1B or ScheduleInterleaved1F1B (plan.virtual_stages chunks per rank).
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from memx_launch.errors import ConfigError
from memx_launch.llama import LlamaStage, apply_tensor_parallel
from memx_launch.plan import Plan
from memx_launch.runtime.emulation import GIB, EmulatedDevice
from memx_launch.runtime.layout import RankLayout, mesh_ranks, rank_layout

DEFAULT_LR = 3e-4


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


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over the micro-batch's tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def init_distributed() -> None:
    """Join the job's process group from torchrun's variables, under a per-generation key prefix:
    after an in-place restart the agent's store still holds the previous generation's keys."""
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
    generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=dist.PrefixStore(f"memx/generation{generation}", store),
                            rank=rank, world_size=world)


class Runtime:
    """The plan applied on one rank. Build it with :func:`build` or :func:`from_env`."""

    def __init__(self, plan: Plan, rank: int, *, emulated: EmulatedDevice | None = None,
                 lr: float = DEFAULT_LR, seed: int = 0, data_parallel: str = "auto"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        if dist.get_world_size() != plan.world_size:
            raise ConfigError("plan.world_size", f"the plan needs {plan.world_size} ranks but the job has "
                              f"{dist.get_world_size()}", f"launch with --nproc-per-node {plan.world_size} "
                              "or re-plan for this job")
        self.plan = plan
        self.layout: RankLayout = rank_layout(plan, rank)
        self.stage_plan = plan.stages[self.layout.stage]
        self.emulated = emulated
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.step_count = 0
        self.mesh = DeviceMesh(self.device.type, torch.tensor(mesh_ranks(plan)), mesh_dim_names=("pp", "dp", "tp"))
        with self._measured():
            self.chunks = [self._build_chunk(c, seed, data_parallel) for c in self.layout.chunks]
        num_virtual = plan.pp * plan.virtual_stages
        pp_group = self.mesh["pp"].get_group()
        stages = [PipelineStage(module, chunk.virtual_stage, num_virtual, self.device, group=pp_group)
                  for module, chunk in zip(self.chunks, self.layout.chunks)]
        if plan.virtual_stages == 1:
            self.schedule = Schedule1F1B(stages[0], plan.num_microbatches, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, plan.num_microbatches, loss_fn=loss_fn)
        self.optimizer = torch.optim.AdamW([p for m in self.chunks for p in m.parameters()], lr=lr)

    def _build_chunk(self, chunk, seed: int, data_parallel: str) -> torch.nn.Module:
        module = LlamaStage(self.plan.model_spec, chunk.num_layers, first=chunk.first, last=chunk.last,
                            recompute=self.stage_plan.recompute, layer_offset=chunk.layer_offset,
                            seed=seed).to(self.device)
        if self.plan.tp > 1:
            apply_tensor_parallel(module, self.mesh["tp"])
        if self.plan.dp > 1:
            # DDP keeps whole gradients and optimizer state per replica, as the cost model assumes
            # without a distributed optimizer; DDP cannot hold DTensor parameters, so TP uses FSDP2.
            if data_parallel == "fsdp" or (data_parallel == "auto" and self.plan.tp > 1):
                from torch.distributed.fsdp import fully_shard
                fully_shard(module, mesh=self.mesh["dp"])
            else:
                from torch.nn.parallel import DistributedDataParallel
                module = DistributedDataParallel(module, process_group=self.mesh["dp"].get_group())
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
        if self.emulated is not None:
            self.emulated.reset_peak()
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        with self._measured():
            self.optimizer.zero_grad(set_to_none=True)
            args = (tokens.to(self.device),) if self.layout.is_first_stage else ()
            target = targets.to(self.device) if self.layout.is_last_stage else None
            self.schedule.step(*args, target=target, losses=losses if self.layout.is_last_stage else None)
            self.optimizer.step()
        step_time = time.perf_counter() - start
        self.step_count += 1
        return self._gather_stats(losses, step_time)

    def _gather_stats(self, losses: list[torch.Tensor], step_time: float) -> StepStats:
        # One loss per pipeline: the last stage's TP rank 0 of each DP replica contributes it.
        contributes = self.layout.is_last_stage and self.layout.tp_index == 0
        local_loss = torch.stack([l.detach().float() for l in losses]).mean().item() if contributes else 0.0
        if self.emulated is not None:
            peak = self.emulated.peak_bytes / GIB
            compute = (self.emulated.compute_s + self.emulated.slept_s) / self.plan.num_microbatches
        elif self.device.type == "cuda":
            peak, compute = torch.cuda.max_memory_allocated() / GIB, float("nan")
        else:
            peak = compute = float("nan")
        row = torch.tensor([local_loss, peak, compute, step_time], dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        table = torch.stack(rows)
        stage_peak, stage_compute = [], []
        for stage in self.plan.stages:
            sub = table[stage.ranks]
            stage_peak.append(sub[:, 1].max().item())
            stage_compute.append(sub[:, 2].max().item())
        step_time = table[:, 3].max().item()
        tokens = self.plan.global_batch_size * self.plan.seq_len
        return StepStats(self.step_count, table[:, 0].sum().item() / self.plan.dp, step_time,
                         tokens / step_time, stage_peak, stage_compute)

    # ---- checkpoints
    def state_dict(self) -> dict:
        """This rank's model chunks and optimizer (plain tensors, layer names are global)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_state, optim_state = get_state_dict(self.chunks, self.optimizer)
        return {"model": model_state, "optimizer": optim_state, "step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.chunks, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step_count = int(state["step"])


def build(plan: Plan, rank: int | None = None, **kwargs) -> Runtime:
    """The runtime of ``rank`` (default: this process's rank) in an initialised process group."""
    if not dist.is_initialized():
        init_distributed()
    return Runtime(plan, dist.get_rank() if rank is None else rank, **kwargs)
