"""A rank's stage compute in a step, read as its device ran it: the time inside the pipeline
stage's forward and backward chunks and its loss (runtime/pipeline_stage.py), per micro-batch
what the plan predicts as the stage's time (``predicted_stage_time_s``). Not the waits for a
neighbour's activations or gradients, the sends, nor the optimizer step.

An accelerator runs behind the host, so its time is read from timing events recorded on its
current stream and read once at the step's end, when the device has run them: what the stream
waits for inside a chunk counts, tensor parallelism's collectives as the prediction counts them,
and the gradient reduction the step's last backward waits for, which the prediction does not
(spread over the step's micro-batches). An emulated device (profiling/emulation.py) reads its
own books, its operators' time and sleeps, never a collective. A plain CPU reads the host's clock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from memx_launch.profiling.emulation import EmulatedDevice


class StageClock:
    """Spans of a rank's stage work (:meth:`span`, re-entrant: a span inside another is the outer
    one's), summed by :meth:`read`."""

    def __init__(self, device: torch.device, emulated: EmulatedDevice | None = None):
        self._device = device
        self._emulated = emulated
        self._events = emulated is None and device.type != "cpu"
        self._open = 0
        self._spans: list[tuple] = []

    @contextmanager
    def span(self):
        self._open += 1
        start = self._mark() if self._open == 1 else None
        try:
            yield
        finally:
            self._open -= 1
            if start is not None:
                self._spans.append((start, self._mark()))

    def timed(self, fn):
        """``fn`` with each call inside a span (the loss the schedule calls between chunks)."""
        def call(*args, **kwargs):
            with self.span():
                return fn(*args, **kwargs)
        return call

    def _mark(self):
        if self._events:
            event = torch.Event(device=self._device, enable_timing=True)
            event.record()
            return event
        if self._emulated is not None:
            return self._emulated.compute_s + self._emulated.slept_s
        return time.perf_counter()

    def read(self) -> float:
        """Seconds inside the spans since the last read (or :meth:`reset`); on an accelerator,
        once the device has reached the last span's end."""
        spans, self._spans = self._spans, []
        if not self._events:
            return sum(end - start for start, end in spans)
        if spans:
            spans[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in spans) / 1e3

    def reset(self) -> None:
        """Forget the spans of a step that did not finish."""
        self._spans = []
