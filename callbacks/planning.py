"""What the Lightning callback decides at fit start, apart from Lightning itself: calibrate the
module's own block on each device type, then pick the micro-batch size and the number of blocks
that recompute their activations under the Trainer's data-parallel layout.

Under DDP every rank holds the whole model and all its blocks' activations are alive together at
the peak: with the first k of N blocks checkpointed, the predicted peak is memx's estimate of the
layout (pp=1, dp=world, tp=1) with recompute ``full:k`` (Megatron's block method: k blocks at
full, the rest keeping everything, the working set of a recomputed block once k > 0). The
user's micro-batch is kept when some k fits under the
capacity less the monitor's headroom on every device type; otherwise the micro-batch halves, with
gradient accumulation keeping the global batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch.distributed as dist

from memx_launch.runtime.messages import all_gather_json
from memx_launch.errors import ConfigError, NoFeasiblePlanError
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.plan import RECOMPUTE_LEVELS, recompute_text
from memx_launch.planning.report import format_gib
from memx_launch.profiling.design import minimal_sample_set
from memx_launch.profiling.kernel import calibrate
from memx_launch.profiling.profiledb import Measurement, ProfileDB
from memx_launch.profiling.space import ProfileSpace, Sample
from memx_launch.specs.checks import reject_unknown, require_number
from memx_launch.specs.model import MAX_DIMENSION

CALIBRATION_BUDGET = 12


@dataclass
class Decision:
    """The part of a plan that applies under the Trainer's strategy."""

    micro_batch_size: int
    accumulate_grad_batches: int
    recompute_blocks: int
    """The first this many blocks recompute their activations in the backward pass (full)."""
    peaks_gib: list[float]
    """Per rank, the predicted peak with the first k blocks checkpointed, k = 0 .. all of them."""
    capacity_gib: float

    @property
    def num_blocks(self) -> int:
        return len(self.peaks_gib) - 1

    @property
    def predicted_peak_gib(self) -> float:
        """With ``recompute_blocks`` checkpointed."""
        return self.peaks_gib[self.recompute_blocks]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "checkpoint.decision") -> "Decision":
        """A decision a checkpoint, a plan file or rank 0 wrote, checked (a checkpoint can be
        edited); older memx wrote no ``peaks_gib``."""
        fix = "fit without ckpt_path, or drop the callback's state from the checkpoint"
        if not isinstance(data, dict):
            raise ConfigError(where, f"not a decision ({type(data).__name__})", fix)
        if "peaks_gib" not in data:
            raise ConfigError(where, "written by an older memx (no peaks_gib)", fix)
        names = {f.name for f in fields(cls)}
        reject_unknown(data, names | {"predicted_peak_gib"}, where)  # predicted_peak_gib is derived
        missing = sorted(names - set(data))
        if missing:
            raise ConfigError(f"{where}.{missing[0]}", "missing", fix)
        peaks = data["peaks_gib"]
        if not isinstance(peaks, list) or not 1 <= len(peaks) <= MAX_DIMENSION + 1:
            raise ConfigError(f"{where}.peaks_gib", "must list the predicted peaks, one per number of blocks", fix)
        for peak in peaks:
            require_number(peak, f"{where}.peaks_gib", lo=0, fix=fix)
        for name in ("micro_batch_size", "accumulate_grad_batches"):
            require_number(data[name], f"{where}.{name}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True, fix=fix)
        require_number(data["recompute_blocks"], f"{where}.recompute_blocks", lo=0, hi=len(peaks) - 1, integer=True,
                       fix=fix)
        require_number(data["capacity_gib"], f"{where}.capacity_gib", lo=0, lo_open=True, fix=fix)
        return cls(**{k: data[k] for k in names})

    def peak_with(self, k: int) -> float:
        return self.peaks_gib[k]

    def blocks_to_fit(self, target_gib: float, at_least: int = 0) -> int | None:
        """The fewest checkpointed blocks (``at_least`` or more) whose predicted peak is at most
        ``target_gib``."""
        return next((k for k in range(at_least, len(self.peaks_gib)) if self.peaks_gib[k] <= target_gib), None)


def calibrate_blocks(spec, cluster, rank_device, probe, training, db_path: str, max_micro_batch: int, log,
                     block_options: dict | None = None) -> str:
    """The first rank of each device type measures the module's block (``probe``: recompute level ->
    a copy of one block) at a minimal set of micro-batch sizes and recompute levels; rank 0 appends
    every type's samples to the profile at ``db_path``. ``block_options``: the training options the
    block's own modules changed (models/block_reading.py), which its records say they ran with.
    Collective (a single process without a process group is rank 0 alone)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    types = cluster.rank_device_types()
    mine = types[rank]
    lines: list[str] = []
    if types.index(mine) == rank:
        mbs = tuple(2**i for i in range(int(math.log2(max(1, max_micro_batch))) + 1))
        default = Sample(1, mbs[len(mbs) // 2], training.seq_len, "none", spec.num_kv_heads)
        space = ProfileSpace({"tp": (1,), "micro_batch_size": mbs, "seq_len": (training.seq_len,),
                              "recompute": RECOMPUTE_LEVELS, "num_kv_heads": (spec.num_kv_heads,)}, default)
        emulated = rank_device.emulated
        device = "cpu" if emulated is not None or not _cuda() else "cuda"

        # Learned against the blocks of the callback's setup (--setup ddp) as calibration runs them: fp32 weights,
        # under autocast in 16 bits, whose copies of them the records' ratios must not take for activations.
        run_options = {"setup": training.setup, "weights_dtype": "fp32", **(block_options or {})}

        def measure(samples):
            return calibrate(spec, rank_device.device_type, samples, device=device, dtype=training.dtype,
                             num_blocks=2, repeats=2, block_factory=probe, run_options=run_options,
                             emulation_slowdown=emulated.slowdown if emulated is not None else None)

        result = minimal_sample_set(space, measure, budget=CALIBRATION_BUDGET)
        lines = [m.to_json() for m in result.measurements]
        log(f"memx: calibrated {mine} on rank {rank}: {len(lines)} samples of the module's own block")
    gathered = all_gather_json(lines)
    if rank == 0:
        db = ProfileDB(db_path)
        import json
        db.append(Measurement.from_dict(json.loads(line)) for part in gathered for line in part)
    if dist.is_initialized():
        dist.barrier()
    return db_path


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def decide(spec, cluster, training, *, world: int, tp: int, num_blocks: int, user_micro_batch: int,
           user_accumulation: int, headroom: float, cost_model=None) -> Decision:
    """The micro-batch size and checkpointed block count for this layout (module docstring)."""
    dp = world // tp
    counts = cluster.type_counts()  # DDP's one stage holds every device: its replicas on each type
    stage_devices = None if len(counts) == 1 else ["+".join(f"{name}*{n // tp}" for name, n in counts.items())]
    local = user_micro_batch * user_accumulation
    mbs = user_micro_batch
    while mbs >= 1:
        if local % mbs == 0:
            peaks = []
            for k in range(num_blocks + 1):
                plan = evaluate_layout(spec, cluster, training, tp=tp, pp=1, dp=dp, micro_batch_size=mbs,
                                       recompute=[recompute_text("full", k, num_blocks)], stage_devices=stage_devices,
                                       cost_model=cost_model, references=(1.0, 1.0, 1.0))
                peaks.append(plan.stages[0].predicted_peak_memory_gib)
            capacity = plan.stages[0].memory_capacity_gib
            decision = Decision(mbs, local // mbs, 0, peaks, capacity)
            k = decision.blocks_to_fit(capacity * (1 - headroom))
            if k is not None:
                decision.recompute_blocks = k
                return decision
        mbs //= 2
    usable = capacity * (1 - headroom)
    raise NoFeasiblePlanError(f"{spec.name} does not fit in {cluster.name} under DDP even with micro-batch 1 and "
                              f"every block recomputed: {plan.stages[0].device_type} short "
                              f"{format_gib(peaks[-1] - usable)} per device ({format_gib(peaks[-1])} predicted, "
                              f"{format_gib(usable)} usable with {headroom:.0%} left free); use more devices, "
                              "a sharded strategy, or a smaller model")

