"""What one optimizer step did, as every rank sees it, and the progress line a script prints."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    bridge_messages: int = 0
    """Sends and bridge all-reduces to other communication domains this step, over all ranks."""
    bridge_bytes: int = 0
    """The bytes all ranks sent over the bridge this step (what the plan's crossings count)."""
    bridge_staging_s: float = 0.0
    """The most time one rank spent copying bridge traffic between device and host this step."""
    bridge_collective_s: float = 0.0
    """The most time one rank spent in bridge collectives this step (waits for slower replicas included)."""


def progress_line(stats: StepStats, plan) -> str:
    """Step, loss, step time, tokens/s, and per stage measured vs predicted peak memory and
    micro-batch compute time (emulated devices are labelled)."""
    parts = [f"step {stats.step}", f"loss {stats.loss:.6f}",
             f"{stats.step_time_s:.3f} s/step (predicted {plan.predicted_iteration_time_s:.3f})",
             f"{stats.tokens_per_s:,.0f} tok/s"]
    for i, stage in enumerate(plan.stages):
        label = f"{stage.device_type}{' emulated' if plan.emulated else ''}"
        parts.append(f"s{i} {label}: mem {stats.stage_peak_gib[i] * 1024:.1f}/"
                     f"{stage.predicted_peak_memory_gib * 1024:.1f} MiB, mb "
                     f"{stats.stage_compute_s[i] * 1e3:.1f}/{stage.predicted_stage_time_s * 1e3:.1f} ms")
    if stats.bridge_messages:
        planned = plan.bridge_bytes_per_step
        parts.append(f"bridge {stats.bridge_messages} transfers {stats.bridge_bytes / 2**20:.2f}"
                     f"{'' if planned is None else f'/{planned / 2**20:.2f}'} MiB sent, "
                     f"staging {stats.bridge_staging_s * 1e3:.1f} ms, collectives "
                     f"{stats.bridge_collective_s * 1e3:.1f} ms")
    return " | ".join(parts) + "  (measured/predicted)"
