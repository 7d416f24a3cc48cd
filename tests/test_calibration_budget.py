"""Calibration with a budget: the estimate from the analytical FLOPs and the device's rate, fewer
samples when the budget is short, a one-line refusal up front when not even a few fit."""

import os
import subprocess
import sys

import pytest

from memx_launch.errors import ConfigError
from memx_launch.runtime.calibration import (CALIBRATION_BUDGET, MIN_CALIBRATION_SAMPLES, sample_budget,
                                             seconds_per_sample)
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_estimate_follows_the_flops_and_the_rate():
    big, tiny = get_model("llama2-7b"), get_model("llama-tiny")
    cpu = seconds_per_sample(big, [1], tflops=0.2)
    assert cpu > 100  # minutes a sample: llama2-7b blocks at 4096 tokens on a CPU
    assert seconds_per_sample(big, [1], tflops=400.0) == pytest.approx(cpu * 0.2 / 400.0)
    assert seconds_per_sample(big, [1], tflops=0.2, slowdown=4) == pytest.approx(4 * cpu)
    assert seconds_per_sample(tiny, [1], tflops=0.2) < 0.1


def test_budget_gives_fewer_samples_then_refuses_in_one_line():
    model = get_model("llama2-7b")
    assert sample_budget(model, "h100", 0.5, 1800) == CALIBRATION_BUDGET
    assert sample_budget(model, "slow", 100.0, 1000) == 10
    with pytest.raises(ConfigError) as info:
        sample_budget(model, "cpu", 700.0, 1800)
    message = str(info.value)
    assert info.value.field == "--calibration-budget-s" and "\n" not in message
    assert f"{MIN_CALIBRATION_SAMPLES * 700} s for the fewest samples" in message
    for remedy in ("smaller --model", "profile DB measured on the GPUs", "--dry-run"):
        assert remedy in message


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without GPUs")
def test_llama2_7b_on_a_cpu_is_refused_up_front(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "1",
                           "--run-dir", "run", "--profile-db", "profiles.jsonl",
                           os.path.join(REPO, "examples", "train.py"), "--model", "llama2-7b"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [l for l in proc.stderr.splitlines() if "memx-run: error: calibration" in l or
              "memx-run: error: --calibration-budget-s" in l]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "calibrating llama2-7b on cpu" in errors[0]
    assert not (tmp_path / "profiles.jsonl").exists()  # nothing was measured
    # no --cluster: the job detected itself first and wrote the description into the run directory
    assert ClusterSpec.from_yaml(str(tmp_path / "run" / "cluster.yaml")).world_size == 1
