"""A rank's stage compute as its device ran it: the spans of its chunks and loss, not what lies
between them (waits, sends, the optimizer), on the host's clock, the emulated device's books or
an accelerator's stream events."""

import pytest
import torch

from memx_launch.profiling.emulation import EmulatedDevice
from memx_launch.runtime import stage_clock
from memx_launch.runtime.stage_clock import StageClock


class _HostClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_the_host_clock_sums_the_spans_once_each_and_nothing_between_them(monkeypatch):
    host = _HostClock()
    monkeypatch.setattr(stage_clock, "time", host)
    clock = StageClock(torch.device("cpu"))
    with clock.span():
        host.now += 0.010
        with clock.span():  # the loss inside a chunk: the outer span holds it
            host.now += 0.005
    host.now += 1.0  # a wait for a neighbour, a send, the optimizer
    loss = clock.timed(lambda x: host.__setattr__("now", host.now + 0.002) or x)
    assert loss(7) == 7
    assert clock.read() == pytest.approx(0.017)
    assert clock.read() == 0.0  # a read starts the next step's count
    with clock.span():
        host.now += 0.5
    clock.reset()  # a step that did not finish
    assert clock.read() == 0.0


def test_an_emulated_device_reads_its_own_books_inside_the_spans():
    device = EmulatedDevice("slow", memory_gib=1.0, slowdown=3.0)
    clock = StageClock(torch.device("cpu"), device)
    x = torch.randn(256, 256)
    with device:
        x @ x  # outside any span: not the stage's
        before = device.compute_s + device.slept_s
        with clock.span():
            for _ in range(20):
                x @ x
        inside = device.compute_s + device.slept_s - before
        x @ x
    assert inside > 0 and clock.read() == pytest.approx(inside)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device")
def test_an_accelerator_is_read_from_its_stream_not_the_host():
    import time

    device = torch.device("cuda")
    clock = StageClock(device)
    x = torch.randn(4096, 4096, device=device)
    x @ x  # cuBLAS sets itself up on the host at the first matmul
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with clock.span():
        for _ in range(10):
            x = x @ x / 64  # queued: the host leaves the span long before the device is done
    host_s = time.perf_counter() - start
    seconds = clock.read()
    # 10 x 2 x 4096^3 FLOPs: no faster than 2 PFLOP/s (fp32 is far slower), no slower than 1 TFLOP/s,
    # and well past the host's time in the span: the device's own
    assert 1.4e12 / 2e15 < seconds < 1.4e12 / 1e12 and seconds > 3 * host_s
