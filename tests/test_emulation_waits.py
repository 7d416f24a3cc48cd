"""The emulated slowdown charges compute, never time blocked waiting for a peer (issue 22: TP
plans hung when all-reduce waits were timed as compute and slept a multiple of), nor the time an
operator waited for one of the host's cores."""

import os
import time

import pytest
import torch

from memx_launch.profiling.emulation import EmulatedDevice
from ranks import spawn_ranks

PEER_DELAY_S = 1.0


def _wait_worker(rank, port, queue):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:
            time.sleep(PEER_DELAY_S)  # rank 0's all-reduce result arrives this much later
        device = EmulatedDevice("slow", memory_gib=1.0, slowdown=3.0)
        with device:
            # DTensor's TP returns such pending results: the wait runs in the next operator's dispatch
            pending = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
            start = time.perf_counter()
            total = (pending * 2).sum().item()
            wall = time.perf_counter() - start
        queue.put((rank, (total, wall, device.compute_s, device.slept_s)))
    finally:
        dist.destroy_process_group()


def test_a_wait_for_a_collective_result_is_not_charged_as_compute():
    total, wall, compute_s, slept_s = spawn_ranks(_wait_worker, 2, timeout=120)[0]
    assert total == 16.0  # the all-reduce's result, waited for
    assert wall > 0.5 * PEER_DELAY_S  # rank 0 did wait for its peer...
    assert compute_s < 0.2 * PEER_DELAY_S and slept_s < 0.4 * PEER_DELAY_S  # ...and was not charged for it


class _Clock:
    """The emulation's clocks, stepped by hand: wall time, this thread's CPU time, and sleeps."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.slept: list[float] = []

    def perf_counter(self):
        return self.wall

    def thread_time(self):
        return self.cpu

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.wall += seconds


def test_an_operator_a_busy_host_stretched_sleeps_only_what_its_device_takes_beyond(monkeypatch):
    """A slow type's operator takes slowdown x its own CPU time, however long the host's other
    ranks made it wait for a core: calibration times it unstretched, one rank at a time."""
    from memx_launch.profiling import emulation

    clock = _Clock()
    monkeypatch.setattr(emulation, "time", clock)
    device = EmulatedDevice("slow", memory_gib=1.0, slowdown=3.0)

    def operator(wall_s, cpu_s):
        def op(*args, **kwargs):
            clock.wall += wall_s
            clock.cpu += cpu_s
            return torch.zeros(1)
        op.namespace = "aten"
        return op

    for wall_s, cpu_s, slept_s in ((0.004, 0.004, 0.008),  # a core to itself: (3 - 1) x 4 ms
                                   (0.010, 0.004, 0.002),  # 6 ms waiting for a core: 3 x 4 ms in all
                                   (0.015, 0.004, None)):  # waited longer than its device takes: no sleep
        clock.slept.clear()
        device.__torch_dispatch__(operator(wall_s, cpu_s), (), ())
        assert clock.slept == ([] if slept_s is None else [pytest.approx(slept_s)])
    assert device.compute_s == pytest.approx(0.029)  # the operators' wall time, as measured
