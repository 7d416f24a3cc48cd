"""MemxCallback: memx's memory planning and monitoring inside a Lightning Trainer.

    from memx_callbacks import MemxCallback
    trainer = L.Trainer(..., callbacks=[MemxCallback(cluster="cluster.yaml", log_every_n_steps=10)])

At fit start every rank finds the LightningModule's transformer blocks (models/adapters.py), the
first rank of each device type calibrates a copy of one block, rank 0 fits memx's predictor and
decides (callbacks/planning.py) which blocks checkpoint their activations and the micro-batch size
(with gradient accumulation keeping the global batch); every rank applies the same decision.
Every ``log_every_n_steps`` optimizer steps the ranks agree on a memory sample (runtime/monitor.py)
and rank 0 sends measured against predicted peak memory to ``trainer.loggers``. Under memory
pressure all ranks take the same fix: more blocks checkpointed, in place; when every block is
already checkpointed, a checkpoint, a halved micro-batch written to the plan file, and a clean stop
(resume with ``ckpt_path``: ``state_dict`` carries the plan, so the resumed run keeps it).

An error memx explains (a bad setting, a model that does not fit) ends the script with one
``memx: error: ...`` line, as ``memx plan`` does, not a traceback (an exception hook for memx's
errors only; others keep theirs); an error every rank shares is printed by rank 0 alone.
"""

from __future__ import annotations

import os
import stat
import sys
import types

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.checkpoint import checkpoint

from memx_callbacks.planning import Decision, calibrate_blocks, decide
from memx_launch.errors import ConfigError, MemxError, NoFeasiblePlanError
from memx_launch.files import write_json_atomic
from memx_launch.models.adapters import ModelParts, find_blocks
from memx_launch.models.block_reading import own_block_training
from memx_launch.planning.extra_blocks import first_repeated_block
from memx_launch.planning.plan import Objective, Plan, StagePlan, recompute_text
from memx_launch.runtime.detection import detect_cluster
from memx_launch.runtime.messages import broadcast_json
from memx_launch.runtime.devices import detect_rank_device
from memx_launch.runtime.monitor import MemoryMonitor, MonitorConfig, free_shares, memory_reader
from memx_launch.runtime.prepare import frozen_share
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.catalog import get_model
from memx_launch.specs.precision import with_param_dtype
from memx_launch.specs.training import TrainingSpec

SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")


class MemxCallback(pl.Callback):
    def __init__(self, cluster: str | None = None, *, model: str | ModelSpec | None = None,
                 blocks: str | None = None, log_every_n_steps: int = 10, profile_db: str | None = None,
                 plan_file: str | None = None, monitor: MonitorConfig | None = None):
        """``cluster``: the cluster file (on CPUs it gives each rank its emulated device; None: detect
        the GPUs). ``model``: the shape to plan for (catalog name, config.json, ModelSpec); default the
        module's Hugging Face ``config``. ``blocks``: dotted path of the block list when memx does not
        find it. ``profile_db`` and ``plan_file`` default to files in the Trainer's root dir."""
        _one_line_memx_errors()
        if type(log_every_n_steps) is not int or log_every_n_steps < 1:  # True is an int to Python
            raise ConfigError("log_every_n_steps", f"must be a positive integer, got {log_every_n_steps!r}",
                              "e.g. log_every_n_steps=10")
        self.cluster_path, self.model, self.blocks_path = cluster, model, blocks
        self.profile_db, self.plan_file = profile_db, plan_file
        self.dtype = "fp32"
        """What the Trainer's precision calibrates and plans for (set at fit start)."""
        self.config = monitor or MonitorConfig(interval=log_every_n_steps)
        self.decision: Decision | None = None
        self.plan: Plan | None = None
        self.resumed = False
        self._blocks: list[torch.nn.Module] = []
        self._emulated = None
        self._monitor: MemoryMonitor | None = None
        self._comm = None
        """memx's communicator when the ranks span communication domains (it carries DDP's gradients)."""
        self._inside = False

    # ------------------------------------------------------------------ fit start
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = type(trainer.strategy).__name__
        if strategy not in SUPPORTED_STRATEGIES:
            raise ConfigError("strategy", f"MemxCallback does not apply its plan under {strategy}",
                              "use strategy='ddp' (or a single device), or drop MemxCallback")
        path = find_blocks(pl_module, self.blocks_path)  # no blocks: the one-line error, before any work
        self._blocks = list(pl_module.get_submodule(path).children())

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        cluster = ClusterSpec.from_yaml(self.cluster_path) if self.cluster_path else None
        rank = trainer.global_rank
        device = detect_rank_device(cluster, rank, trainer.local_rank)
        if cluster is None:
            cluster = ClusterSpec.from_dict(detect_cluster(device, trainer.local_rank, trainer.num_devices)[0])
        if cluster.world_size != trainer.world_size:
            raise ConfigError("cluster", f"{cluster.name} declares {cluster.world_size} devices but the Trainer runs "
                              f"{trainer.world_size}", "set Trainer(devices=..., num_nodes=...) to the cluster file")
        self._emulated = device.emulated
        self.dtype = _dtype(str(trainer.precision))
        spec = self._spec(pl_module)
        if self.decision is None:  # not restored from a checkpoint (load_state_dict runs before this)
            self.decision = self._plan(trainer, pl_module, spec, cluster, device)
        elif self.decision.num_blocks != len(self._blocks):
            raise ConfigError("checkpoint.decision", f"plans {self.decision.num_blocks} blocks but the module has "
                              f"{len(self._blocks)}", "resume with the model the checkpoint was written for")
        elif rank == 0:
            print(f"memx: resumed plan kept: {self._describe()}", flush=True)
        self._apply(trainer, pl_module)
        if cluster.crosses_domains:
            self._bridge_gradients(trainer, cluster)
        self.plan = self._as_plan(spec, cluster, trainer.world_size)
        self._monitor = MemoryMonitor(self.plan, rank, memory_reader(emulated=self._emulated,
                                                                      device=pl_module.device), self.config)
        if self._emulated is not None:  # weights and DDP buffers were made before the guard was on
            self._emulated.track(pl_module.parameters())

    def _bridge_gradients(self, trainer, cluster) -> None:
        """Ranks of several vendors: DDP's gradient all-reduce becomes memx's hierarchical sum,
        native inside each vendor's domain and over the bridge between (runtime/communication.py)."""
        from memx_launch.runtime.communication import Communicator, local_device

        ddp = trainer.strategy.model
        if dist.get_backend() == "nccl" or not hasattr(ddp, "register_comm_hook"):
            raise ConfigError("strategy", f"{cluster.name} spans the domains {sorted(set(cluster.rank_domains()))}, "
                              f"which one {dist.get_backend()} process group cannot join",
                              "use DDPStrategy(process_group_backend='gloo'): memx carries the gradients between them")
        self._comm = Communicator(cluster.rank_domains(), local_device(), emulated=self._emulated)
        self._comm.prepare_all_reduce(range(trainer.world_size))
        ddp.register_comm_hook(None, self._comm.ddp_comm_hook)
        if trainer.global_rank == 0:
            print(f"memx: gradients cross domains {sorted(set(cluster.rank_domains()))}: summed natively inside "
                  "each, over the bridge between", flush=True)

    def _spec(self, pl_module) -> ModelSpec:
        if isinstance(self.model, ModelSpec):
            spec = self.model
        elif self.model is not None:
            spec = get_model(self.model)
        else:
            config = next((m.config for m in pl_module.modules() if hasattr(getattr(m, "config", None), "to_dict")),
                          None)
            if config is None:
                raise ConfigError("model", f"memx cannot read the shape of {type(pl_module).__name__}",
                                  "pass MemxCallback(model='path/config.json') or a ModelSpec")
            spec = model_from_hf_dict(config.to_dict(), getattr(config, "name_or_path", "") or "module")
        if spec.num_layers != len(self._blocks):
            raise ConfigError("model", f"{spec.name} has {spec.num_layers} layers but the module has "
                              f"{len(self._blocks)} blocks", "pass the model's own config, or blocks='path'")
        return spec

    def _plan(self, trainer, pl_module, spec, cluster, device) -> Decision:
        from memx_launch.profiling.predictor import load_cost_model

        batch = self._user_batch_size(pl_module)
        accumulation = trainer.accumulate_grad_batches
        training = planned_training(str(trainer.precision), frozen_share(pl_module),
                                    global_batch_size=batch * accumulation * trainer.world_size, seq_len=spec.seq_len)
        root = trainer.default_root_dir
        db = self.profile_db or os.path.join(root, "memx-profiles.jsonl")
        if os.path.exists(db) and dist.is_initialized():  # every rank must agree: a fresh profile per fit
            dist.barrier()
        if trainer.global_rank == 0 and os.path.lexists(db):
            _set_aside(db)
        if dist.is_initialized():
            dist.barrier()
        parts = ModelParts(pl_module, self.blocks_path)
        parts.repeated_block = first_repeated_block(spec)  # a mixture's first expert block, after its dense ones
        training, own = own_block_training(training, parts.blocks[parts.repeated_block], spec)  # GPT-2's one c_attn
        calibrate_blocks(spec, cluster, device, parts.block_probe, training, db, batch, log=_log_rank0(trainer),
                         block_options=own)
        payload = None
        if trainer.global_rank == 0:
            cost_model = load_cost_model(db, spec, cluster, training)
            try:
                decision = decide(spec, cluster, training, world=trainer.world_size, tp=1,
                                  num_blocks=len(self._blocks), user_micro_batch=batch,
                                  user_accumulation=accumulation, headroom=self.config.min_headroom,
                                  cost_model=cost_model)
                payload = decision.to_dict()
            except NoFeasiblePlanError as exc:  # the other ranks wait for the decision: send them the error
                payload = {"no_feasible_plan": str(exc)}
        if dist.is_initialized():  # JSON bytes: torch's object collectives pickle
            payload = broadcast_json(payload, src=0)
        if "no_feasible_plan" in payload:
            error = NoFeasiblePlanError(payload["no_feasible_plan"])
            error.said_by_rank_0 = trainer.global_rank != 0  # one line per job, not per rank
            raise error
        decision = Decision.from_dict(payload)
        if trainer.global_rank == 0:
            print(f"memx: plan for {spec.name} on {cluster.name}: {self._describe(decision)}", flush=True)
        return decision

    def _user_batch_size(self, pl_module) -> int:
        if not lightning_hasattr(pl_module, "batch_size"):
            raise ConfigError("batch_size", f"{type(pl_module).__name__} has no batch_size attribute",
                              "give the LightningModule (or its DataModule) a batch_size that train_dataloader "
                              "uses, as Lightning's batch size finder needs")
        return int(lightning_getattr(pl_module, "batch_size"))

    def _apply(self, trainer, pl_module) -> None:
        d = self.decision
        if self._user_batch_size(pl_module) != d.micro_batch_size:
            lightning_setattr(pl_module, "batch_size", d.micro_batch_size)
        trainer.accumulate_grad_batches = d.accumulate_grad_batches
        for i, block in enumerate(self._blocks):
            _checkpointed(block, i < d.recompute_blocks)

    def _as_plan(self, spec, cluster, world) -> Plan:
        """A one-stage plan of the decision, for the monitor (it compares against stages)."""
        d = self.decision
        types = cluster.rank_device_types()
        stage = StagePlan(types[0], list(range(world)), spec.num_layers,
                          recompute_text("full", d.recompute_blocks, d.num_blocks), d.predicted_peak_gib, 0.0,
                          d.capacity_gib)
        return Plan(spec.name, spec, cluster.name, 1, 1, world, d.micro_batch_size,
                    d.micro_batch_size * d.accumulate_grad_batches * world, spec.seq_len, "1f1b", 1, [stage], 0.0,
                    Objective(0.0, "lightning", (0.0, 1.0, 0.0)), emulated=cluster.is_emulated,
                    training={"dtype": self.dtype})

    def _describe(self, d: Decision | None = None) -> str:
        d = d or self.decision
        return (f"micro-batch {d.micro_batch_size} x {d.accumulate_grad_batches} accumulated, "
                f"{d.recompute_blocks}/{d.num_blocks} blocks checkpointed, predicted peak "
                f"{d.predicted_peak_gib * 1024:.2f} of {d.capacity_gib * 1024:.2f} MiB")

    # ------------------------------------------------------------------ every step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._emulated is not None:
            self._emulated.__enter__()
            self._inside = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._leave_emulation()
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-accumulation: no optimizer step yet
        step = trainer.global_step
        event = self._monitor.after_step(step)
        if self._monitor.last_table is not None and step % self.config.interval == 0:
            self._log(trainer, step)
        if event is not None and event.reason != "above_prediction":
            self._fix(trainer, event)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._leave_emulation()

    def _leave_emulation(self) -> None:
        if self._inside:
            self._emulated.__exit__(None, None, None)
            self._inside = False

    def _log(self, trainer, step: int) -> None:
        table = self._monitor.last_table
        gib = 2**30
        metrics = {"memx/stage0/peak_gib": float(table[:, 0].max()) / gib,
                   "memx/stage0/predicted_gib": self.decision.predicted_peak_gib,
                   "memx/stage0/free_fraction": float(free_shares(table).min()),
                   "memx/recompute_blocks": float(self.decision.recompute_blocks)}
        if self._comm is not None:  # what this rank sent and received across domains so far
            metrics["memx/bridge_mib"] = self._comm.traffic.bytes / 2**20
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _fix(self, trainer, event) -> None:
        """The same on every rank (the event is): more checkpointing in place, else stop and resume."""
        d = self.decision
        observed = max(v for v in event.observed_gib if v == v)
        excess = observed - d.capacity_gib * (1 - self.config.min_headroom)
        if d.recompute_blocks < d.num_blocks:
            # The fewest more checkpointed blocks whose prediction drops by what was observed over it.
            target = d.peak_with(d.recompute_blocks) - excess
            d.recompute_blocks = d.blocks_to_fit(target, at_least=d.recompute_blocks + 1) or d.num_blocks
            for i, block in enumerate(self._blocks):
                _checkpointed(block, i < d.recompute_blocks)
            self._say(trainer, f"memx: {event.message} at step {event.step}: now {self._describe()}")
            return
        if d.micro_batch_size == 1:
            self._say(trainer, f"memx: {event.message} at step {event.step} and nothing left to recompute or split")
            return
        d.micro_batch_size //= 2
        d.accumulate_grad_batches *= 2
        # The resumed fit keeps this decision: its peaks are those of the doubled micro-batch, an
        # over-estimate, so the run restarts with no block checkpointed and re-checkpoints only
        # where memory says so.
        d.recompute_blocks = 0
        path = os.path.join(trainer.default_root_dir, f"memx-replan-step{event.step}.ckpt")
        trainer.save_checkpoint(path)
        if trainer.global_rank == 0:
            write_json_atomic(self.plan_file or os.path.join(trainer.default_root_dir, "memx-plan.json"),
                              {"decision": d.to_dict(), "checkpoint": path, "event": event.to_dict()}, overwrite=True)
        self._say(trainer, f"memx: {event.message}: stopping with micro-batch {d.micro_batch_size}; resume with "
                           f"trainer.fit(..., ckpt_path={path!r})")
        trainer.should_stop = True

    @staticmethod
    def _say(trainer, message: str) -> None:
        if trainer.global_rank == 0:
            print(message, flush=True)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {"decision": self.decision.to_dict() if self.decision is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("decision"):
            self.decision = Decision.from_dict(state_dict["decision"])
            self.resumed = True


def _one_line_memx_errors() -> None:
    """Uncaught memx errors print as one line and exit with their code (2, or 3 when nothing fits)."""
    previous = sys.excepthook
    if getattr(previous, "memx", False):
        return

    def hook(kind, error, tb):
        if not issubclass(kind, MemxError):
            return previous(kind, error, tb)
        if not getattr(error, "said_by_rank_0", False):
            print(f"memx: error: {error}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)  # unlike the default hook's 1: the code memx plan gives

    hook.memx = True
    sys.excepthook = hook


def _set_aside(db: str) -> None:
    """Keep the previous profile under the first free ``<db>.old[.N]`` name: only a regular file
    is renamed, and nothing is ever replaced (it may be the user's own profile)."""
    if not stat.S_ISREG(os.lstat(db).st_mode):
        raise ConfigError("profile_db", f"{db} is not a regular file (a link, directory or device)",
                          "pass a file name for memx's calibration profile, or leave profile_db unset")
    for n in range(1000):
        kept = db + ".old" + (f".{n}" if n else "")
        try:  # a hard link fails when the name exists, so nothing is overwritten
            os.link(db, kept)
        except FileExistsError:
            continue
        os.unlink(db)
        return
    raise ConfigError("profile_db", f"{db}.old to {db}.old.999 all exist", "delete the old profiles you no longer need")


def _checkpointed(block: torch.nn.Module, on: bool) -> None:
    """Recompute the block's activations in backward (non-reentrant activation checkpointing)."""
    if on and "forward" not in block.__dict__:
        original = block.forward
        block.forward = types.MethodType(lambda self, *a, **k: checkpoint(original, *a, use_reentrant=False, **k),
                                         block)
    elif not on:
        block.__dict__.pop("forward", None)


def planned_training(precision: str, frozen_fraction: float, **batch) -> TrainingSpec:
    """What a Trainer of ``precision`` trains, as planned: "-mixed" autocast over fp32 weights,
    "-true" the module in that dtype (16-bit weights, gradients and Adam moments, no fp32 copy);
    the module's frozen share (fine-tuning). Lightning's DDP is torch's (``--setup ddp``): its
    default gradient_as_bucket_view=False (a copy of the gradients), the gradients' reduction
    overlapping the backward, the module's eager ops, its gradients accumulated by torch's
    AccumulateGrad and freed only after the next forward (Lightning's closure runs zero_grad between
    training_step and backward), torch's cross entropy on the whole logits (the module's training_step), and
    the callback's non-reentrant checkpoint; the block's projections and norms as the module's
    own modules run them (models/block_reading.py, at calibration)."""
    dtype = _dtype(precision)
    training = TrainingSpec(**batch, dtype=dtype, setup="ddp", weights_dtype=_weights_dtype(precision),
                            frozen_fraction=frozen_fraction, zero_grad_after_forward=True)
    return training if precision.endswith("-mixed") else with_param_dtype(training, dtype)


def _weights_dtype(precision: str) -> str | None:
    """memx's weights_dtype of a Lightning precision setting: "-mixed" is autocast over fp32
    weights (None: the training dtype's, "-true")."""
    return "fp32" if precision.endswith("-mixed") else None


def _dtype(precision: str) -> str:
    """memx's dtype of a Lightning precision setting ("bf16-mixed", "16-mixed", "32-true", ...)."""
    if precision.startswith("bf16"):
        return "bf16"
    return "fp16" if precision.startswith("16") else "fp32"


def _log_rank0(trainer):
    return lambda message: print(message, flush=True) if trainer.global_rank == 0 else None
