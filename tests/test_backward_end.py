"""What a backward's end holds (planning/backward_end.py): the first stage's word embedding's whole
gradient, and under one autocast region a step (memx-run's) a later micro-batch's every 16-bit
weight gradient: measured on chains of linears, memx's LLaMA stages, and memx-run's own stage
against its plan."""

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
    plan, whose peak is that moment (``backward_end`` part); counted without it, 8% under."""
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
    assert counted[True].memory_parts_gib["backward_end"] > 0
    assert measured / (counted[False].predicted_peak_memory_gib * 1024) > 1.08


def test_on_gpus_a_backward_s_end_passes_the_optimizer_step_where_micro_batches_are_in_flight():
    """LLaMA-2 7B under memx-run in bf16 on A100s, TP 2, PP 4, full recompute: torch's foreach
    AdamW frees autocast's copies and adds one fp32 moment, so its step holds about what the
    waiting gradients do; the first three stages, with other micro-batches in flight, peak at a
    later backward's end, 0.25-0.4 GiB above the count with a region per forward (the first stage's
    end holds its word embedding's fp32 gradient either way, below the activations' peak there);
    the last (one in flight, the head's logits gone) does not, nor any stage of a step of one
    micro-batch. A block's backward prices a later micro-batch's (its 16-bit weight gradients waiting
    beside its phases) even where a step has one: there the two peaks differ by less than one block's
    16-bit gradients, the region a step's over the region a forward's. The embedding split by TP
    here (``vocab_parallel_embedding``); memx-run's own, whole on each TP rank, waits with its whole
    fp32 gradient at the first stage's end."""
    a100s = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
        "vendor": "nvidia", "memory_gib": 79.3, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})
    peaks = {}
    for micro_batches in (1, 16):
        for per_step in (True, False):
            training = TrainingSpec(global_batch_size=micro_batches, seq_len=4096, dtype="bf16", setup="memx-run",
                                    autocast_per_step=per_step, vocab_parallel_embedding=True)
            plan = evaluate_layout(get_model("llama2-7b"), a100s, training, tp=2, pp=4, dp=1, micro_batch_size=1,
                                   recompute="full", references=(1.0, 1.0, 1.0))
            peaks[micro_batches, per_step] = plan.stages
    for with_wait, without in zip(peaks[16, True], peaks[16, False]):
        rise = with_wait.predicted_peak_memory_gib - without.predicted_peak_memory_gib
        assert (0.25 < rise < 0.4) == (with_wait.memory_parts_gib["backward_end"] > 0)
    assert [s.memory_parts_gib["backward_end"] > 0 for s in peaks[16, True]] == [True, True, True, False]
    block_gradients_gib = get_model("llama2-7b").layer_params / 2 * 2 / 2**30  # TP 2, 16 bits
    for per_step, per_forward in zip(peaks[1, True], peaks[1, False]):
        assert 0 <= per_step.predicted_peak_memory_gib - per_forward.predicted_peak_memory_gib < block_gradients_gib
        assert per_step.memory_parts_gib["backward_end"] == 0
    whole = evaluate_layout(get_model("llama2-7b"), a100s, TrainingSpec(global_batch_size=16, seq_len=4096, dtype="bf16",
                            setup="memx-run"), tp=2, pp=4, dp=1, micro_batch_size=1, recompute="full",
                            references=(1.0, 1.0, 1.0)).stages[0]
    assert (whole.memory_parts_gib["backward_end"] - peaks[16, True][0].memory_parts_gib["backward_end"]) * 2**30 == \
        pytest.approx(get_model("llama2-7b").word_embedding_params / 2 * 4, rel=1e-3)


def test_recomputing_some_layers_fits_a_later_backward_s_end_too():
    """The search's partial recompute (Megatron's block method: the first K layers of a stage) asks
    as many layers to recompute as a later micro-batch's backward end needs, not only the
    activations' peak: LLaMA-2 7B under memx-run in bf16 on 22.8 GiB devices, TP 2, PP 4, where
    the count for the activations' peak alone left every layout over capacity at that moment (21.5
    GiB before memx-run's embedding and head were counted whole on each TP rank)."""
    from memx_launch.planning.search import search
    from memx_launch.planning.search_space import SearchSpace

    small = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
        "vendor": "nvidia", "memory_gib": 22.8, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})
    training = TrainingSpec(global_batch_size=16, seq_len=4096, dtype="bf16", setup="memx-run")
    space = SearchSpace(recompute_some_layers=True, tp_degrees=(2,), pipeline_degrees=(4,), schedules=("1f1b",))
    best = search(get_model("llama2-7b"), small, training, space=space).best
    assert any(s.recompute.startswith("full:") for s in best.stages)
    assert all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in best.stages)


@pytest.mark.parametrize("region", ["per step", "per forward", "fp32"])
def test_the_first_stage_s_backward_ends_with_its_word_embedding_s_whole_gradient(region):
    """memx's LLaMA's first stage (2 blocks of hidden 512, a vocabulary of 16,384), full recompute,
    a second micro-batch's backward: its last node, the embedding's, writes the table's dense fp32
    gradient before AccumulateGrad adds it into ``.grad``; under one autocast region a step every
    block's 16-bit weight gradient waits beside it: what memx counts that backward's end to make
    (``backward_end``). With a region per forward or in fp32 the same gradient is made at the end
    of each backward (measured here), which memx does not count (planning/backward_end.py)."""
    import math
    from contextlib import nullcontext
    from dataclasses import replace

    import numpy as np
    import torch

    from memx_launch.models.llama import LlamaStage
    from memx_launch.planning import backward_end
    from memx_launch.planning.model_states import FULL_TRAINING
    from memx_launch.profiling.emulation import EmulatedDevice

    spec = replace(get_model("llama-small"), vocab_size=16384)
    torch.manual_seed(0)
    stage = LlamaStage(spec, 2, first=True, last=False, recompute="full")
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=region != "fp32")

    ids = torch.randint(0, spec.vocab_size, (1, 32))
    with autocast() if region == "per step" else nullcontext(), EmulatedDevice("probe", math.inf) as device:
        device.track([*stage.parameters(), *(p.grad for p in stage.parameters())])
        for _ in range(2):  # micro-batches
            with nullcontext() if region == "per step" else autocast():
                out = stage(ids)
            device.reset_peak()
            before = device.live_bytes
            out.float().sum().backward()
    training = TrainingSpec(setup="memx-run", dtype="fp32" if region == "fp32" else "bf16",
                            autocast_per_step=region == "per step")
    made = 2 * backward_end.waiting_block_bytes(spec, training, 1, FULL_TRAINING, 1) * (region == "per step") + \
        backward_end.end_bytes(spec, training, np.ones(2), (1, 1), 2, FULL_TRAINING)[0]
    assert made == 4 * spec.vocab_size * spec.hidden_size + (region == "per step") * 2 * sum(
        p.numel() for p in stage.layers.parameters())
    assert device.peak_bytes - before == pytest.approx(made, rel=0.005)  # less some activations freed by then
