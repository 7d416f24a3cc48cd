"""Mixed precision on the CPU: bf16 (and fp16 with loss scaling) autocast in calibration and training."""

import os

import pytest
import torch

from memx_launch.profiling.space import Sample
from memx_launch.profiling.kernel import calibrate
from memx_launch.runtime.batches import default_loss
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.catalog import get_model
from ranks import spawn_ranks

SPEC = get_model("llama-tiny")


def test_bf16_calibration_measures_smaller_activations_than_fp32():
    cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
    # Sequence 256: activations outweigh what a CPU without native bf16 (no avx512_bf16) adds per
    # matmul, oneDNN's conversion buffers, which at sequence 64 brought bf16 within 4% of fp32.
    sample = Sample(1, 2, 256, "none", SPEC.num_kv_heads)
    peaks = {d: calibrate(SPEC, cpu, [sample], dtype=d, num_blocks=1, repeats=1)[0] for d in ("fp32", "bf16")}
    assert peaks["bf16"].dtype == "bf16" and peaks["bf16"].feasible
    # The matrix products' outputs are half as wide; norms and the residual stream stay fp32.
    assert 0.4 * peaks["fp32"].peak_memory_bytes < peaks["bf16"].peak_memory_bytes < 0.95 * peaks["fp32"].peak_memory_bytes


def _plan(dtype):
    from test_adapters import HF_SPEC, make_plan

    plan = make_plan(HF_SPEC, [((0,), 5, "selective"), ((1,), 3, "full")], micro_batch_size=2, global_batch_size=4)
    plan.training = {"dtype": dtype}
    return plan


def _worker(rank, port, dtypes, queue):
    import torch.distributed as dist
    from memx_launch.runtime.prepare import prepare
    from toy_models import hf_llama

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    out = {}
    try:
        for dtype in dtypes:
            plan = _plan(dtype)
            model = hf_llama()
            job = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-2), loss_fn=default_loss, plan=plan)
            tokens = torch.randint(0, 512, (4, plan.seq_len + 1), generator=torch.Generator().manual_seed(3))
            out[dtype] = [job.step(tokens[:, :-1], tokens[:, 1:]).loss for _ in range(3)]
            out[dtype + " params"] = str(next(job.chunks[0].parameters()).dtype)
    finally:
        queue.put((rank, out))
        dist.destroy_process_group()


@pytest.mark.slow
def test_bf16_and_fp16_train_on_cpu_close_to_fp32():
    pytest.importorskip("transformers")
    results = spawn_ranks(_worker, 2, ["fp32", "bf16", "fp16"], timeout=300)
    r = results[0]
    assert r["bf16 params"] == r["fp16 params"] == "torch.float32"  # fp32 master weights
    for dtype in ("bf16", "fp16"):
        assert r[dtype] != r["fp32"]  # autocast did run in the low precision
        assert max(abs(a - b) for a, b in zip(r[dtype], r["fp32"])) < 0.05, (dtype, r[dtype], r["fp32"])
        # The first step lowers the loss; the third may overshoot at lr 1e-2 (with transformers
        # 5.24 bf16 went 6.264, 6.184, 6.270), so the trajectory is held to fp32's above instead.
        assert r[dtype][1] < r[dtype][0], (dtype, r[dtype])
        assert results[1][dtype] == r[dtype]  # every rank reports the same loss


def test_a_plan_that_assumed_tf32_runs_fp32_matmuls_as_tf32_on_a_gpu():
    from memx_launch.runtime.precision import Precision

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        matmul.fp32_precision = conv.fp32_precision = "ieee"
        Precision("fp32", torch.device("cpu"), tf32=True)  # a CPU has no TF32
        Precision("fp32", torch.device("cuda"), tf32=False)  # the plan did not assume it: the user's setting stays
        assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")
        Precision("fp32", torch.device("cuda"), tf32=True)  # constructing touches no device
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
