"""benchmarks/gpu_check.py: without a GPU it stops at once, in one line, writing nothing; its
parser reads the training script's step lines."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_fails_clearly(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: no CUDA GPU"), proc.stderr
    assert not out.exists()


def test_step_lines_are_read():
    from benchmarks.gpu_check import STEP

    line = ("step 3 | loss 6.253072 | 0.980 s/step (predicted 0.419) | 1,229 tok/s | s0 NVIDIA-H200: mem "
            "2960.4/3049.6 MiB, mb 849.3/408.9 ms  (measured/predicted)")
    [match] = STEP.findall(line)
    assert match == ("3", "6.253072", "0.980", "0.419", "2960.4", "3049.6", "849.3", "408.9")


def test_matmul_rates_time_the_three_precisions():
    from benchmarks.gpu_check import matmul_rates

    before = torch.backends.cuda.matmul.allow_tf32
    rates = matmul_rates(device="cpu", n=128, repeats=2)
    assert set(rates) == {"bf16", "fp32", "tf32"} and all(r > 0 for r in rates.values())
    assert torch.backends.cuda.matmul.allow_tf32 == before  # the process's setting is restored


def test_gemm_shapes_time_bf16_and_fp8_against_memx_s_shares():
    from benchmarks.gpu_check import gemm_shapes

    from memx_launch.planning.matmuls import shape_efficiency

    rows = gemm_shapes(device="cpu", shapes=((256, 256, 256), (512, 128, 64)), repeats=2, sms=132)
    assert [(r["dtype"], r["m"]) for r in rows] == [("bf16", 256), ("bf16", 512), ("fp8", 256), ("fp8", 512)]
    assert all(r["tflops"] > 0 and r["measured_share"] > 0 and 0 < r["predicted_share"] <= 1 for r in rows)
    # The bf16 rows' prediction is memx's shape model at the 16-bit fill (compute bound at this copy rate).
    assert rows[1]["predicted_share"] == pytest.approx(float(shape_efficiency(512, 128, 64, 132)), abs=1e-3)


def test_stream_bandwidth_times_a_copy_and_a_triad():
    from benchmarks.gpu_check import datasheet_gbps, stream_bandwidth

    rates = stream_bandwidth(device="cpu", mib=8, repeats=2)
    assert set(rates) == {"copy_gbps", "triad_gbps"} and all(r > 0 for r in rates.values())
    assert (datasheet_gbps("NVIDIA H200"), datasheet_gbps("NVIDIA H100 80GB HBM3"), datasheet_gbps("NVIDIA L4")) \
        == (4800, 3350, None)
