"""The calibration kernel: forward + backward of ``num_blocks`` LLaMA blocks of the model's
shape on this rank's device for one configuration, with the median time of several repeats
and the peak memory above the resting state (weights, gradients, input).

torch is imported lazily inside the kernel, so the sampling plan stays importable anywhere.
"""

from __future__ import annotations

import gc
import glob
import itertools
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Callable, Iterable


import psutil

from memx_launch.errors import ConfigError
from memx_launch.planning.peaks import datasheet_of_sustained_gbps
from memx_launch.planning.tp_links import TpLink, record_fields
from memx_launch.profiling.profiledb import Measurement
from memx_launch.specs.training import DTYPE_BYTES, TrainingSpec
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.efficiency import power_limited_clock_share, training_share_of_best_matmul
from memx_launch.specs.local_attention import local_attention_share
from memx_launch.specs.model import ModelSpec
from memx_launch.profiling.design import MinimalSet, minimal_sample_set
from memx_launch.profiling.space import ProfileSpace, Sample


# How calibration runs its blocks, as memx-run trains them (fp32 weights, autocast in 16-bit
# training, eager ops, torch-op norms, q, k, v and gate, up apart): each record's learned ratio is
# taken against the analytical model of that setup, which memx-run's own planning prices. Against
# the default options' model instead, a ratio carried what the setup adds and counted it twice.
CALIBRATED_AS = {"setup": "memx-run"}


def software_versions() -> dict:
    import torch
    from importlib.metadata import PackageNotFoundError, version

    try:
        memx = version("memx")
    except PackageNotFoundError:
        memx = "unknown"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "memx": memx}


def detect_device_type(device: str = "cpu", name: str | None = None) -> DeviceType:
    """Descriptors of this machine's device: capacity from the OS or driver, compute from a
    short matmul run (what the analytical model should take as sustained TFLOPS)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        memory_gib, vendor = props.total_memory / 2**30, "amd" if torch.version.hip else "nvidia"
        capability = compute_capability(props)
        default_name, dtype = props.name.replace(" ", "-"), torch.bfloat16
    else:
        memory_gib = psutil.virtual_memory().total / 2**30
        vendor, default_name, dtype, capability = "cpu", "cpu", torch.float32, None
    n = 1024 if dev.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    rates = []
    for _ in range(4):
        _sync(dev)
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        rates.append(2 * n**3 / (time.perf_counter() - t0) / 1e12)
    src, dst = torch.ones(64 * 2**20 // 4, device=dev), torch.zeros(64 * 2**20 // 4, device=dev)
    seconds = []
    for _ in range(3):  # the first copy also faults the pages in
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        seconds.append(time.perf_counter() - t0)
    bandwidth = 2 * src.numel() * 4 / min(seconds[1:]) / 1e9
    # A GPU's large square matmul runs at about its best matmul rate, of which a training step's
    # matmuls sustain the share the datasheet default assumes, at the clock the power limit
    # leaves them (a burst this short finishes before the limit bites); a CPU's rate is taken as it is.
    efficiency = 1.0 if dev.type == "cpu" else detected_efficiency(
        vendor, capability, power_limits(dev.index if dev.index is not None else torch.cuda.current_device()))
    # The copy already runs at the sustained rate: written as the datasheet figure it stands for.
    bandwidth = datasheet_of_sustained_gbps(bandwidth, vendor)
    # Two significant digits, so reruns on the same machine give the same descriptors.
    return DeviceType(name=name or default_name, vendor=vendor, memory_gib=_round2(memory_gib),
                      peak_tflops=_round2(max(rates[1:])), efficiency=efficiency,
                      memory_bandwidth_gbps=_round2(bandwidth), flash_attention=True,
                      compute_capability=capability)


def detected_efficiency(vendor: str, capability: float | None, limits: tuple[float, float] | None) -> float:
    """The efficiency a detected GPU type is written with, of its measured burst matmul rate: the
    training share of the best matmul, at the clock its power ``limits`` (enforced, the board's
    highest: :func:`power_limits`) leave it."""
    share = power_limited_clock_share(*limits) if limits else 1.0
    return round(training_share_of_best_matmul(vendor, capability) * share, 3)


def power_limits(index: int) -> tuple[float, float] | None:
    """A GPU's enforced board power limit and the highest its board takes, in W (the rated power
    the datasheet shares assume): through NVML on NVIDIA, the amdgpu driver's hwmon files on
    ROCm; None where neither answers (containers without the driver's files, no power management)."""
    import torch

    try:
        if torch.version.hip:
            props = torch.cuda.get_device_properties(index)
            return amdgpu_power_limits(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")
        pynvml, handle = nvml_device(index)
        enforced = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        return enforced, max(enforced, pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)[1] / 1e3)
    except Exception:  # noqa: BLE001 - no NVML, an older torch without PCI ids: no limit known
        return None


def nvml_device(index: int):
    """pynvml and its handle of CUDA device ``index``, found by UUID: NVML numbers the machine's
    GPUs whatever CUDA_VISIBLE_DEVICES shows this process. Raises where NVML is not there."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")


def amdgpu_power_limits(pci_address: str, devices_dir: str = "/sys/bus/pci/devices") -> tuple[float, float] | None:
    """The amdgpu driver's power cap of the GPU at ``pci_address`` and the highest it takes, in W
    (hwmon's ``power1_cap`` and ``power1_cap_max``, in microwatts)."""
    def watts(path: str) -> float:
        with open(path) as f:
            return int(f.read()) / 1e6

    for hwmon in sorted(glob.glob(os.path.join(devices_dir, pci_address, "hwmon", "hwmon*"))):
        try:
            cap, top = watts(os.path.join(hwmon, "power1_cap")), watts(os.path.join(hwmon, "power1_cap_max"))
        except (OSError, ValueError):
            continue
        if cap > 0:
            return cap, max(cap, top)
    return None


def compute_capability(props) -> float | None:
    """NVIDIA's major.minor of a ``torch.cuda`` device's properties (None on ROCm)."""
    import torch

    return None if torch.version.hip else props.major + props.minor / 10


def _round2(x: float) -> float:
    return float(f"{x:.2g}")


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _is_oom(exc: BaseException) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def calibrate(spec: ModelSpec, device_type: DeviceType, samples: Iterable[Sample], *, device: str = "cpu",
              tp_group=None, dtype: str = "fp32", num_blocks: int = 2, warmup: int = 1, repeats: int = 5,
              emulation_slowdown: float | None = None, tp_link: TpLink | None = None,
              progress: Callable[[Sample], None] | None = None, block_factory=None, block_tensor_parallel=None,
              selective_policy: str = "attention", run_options: dict | None = None) -> list[Measurement]:
    """Measure forward + backward of ``num_blocks`` blocks for each sample, on this rank.

    ``tp_group`` is a process group of same-type ranks for samples with tp > 1 (every rank of
    the group calls this with the same samples); samples whose TP does not match the group
    size are an error. ``emulation_slowdown``: None on a real device; on a CPU stand-in for an
    emulated device its slowdown (1 or more): the timed steps run under that emulated device
    (profiling/emulation.py), its guard's bookkeeping and sleeps included, as training runs them;
    the records are labelled emulated, with the slowdown. ``tp_link``: the link TP > 1 samples'
    group talks over (tp_links.tp_link), kept in their records. Out-of-memory samples come back with
    ``feasible=False``; so do samples whose peak exceeds an emulated device's capacity.
    ``block_factory``: (recompute level, selective policy) -> one block of the user's model ([b, s,
    hidden] in and out, e.g. models/adapters.py's ModelParts.block_probe); default memx's LLaMA
    block of the shape. ``block_tensor_parallel``: (one of those blocks, TP mesh) -> None, splits it
    by TP as training does (ModelParts.apply_tensor_parallel); without it the user's block is measured
    at TP = 1 only. ``selective_policy``: what "selective" samples run again
    ("attention", or torchtitan's "op"); an op-level record says so in its ``run_options``, so
    that its learned ratio is taken against the analytical model of that policy. ``run_options``:
    how the blocks ran, as the records state it (default :data:`CALIBRATED_AS`).
    """
    import torch

    if dtype not in DTYPE_BYTES:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
    samples = list(samples)
    group_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    for s in samples:
        if s.tp != group_size:
            raise ConfigError("tp", f"sample tp={s.tp} but this rank's TP group has {group_size} rank(s)",
                              "calibrate TP>1 samples inside a group of that many same-type ranks")
    software = software_versions()
    emulated = emulation_slowdown is not None
    out = []
    for s in samples:
        shape = replace(spec, num_kv_heads=s.num_kv_heads)
        options = record_run_options(s.recompute, selective_policy, run_options)
        try:
            time_s, spread_s, host_s, peak, reserved = _run_sample(
                shape, s, torch.device(device), tp_group, dtype, num_blocks, warmup, repeats, block_factory,
                block_tensor_parallel, selective_policy, emulation_slowdown,
                TrainingSpec(dtype=dtype, **options).autocast_per_step)
            feasible = True
        except (RuntimeError, MemoryError) as exc:
            if not _is_oom(exc):
                raise
            time_s = spread_s = host_s = peak = reserved = None
            feasible = False
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        if feasible and emulated and peak > device_type.memory_bytes:
            feasible = False
        out.append(Measurement(
            device_type=device_type.name,
            device={k: v for k, v in asdict(device_type).items() if k != "name"},
            model=spec.name, model_signature=spec.signature(),
            block_shape=shape.to_dict(),
            tp=s.tp, micro_batch_size=s.micro_batch_size, seq_len=s.seq_len, recompute=s.recompute,
            dtype=dtype, num_blocks=num_blocks, feasible=feasible,
            time_s=time_s, time_spread_s=spread_s, host_time_s=host_s,
            peak_memory_bytes=peak, peak_reserved_bytes=reserved,
            context_bytes=_context_bytes(torch.device(device)) if feasible else None,
            **record_fields(tp_link, s.tp),
            emulation_slowdown=emulation_slowdown if emulated else 1.0, emulated=emulated, software=software,
            run_options=options))
        if progress is not None:
            progress(s)
    return out


def record_run_options(recompute: str, selective_policy: str, run_options: dict | None = None) -> dict:
    """A calibration record's ``run_options``: how its blocks ran (``run_options``, default
    :data:`CALIBRATED_AS`), and the op-level policy where it changed what ran."""
    options = dict(CALIBRATED_AS if run_options is None else run_options)
    return {**options, "selective_recompute": "op"} if recompute == "selective" and selective_policy == "op" \
        else options


def local_blocks(shape: ModelSpec, num_blocks: int) -> list[bool]:
    """Which of ``num_blocks`` timed blocks attend within the model's window or chunk: the model's
    share of local blocks (:func:`~memx_launch.specs.local_attention.local_attention_share`), rounded,
    so that their mean is near the model's mean block, as the runtime trains them."""
    local = round(num_blocks * local_attention_share(shape))
    return [j < local for j in range(num_blocks)]


def _run_sample(shape: ModelSpec, s: Sample, dev, tp_group, dtype: str, num_blocks: int, warmup: int,
                repeats: int, block_factory=None, block_tensor_parallel=None, selective_policy: str = "attention",
                emulation_slowdown: float | None = None,
                autocast_per_step: bool = False) -> tuple[float, float, float | None, float, float | None]:
    """(median seconds per block, interquartile range per block, median seconds the host took
    to issue a block (GPUs; None on CPUs), peak bytes above resting, peak bytes the caching
    allocator reserved above resting (GPUs; None on CPUs)). With ``emulation_slowdown`` the
    timed steps run under an emulated device of that slowdown; the memory pass stays outside it.
    ``autocast_per_step``: the warm-up and the timed steps run inside one autocast region, as
    memx-run's micro-batches do, their forwards reading the weights' copies the warm-up cast; the
    memory pass runs in a region of its own, so that its peak holds the copies (a model state,
    which learning its ratio takes off: profiling/features.py)."""
    import torch

    from memx_launch.models.llama import TransformerBlock, apply_tensor_parallel
    from memx_launch.profiling.emulation import EmulatedDevice

    from contextlib import nullcontext

    torch.manual_seed(0)  # identical weights and input on every rank of a TP group
    if block_factory is not None and block_tensor_parallel is None and s.tp > 1:
        raise ConfigError("tp", "the user's own block has no tensor-parallel plan to calibrate it by",
                          "calibrate it with tp=1")
    blocks = torch.nn.Sequential(*[block_factory(s.recompute, selective_policy) if block_factory is not None
                                   else TransformerBlock(shape, s.recompute, selective_policy, local)
                                   for local in local_blocks(shape, num_blocks)])
    # As the runtime trains (runtime/precision.py): fp32 weights and residual stream, low-precision
    # matrix products under autocast.
    blocks = blocks.to(device=dev)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if s.tp > 1:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(tp_group, dev.type)
        if block_factory is None:
            apply_tensor_parallel(blocks, mesh)
        else:
            for block in blocks:
                block_tensor_parallel(block, mesh)
    x = torch.randn(s.micro_batch_size, s.seq_len, shape.hidden_size, device=dev, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        with torch.autocast(dev.type, dtype=low) if low is not None else nullcontext():
            y = blocks(x)
        y.backward(dy.to(y.dtype))

    times, host_times = [], []
    # Only the time: whether the sample fits is the memory pass's to say, against the capacity.
    guard = EmulatedDevice("calibration", math.inf, emulation_slowdown) if emulation_slowdown is not None \
        else nullcontext()
    step_region = torch.autocast(dev.type, dtype=low) if autocast_per_step and low is not None else nullcontext()
    with step_region:
        # Warm-up also allocates the gradients, which stay: they belong to the resting state.
        for _ in range(max(1, warmup)):
            step()
        with guard:
            _timed_steps(step, dev, repeats, times, host_times)
    peak, reserved = _peak_memory_bytes(step, dev)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    host = statistics.median(host_times) / num_blocks if host_times else None
    return statistics.median(times) / num_blocks, (quartiles[2] - quartiles[0]) / num_blocks, host, peak, reserved


def _timed_steps(step: Callable[[], None], dev, repeats: int, times: list, host_times: list) -> None:
    """Run ``step`` ``repeats`` times, appending each one's seconds to ``times`` (CUDA events on
    GPUs) and, on GPUs, the host's share of it to ``host_times``."""
    import torch

    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            # The calls return once their kernels are queued: the host's share of the step.
            t0 = time.perf_counter()
            step()
            host_times.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)


def _context_bytes(dev) -> float | None:
    """GPUs: device memory in use that the caching allocator did not reserve (the CUDA context
    with its kernel modules, NCCL buffers; other processes on the device count too); None on CPUs."""
    import torch

    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    return float(max(0, total - free - torch.cuda.memory_reserved(dev)))


def _peak_memory_bytes(step: Callable[[], None], dev) -> tuple[float, float | None]:
    """Peak bytes of live tensors above the state before ``step``, and on GPUs the peak the
    caching allocator reserved above it (what an out-of-memory error is about).

    GPU: max_memory_allocated and max_memory_reserved. CPU: the profiler's memory events,
    which see every tensor allocation and free (the process RSS does not: freed blocks stay
    mapped and large ones bypass it); there is no allocator reserve to read. Garbage of earlier
    code (reference cycles, a previous sample's) is collected first: freed inside the step by the
    collector, a tensor allocated under an earlier profile reads as a free of this step's, which
    lowered a calibrated block's peak by a third when the collector ran there (test order decides).
    """
    import torch

    gc.collect()

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        # Blocks the timed repeats left cached would hide what this step has to reserve.
        torch.cuda.empty_cache()
        resting, resting_reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        return (float(torch.cuda.max_memory_allocated(dev) - resting),
                float(torch.cuda.max_memory_reserved(dev) - resting_reserved))
    # Kineto prints a line per profiler start and stop unless told otherwise (6: silent).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return float(peak), None


def profile_model(spec: ModelSpec, device_type: DeviceType, space: ProfileSpace, *, device: str = "cpu",
                  budget: int | None = None, dtype: str = "fp32", num_blocks: int = 2, repeats: int = 5,
                  emulation_slowdown: float | None = None, tp_link: TpLink | None = None,
                  refine_budget: int | None = None, show_progress: bool = True) -> MinimalSet:
    """The minimal-set profile of one device type on this process's device (TP 1), with a
    progress bar per phase on stderr."""
    from tqdm import tqdm

    phases = itertools.chain(("ablation", "design"), itertools.repeat("refinement"))

    def measure(samples: list[Sample]) -> list[Measurement]:
        with tqdm(total=len(samples), desc=f"memx profile {next(phases)}", unit="config", file=sys.stderr,
                  disable=not show_progress or not samples, leave=False) as bar:
            return calibrate(spec, device_type, samples, device=device, dtype=dtype, num_blocks=num_blocks,
                             repeats=repeats, emulation_slowdown=emulation_slowdown, tp_link=tp_link,
                             progress=lambda _sample: bar.update())

    return minimal_sample_set(space, measure, budget=budget, refine_budget=refine_budget)


def measuring_device(name: str | None) -> str:
    """The device to measure on (default: cuda when present, else cpu), checked before anything
    is measured."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError("--device", f"{name!r} is not a torch device", "e.g. --device cuda:0 or --device cpu") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError("--device", f"{name} is not present ({count} CUDA device(s) here)",
                              "pick a present device, or --device cpu")
    elif device.type != "cpu":
        raise ConfigError("--device", f"memx measures on cuda or cpu, not {device.type}", "e.g. --device cuda:0")
    return name
