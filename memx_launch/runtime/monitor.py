"""Memory monitor: per rank peak memory and capacity every N steps, predicted against observed per
stage, and a re-plan event that every rank agrees on.

Every sampled step each rank reads its memory and the ranks all-gather one row of two numbers
(its peak and its capacity), so every rank holds the same table and runs the same decision on
it: the event (or None) is identical everywhere without a second collective. Steps between
samples cost nothing.

What is read, the peak as the plan predicts it (a stage's predicted peak holds its tensors, the
allocator's slack, the runtime's context and the communicators' buffers):
- GPUs: the device memory the process held at its peak, as ``nvidia-smi`` counts it: the caching
  allocator's peak reserve (``torch.cuda.max_memory_reserved``) and what the process holds
  outside the allocator (the CUDA/HIP context, NCCL's buffers: the device's used memory less the
  allocator's current reserve and other processes'). Other processes' memory comes from
  nvidia-ml-py (its process list, read at most once a second) where it lists this process;
  inside a container's PID namespace the driver lists the host's PIDs (nvidia-docker#1483), so
  no entry can be told to be another's, and none is subtracted (memx runs one rank per device).
  The capacity is the device total less other processes' memory.
- Emulated CPU devices (profiling/emulation.py): the emulation's exact live-tensor count against
  its capacity (an emulated type's plan counts nothing else). Plain CPU without emulation has no
  capacity to watch and is not supported (process RSS misses freed-but-mapped blocks, and the
  profiler's memory events cost a step).

An out-of-memory error cannot be agreed on by a collective: the other pipeline ranks are
blocked on the failed rank. The rank that saw it saves the event (:func:`oom_event` then
``ReplanEvent.save``) and fails; the launcher re-plans from the saved event when it restarts.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memx_launch.errors import ConfigError
from memx_launch.planning.plan import Plan
from memx_launch.planning.replan import DEFAULT_MIN_HEADROOM, ReplanEvent
from memx_launch.runtime.layout import process_rank
from memx_launch.specs.inputs import parse_number

GIB = 2**30
# NVML's process list is read at most once in this many seconds: the runtime reads the peak every
# step, and other processes' memory changes far more slowly than a short step.
OTHERS_REFRESH_S = 1.0
log = logging.getLogger("memx.monitor")


@dataclass
class MonitorConfig:
    interval: int = 10
    """Sample every this many steps (step % interval == 0)."""
    min_headroom: float = DEFAULT_MIN_HEADROOM
    """Free share of a rank's capacity below which the rank is under pressure."""
    consecutive: int = 3
    """Samples in a row under min_headroom before re-planning (one spike is not pressure)."""
    above_prediction: float = 0.25
    """Re-plan when a rank's peak passes its stage's prediction by more than this share."""

    def __post_init__(self):
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ConfigError("monitor.interval", f"must be a positive integer, got {self.interval!r}",
                              "e.g. MEMX_MONITOR_INTERVAL=10")
        if not 0 <= self.min_headroom < 1:
            raise ConfigError("monitor.min_headroom", f"must be in [0, 1), got {self.min_headroom!r}",
                              "e.g. MEMX_MIN_HEADROOM=0.10")
        if not isinstance(self.consecutive, int) or self.consecutive < 1:
            raise ConfigError("monitor.consecutive", f"must be a positive integer, got {self.consecutive!r}",
                              "e.g. MEMX_PRESSURE_SAMPLES=3")
        if not 0 < self.above_prediction < math.inf:
            raise ConfigError("monitor.above_prediction", f"must be positive, got {self.above_prediction!r}",
                              "e.g. MEMX_ABOVE_PREDICTION=0.25")

    @classmethod
    def from_env(cls, environ=os.environ) -> "MonitorConfig":
        """MEMX_MONITOR_INTERVAL, MEMX_MIN_HEADROOM, MEMX_PRESSURE_SAMPLES, MEMX_ABOVE_PREDICTION."""
        kwargs = {}
        for var, name, kind in (("MEMX_MONITOR_INTERVAL", "interval", int), ("MEMX_MIN_HEADROOM", "min_headroom", float),
                                ("MEMX_PRESSURE_SAMPLES", "consecutive", int),
                                ("MEMX_ABOVE_PREDICTION", "above_prediction", float)):
            if var in environ:
                kwargs[name] = parse_number(environ[var], kind, var, f"set {var} to a number, e.g. "
                                            f"{var}={getattr(cls, name)}")
        return cls(**kwargs)


@dataclass
class MemoryReading:
    peak_bytes: float
    """Most device memory the process held since the last reset, as the plan predicts it."""
    capacity_bytes: float
    """What this process may use: the device total less other processes' memory."""


class EmulatedMemory:
    """Reads an emulated device (profiling/emulation.py); its guard's count is exact."""

    def __init__(self, device):
        self.device = device

    def read(self) -> MemoryReading:
        return MemoryReading(float(self.device.peak_bytes), float(self.device.capacity_bytes))

    def reset(self) -> None:
        self.device.reset_peak()


class CudaMemory:
    """Reads the CUDA caching allocator and, through NVML, the device's total and other processes."""

    def __init__(self, device: torch.device):
        self.device = device
        self._nvml = None
        self._others: tuple[float, int] | None = None  # (when read, bytes)
        try:
            from memx_launch.profiling.kernel import nvml_device

            self._nvml = nvml_device(device.index if device.index is not None else torch.cuda.current_device())
        except Exception as exc:  # noqa: BLE001 - no NVML (other vendors, containers): torch's view only
            log.warning("nvidia-ml-py unavailable (%s): other processes' memory on the device is not subtracted", exc)

    def read(self) -> MemoryReading:
        free, total = torch.cuda.mem_get_info(self.device)
        others = self._others_bytes()
        outside = max(0, total - free - others - torch.cuda.memory_reserved(self.device))  # context, NCCL
        return MemoryReading(float(torch.cuda.max_memory_reserved(self.device) + outside), float(total - others))

    def _others_bytes(self) -> int:
        """Other processes' memory on the device, where NVML lists this process beside them."""
        if self._nvml is None:
            return 0
        now = time.monotonic()
        if self._others is None or now - self._others[0] >= OTHERS_REFRESH_S:
            pynvml, handle = self._nvml
            processes, pid = pynvml.nvmlDeviceGetComputeRunningProcesses(handle), os.getpid()
            listed = any(p.pid == pid for p in processes)  # else another PID namespace: whose is whose is unknown
            self._others = (now, sum(p.usedGpuMemory or 0 for p in processes if p.pid != pid) if listed else 0)
        return self._others[1]

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def device_memory(emulated=None, device: torch.device | None = None):
    """The reader of this rank's memory: its emulated device's when it has one, else its CUDA
    device's (``device``, or the current one); None on a plain CPU, which has nothing to read."""
    if emulated is not None:
        return EmulatedMemory(emulated)
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)
    return CudaMemory(device) if device is not None and device.type == "cuda" else None


def memory_reader(emulated=None, device: torch.device | None = None):
    """:func:`device_memory` for the monitor, which needs one: an error on a plain CPU."""
    reader = device_memory(emulated, device)
    if reader is None:
        raise ConfigError("monitor", "no GPU and no emulated device on this rank",
                          "declare emulated devices in the cluster file, or pass --no-replan")
    return reader


def free_shares(table: torch.Tensor) -> torch.Tensor:
    """Per rank of a monitor table (peak, capacity), the share of its capacity its peak left free."""
    return 1 - table[:, 0] / table[:, 1]


class MemoryMonitor:
    """Call :meth:`after_step` on every rank after every optimizer step."""

    COLUMNS = 2  # peak, capacity

    def __init__(self, plan: Plan, rank: int, reader, config: MonitorConfig | None = None, group=None):
        """``rank``: this device's rank in the plan; rank 0 logs."""
        self.plan = plan
        self.rank = rank
        self.reader = reader
        self.config = config or MonitorConfig()
        self.group = group
        self.low_samples = 0
        self.last_table: torch.Tensor | None = None
        """[world, 2] bytes of the latest sample (identical on every rank)."""
        self._stage_of = {r: i for i, s in enumerate(plan.stages) for r in s.ranks}
        # Rows arrive in process-rank order (stage-major, runtime/layout.py); the table and the
        # event speak of the plan's (device) ranks.
        self._rows_by_rank = [process_rank(plan, r) for r in range(plan.world_size)]

    def after_step(self, step: int) -> ReplanEvent | None:
        """None, or the re-plan event every rank returns for this same step."""
        if step % self.config.interval:
            return None
        reading = self.reader.read()
        self.reader.reset()
        row = torch.tensor([reading.peak_bytes, reading.capacity_bytes], dtype=torch.float64)
        if not dist.is_initialized():  # one process without a process group (Lightning on one device)
            rows = [row]
        else:
            if dist.get_backend(self.group) == "nccl":
                row = row.cuda()
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()[self._rows_by_rank]
        self.last_table = table
        event = self._decide(step, table)
        if self.rank == 0:
            log.info("%s", self.describe(step, table))
            if event is not None:
                log.warning("re-plan at step %d: %s", step, event.message)
        return event

    def _decide(self, step: int, table: torch.Tensor) -> ReplanEvent | None:
        c = self.config
        peak, capacity = table[:, 0], table[:, 1]
        headroom = free_shares(table)
        worst = int(headroom.argmin())
        self.low_samples = self.low_samples + 1 if headroom[worst] < c.min_headroom else 0
        if self.low_samples >= c.consecutive:
            return self._event(step, "headroom", worst, table, (
                f"{headroom[worst]:.1%} free ({peak[worst] / GIB:.4f} of {capacity[worst] / GIB:.4f} GiB) "
                f"< {c.min_headroom:.0%} for {self.low_samples} samples in a row"))
        predicted = torch.tensor([self.plan.stages[self._stage_of[r]].predicted_peak_memory_gib * GIB
                                  for r in range(len(table))], dtype=torch.float64)
        ratio = torch.where(predicted > 0, peak / predicted, torch.zeros_like(peak))
        over = int(ratio.argmax())
        if ratio[over] > 1 + c.above_prediction:
            return self._event(step, "above_prediction", over, table, (
                f"peak {peak[over] / GIB:.4f} GiB is {ratio[over]:.2f}x the predicted "
                f"{predicted[over] / GIB:.4f} GiB (> {1 + c.above_prediction:.2f}x)"))
        return None

    def _event(self, step: int, reason: str, rank: int, table: torch.Tensor, message: str) -> ReplanEvent:
        stage = self._stage_of[rank]
        return ReplanEvent(step, reason, rank, stage, self.plan.stages[stage].device_type, message,
                           (table[:, 0] / GIB).tolist(), (table[:, 1] / GIB).tolist())

    def describe(self, step: int, table: torch.Tensor) -> str:
        """One line: per stage observed peak against predicted, and the least free share."""
        parts, free_share = [], free_shares(table)
        for i, stage in enumerate(self.plan.stages):
            peak = max(float(table[r, 0]) for r in stage.ranks) / GIB
            free = min(float(free_share[r]) for r in stage.ranks)
            pred = stage.predicted_peak_memory_gib
            vs = f" (x{peak / pred:.2f})" if pred > 0 else ""
            parts.append(f"stage {i} {stage.device_type}: {peak:.4f}/{pred:.4f} GiB{vs}, {free:.0%} free")
        return f"memory step {step}: observed/predicted " + " | ".join(parts)


def oom_event(plan: Plan, rank: int, step: int, error: BaseException, reader) -> ReplanEvent:
    """The event of an out-of-memory error on this rank in the step after ``step`` (the last completed
    one); only this rank's memory is known."""
    reading = reader.read()
    stage = plan.stage_of_rank(rank)[0]
    observed = [math.nan] * plan.world_size
    capacity = [math.nan] * plan.world_size
    # The failed allocation would have passed the capacity: the peak is at least that.
    observed[rank] = max(reading.peak_bytes, reading.capacity_bytes) / GIB
    capacity[rank] = reading.capacity_bytes / GIB
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ReplanEvent(step, "oom", rank, stage, plan.stages[stage].device_type,
                       f"out of memory after step {step}: {first_line}", observed, capacity)
