"""One autocast region a step (memx-run's) makes a later micro-batch's backward hold its weights'
16-bit gradients until its end (planning/cast_wait.py): measured on chains of linears, and on
memx-run's own stage against its plan."""

import json
import os
import re
import subprocess
import sys

import pytest

from memx_launch.planning.estimate import evaluate_layout
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DEVICE = {"version": 1, "name": "one-emulated",
              "device_types": {"big": {"vendor": "cpu", "memory_gib": 2, "peak_tflops": 0.03,
                                       "memory_bandwidth_gbps": 5}},
              "nodes": [{"name": "localhost", "devices": {"big": 1}, "intra_node_gbps": 2}],
              "emulation": {"slowdown": {"big": 1}}}


def _later_backward_held(region_per_step: bool, layers: int = 6, width: int = 512) -> tuple[int, int]:
    """(what the second micro-batch's backward holds above its start, one weight's 16-bit bytes)
    for a chain of bias-free linears under CPU autocast, as the guard counts it: one region around
    both micro-batches, or one region per forward."""
    import math
    from contextlib import nullcontext

    import torch

    from memx_launch.profiling.emulation import EmulatedDevice

    torch.manual_seed(0)
    chain = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    x = torch.randn(16, width)
    def region():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    with region() if region_per_step else nullcontext(), EmulatedDevice("probe", math.inf) as device:
        device.track(list(chain.parameters()))
        for _ in range(2):  # micro-batches
            with nullcontext() if region_per_step else region():
                out = chain(x)
            device.reset_peak()
            before = device.live_bytes
            out.float().sum().backward()
    return device.peak_bytes - before, width * width * 2


def test_a_later_micro_batch_s_backward_holds_every_16_bit_weight_gradient_until_its_end():
    """With one region, the casts the first forward made run after the second backward's every
    other node: at the first cast every 16-bit weight gradient waits beside its fp32 copy (4
    bytes a weight); a region per forward casts each gradient as its linear's backward ends."""
    pytest.importorskip("torch")
    held, weight = _later_backward_held(region_per_step=True)
    assert 7.75 * weight < held <= 8 * weight  # less the micro-batch's activations, freed by then
    held, weight = _later_backward_held(region_per_step=False)
    assert held < 2.01 * weight


def _peaks(run_stdout: str, step: int) -> tuple[float, float]:
    """(measured, predicted) MiB of the one stage at ``step``, as memx-run prints them."""
    line = [line for line in run_stdout.splitlines() if line.startswith(f"step {step} |")][-1]
    measured, predicted = re.search(r"mem ([0-9.]+)/([0-9.]+) MiB", line).groups()
    return float(measured), float(predicted)


def test_memx_run_s_stage_peaks_where_a_later_backward_waits_for_its_casts(tmp_path):
    """memx's LLaMA (8 blocks of hidden 512) under memx-run in bf16, full recompute, 4
    micro-batches of 32 tokens, one emulated device: the stage holds few activations, and from
    the second micro-batch on its backward ends with every block's 16-bit weight gradients.
    Measured from the second step on (gradients and optimizer states allocated) within 1% of the
    plan, whose peak is that moment (``cast_wait`` part); counted without it, 8% under."""
    pytest.importorskip("torch")
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(ONE_DEVICE))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    run = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "1",
                          "--cluster", str(cluster), "--tp", "1", "--pp", "1", "--micro-batch-sizes", "1",
                          "--recompute-levels", "full", "--global-batch-size", "4", "--seq-len", "32",
                          "--dtype", "bf16", os.path.join(REPO, "examples", "train.py"), "--model", "llama-small",
                          "--steps", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    measured, predicted = _peaks(run.stdout, 2)
    assert abs(measured / predicted - 1) < 0.01
    counted = {}
    for per_step in (True, False):
        training = TrainingSpec(global_batch_size=4, seq_len=32, dtype="bf16", setup="memx-run",
                                autocast_per_step=per_step)
        plan = evaluate_layout(get_model("llama-small"), ClusterSpec.from_dict(ONE_DEVICE), training, tp=1, pp=1,
                               dp=1, micro_batch_size=1, recompute="full", references=(1.0, 1.0, 1.0))
        counted[per_step] = plan.stages[0]
    assert counted[True].predicted_peak_memory_gib * 1024 == pytest.approx(predicted, abs=0.05)
    assert counted[True].memory_parts_gib["cast_wait"] > 0
    assert measured / (counted[False].predicted_peak_memory_gib * 1024) > 1.08


def test_on_gpus_a_later_backward_s_end_passes_the_optimizer_step_where_micro_batches_are_in_flight():
    """LLaMA-2 7B under memx-run in bf16 on A100s, TP 2, PP 4, full recompute: torch's foreach
    AdamW frees autocast's copies and adds one fp32 moment, so its step holds about what the
    waiting gradients do; the first three stages, with other micro-batches in flight, peak at a
    later backward's end, 0.2-0.3 GiB above the count without it; the last (one in flight, the
    head's logits gone) does not, nor any stage of a step of one micro-batch."""
    a100s = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
        "vendor": "nvidia", "memory_gib": 79.3, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})
    peaks = {}
    for micro_batches in (1, 16):
        for per_step in (True, False):
            training = TrainingSpec(global_batch_size=micro_batches, seq_len=4096, dtype="bf16", setup="memx-run",
                                    autocast_per_step=per_step)
            plan = evaluate_layout(get_model("llama2-7b"), a100s, training, tp=2, pp=4, dp=1, micro_batch_size=1,
                                   recompute="full", references=(1.0, 1.0, 1.0))
            peaks[micro_batches, per_step] = plan.stages
    for with_wait, without in zip(peaks[16, True], peaks[16, False]):
        rise = with_wait.predicted_peak_memory_gib - without.predicted_peak_memory_gib
        assert (0.2 < rise < 0.3) == (with_wait.memory_parts_gib["cast_wait"] > 0)
    assert [s.memory_parts_gib["cast_wait"] > 0 for s in peaks[16, True]] == [True, True, True, False]
    assert [s.predicted_peak_memory_gib for s in peaks[1, True]] == [s.predicted_peak_memory_gib
                                                                    for s in peaks[1, False]]
