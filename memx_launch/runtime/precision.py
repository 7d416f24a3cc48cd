"""Mixed precision as the plan's training setup says (plan.training["dtype"], memx-run --dtype).

bf16 and fp16 run the forward (and the recompute) under ``torch.autocast``: parameters, gradients
and optimizer state stay fp32 (the master copy), matrix products run in the low precision, and the
cast weights live in autocast's cache for the step. Calibration measures blocks the same way
(profiling/kernel.py), so the plan's memory is that of this training. fp16 also scales the loss
(dynamic, as torch.amp.GradScaler does; the scale is agreed by all ranks, since one pipeline
stage's overflow must skip every stage's step). fp32 changes nothing, unless the plan assumed TF32
(``memx plan --tf32``): then a GPU's fp32 matmuls and convolutions run as TF32, as predicted. CPUs
support bf16 autocast, which is how the tests cover this path without a GPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from memx_launch.errors import ConfigError

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INITIAL_LOSS_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
"""Steps without overflow before the fp16 loss scale doubles (GradScaler's default)."""


class Precision:
    def __init__(self, dtype: str, device: torch.device, tf32: bool = False):
        if dtype not in TORCH_DTYPES:
            raise ConfigError("dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(TORCH_DTYPES)}")
        if tf32 and dtype == "fp32" and device.type == "cuda":  # without the plan's word, the user's setting stays
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            torch.backends.cudnn.conv.fp32_precision = "tf32"
        self.dtype = dtype
        self.device = device
        self.loss_scale = INITIAL_LOSS_SCALE if dtype == "fp16" else 1.0
        self.step_scale = self.loss_scale
        """The scale the current step's losses were multiplied by."""
        self.good_steps = 0
        self.skipped_steps = 0

    def autocast(self):
        if self.dtype == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=TORCH_DTYPES[self.dtype])

    def scaled(self, loss_fn):
        """``loss_fn`` times the current loss scale (fp16), read at each call."""
        if self.dtype != "fp16":
            return loss_fn
        return lambda output, target: loss_fn(output, target) * self.loss_scale

    def begin_step(self) -> None:
        self.step_scale = self.loss_scale

    def unscale(self, parameters, sum_over_job: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """fp16: divide the gradients by the scale; False (and a halved scale) when any rank's
        gradients overflowed, so that every rank skips this optimizer step. Always True otherwise.
        ``sum_over_job``: the communicator's job-wide sum (a host flag, over the bridge when the
        job crosses domains)."""
        if self.dtype != "fp16":
            return True
        grads = [p.grad for p in parameters if p.grad is not None]
        found = torch.zeros(1)
        for g in grads:
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            local.div_(self.loss_scale)
            if not torch.isfinite(local).all():
                found.fill_(1.0)
        if sum_over_job(found).item():
            self.loss_scale /= 2
            self.good_steps = 0
            self.skipped_steps += 1
            return False
        self.good_steps += 1
        if self.good_steps % GROWTH_INTERVAL == 0:
            self.loss_scale *= 2
        return True
