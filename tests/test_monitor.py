"""Memory monitor: the decision on a gathered table, configuration, and agreement across gloo ranks
with a ballast fault on one of them."""

import math
import os

import pytest
import torch

from memx_launch.errors import ConfigError
from memx_launch.runtime.monitor import GIB, MemoryMonitor, MonitorConfig, oom_event
from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.specs.catalog import get_model
from ranks import spawn_ranks

SPEC = get_model("llama-tiny")


def make_plan(predicted=(0.01, 0.01), capacity=0.05):
    stages = [StagePlan("cpu", [i], n, "none", p, 0.0, capacity) for i, (n, p) in enumerate(zip((5, 3), predicted))]
    plan = Plan("llama-tiny", SPEC, "test", 1, 2, 1, 1, 4, 32, "1f1b", 1, stages, 0.0,
                Objective(1.0, "default", (0.4, 0.2, 0.4)))
    plan.validate()
    return plan


def table(peaks_gib, capacity_gib=0.05):
    return torch.tensor([[p * GIB, capacity_gib * GIB] for p in peaks_gib], dtype=torch.float64)


def test_headroom_must_stay_low_for_k_samples():
    monitor = MemoryMonitor(make_plan(), 0, None, MonitorConfig(interval=1, min_headroom=0.2, consecutive=3,
                                                                 above_prediction=10))
    assert monitor._decide(1, table([0.01, 0.045])) is None
    assert monitor._decide(2, table([0.01, 0.045])) is None
    assert monitor._decide(3, table([0.01, 0.02])) is None  # recovered: the count starts again
    assert monitor._decide(4, table([0.01, 0.045])) is None
    assert monitor._decide(5, table([0.01, 0.045])) is None
    event = monitor._decide(6, table([0.01, 0.045]))
    assert (event.reason, event.rank, event.stage, event.step) == ("headroom", 1, 1, 6)
    assert "10.0% free" in event.message and "3 samples" in event.message
    assert event.observed_gib == pytest.approx([0.01, 0.045])


def test_observed_above_prediction_by_the_margin():
    monitor = MemoryMonitor(make_plan(), 0, None, MonitorConfig(interval=1, above_prediction=0.25))
    assert monitor._decide(1, table([0.012, 0.0124])) is None  # 1.24x: inside the margin
    event = monitor._decide(2, table([0.012, 0.013]))
    assert (event.reason, event.rank) == ("above_prediction", 1)
    assert "1.30x" in event.message


def test_describe_shows_observed_against_predicted_per_stage():
    monitor = MemoryMonitor(make_plan(), 0, None)
    line = monitor.describe(10, table([0.011, 0.02]))
    assert "stage 0 cpu: 0.0110/0.0100 GiB (x1.10), 78% free" in line and "stage 1 cpu: 0.0200/0.0100" in line


def test_config_from_env_and_errors():
    config = MonitorConfig.from_env({"MEMX_MONITOR_INTERVAL": "5", "MEMX_MIN_HEADROOM": "0.2"})
    assert (config.interval, config.min_headroom, config.consecutive) == (5, 0.2, 3)
    with pytest.raises(ConfigError, match="MEMX_MONITOR_INTERVAL"):
        MonitorConfig.from_env({"MEMX_MONITOR_INTERVAL": "often"})
    with pytest.raises(ConfigError, match="min_headroom"):
        MonitorConfig(min_headroom=1.5)


def test_oom_event_knows_only_its_own_rank():
    class Reader:
        def read(self):
            from memx_launch.runtime.monitor import MemoryReading
            return MemoryReading(0.03 * GIB, 0.05 * GIB)

    event = oom_event(make_plan(), 1, 7, torch.OutOfMemoryError("CUDA out of memory. Tried\nmore"), Reader())
    assert (event.reason, event.rank, event.stage, event.step) == ("oom", 1, 1, 7)
    assert math.isnan(event.observed_gib[0]) and event.observed_gib[1] == pytest.approx(0.05)
    assert event.message == "out of memory after step 7: CUDA out of memory. Tried"


# --------------------------------------------------------------------------- 2 gloo processes


def _worker(rank, port, queue):
    import torch.distributed as dist
    from memx_launch.runtime.faults import BallastFault
    from memx_launch.runtime.monitor import memory_reader
    from memx_launch.profiling.emulation import EmulatedDevice

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        device = EmulatedDevice("cpu", memory_gib=0.05)
        with device:
            weights = torch.zeros(int(0.01 * GIB) // 4)  # noqa: F841 - the rank's resident state
        fault = BallastFault(rank=1, step=5, gib=0.03)
        monitor = MemoryMonitor(make_plan(), rank, memory_reader(emulated=device),
                                MonitorConfig(interval=1, min_headroom=0.25, consecutive=2, above_prediction=10))
        events = []
        for step in range(1, 10):
            fault.before_step(step, rank, emulated=device)
            event = monitor.after_step(step)
            if event is not None:
                events.append((step, event.to_dict()))
                break
        queue.put((rank, events))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_the_event_of_a_ballast_on_one_rank():
    results = spawn_ranks(_worker, 2)
    assert results[0] == results[1]  # same step, same event, on every rank
    [(step, event)] = results[0]
    assert step == 6  # ballast before step 5, two samples in a row under 25% free
    assert (event["reason"], event["rank"], event["stage"]) == ("headroom", 1, 1)
    assert event["observed_gib"][1] == pytest.approx(0.04, rel=1e-3)


class _Process:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def _cuda_memory(monkeypatch, processes, queries=None):
    """A CudaMemory of a faked 80 GiB device: 50 GiB used on it, 40 of them this process's
    allocator reserve now (44 at the step's peak); ``processes``: what NVML lists (None: no NVML),
    each query appended to ``queries``."""
    from memx_launch.profiling import kernel
    from memx_launch.runtime.monitor import CudaMemory

    class NVML:
        @staticmethod
        def nvmlDeviceGetComputeRunningProcesses(handle):
            (queries if queries is not None else []).append(handle)
            return processes

    if processes is None:
        monkeypatch.setattr(kernel, "nvml_device", lambda index: (_ for _ in ()).throw(RuntimeError("no NVML")))
    else:
        monkeypatch.setattr(kernel, "nvml_device", lambda index: (NVML, "handle"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 44 * GIB)
    return CudaMemory(torch.device("cuda", 0))


def _cuda_reading(monkeypatch, processes):
    reading = _cuda_memory(monkeypatch, processes).read()
    return reading.peak_bytes / GIB, reading.capacity_bytes / GIB


def test_a_gpu_s_peak_is_the_device_memory_the_plan_predicts(monkeypatch):
    # The peak holds the allocator's peak reserve and what the process holds outside the allocator
    # (context, NCCL's buffers), as a stage's predicted peak counts them; another process's 6 GiB
    # is neither this process's peak nor its capacity.
    me = os.getpid()
    assert _cuda_reading(monkeypatch, [_Process(me, 44 * GIB), _Process(me + 1, 6 * GIB)]) == (48.0, 74.0)
    # NVML lists host PIDs inside a container: no entry is known to be another's, none is subtracted.
    assert _cuda_reading(monkeypatch, [_Process(me + 7, 44 * GIB), _Process(me + 8, 6 * GIB)]) == (54.0, 80.0)
    assert _cuda_reading(monkeypatch, None) == (54.0, 80.0)  # no NVML (ROCm): the same


def test_nvml_s_process_list_is_read_at_most_once_a_second(monkeypatch):
    from memx_launch.runtime import monitor

    clock, queries = [100.0], []
    monkeypatch.setattr(monitor, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    memory = _cuda_memory(monkeypatch, [_Process(os.getpid(), 44 * GIB)], queries)
    for _ in range(5):  # the runtime reads every step
        memory.read()
        clock[0] += 0.1
    assert len(queries) == 1
    clock[0] += monitor.OTHERS_REFRESH_S
    memory.read()
    assert len(queries) == 2
