"""A checkpoint written under one pipeline split loads under another: same parameters, same
optimizer state (the same losses afterwards), data position and RNG restored."""

import os

import pytest
import torch

from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.specs.model import get_model
from ranks import spawn_ranks

SPEC = get_model("llama-tiny")
# fp32 on CPU, same operations in the same order per layer: differences come only from how the
# split sums; measured ~1e-7, and a missing optimizer state moves the loss by more than 1e-3.
LOSS_ATOL = 1e-5


def make_plan(layers, recompute):
    stages = [StagePlan("cpu", [i], n, r, 0.0, 0.0) for i, (n, r) in enumerate(zip(layers, recompute))]
    plan = Plan("llama-tiny", SPEC, "test", 1, 2, 1, 2, 4, 32, "1f1b", 1, stages, 0.0,
                Objective(1.0, "default", (0.4, 0.2, 0.4)))
    plan.validate()
    return plan


def _batch(step):
    tokens = torch.randint(0, SPEC.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _params(runtime):
    return {n: p.detach().clone().numpy() for m in runtime.chunks for n, p in m.named_parameters()}


def _worker(rank, port, directory, queue):
    import torch.distributed as dist
    from memx_launch.runtime.checkpoint import load_checkpoint, save_checkpoint
    from memx_launch.runtime.training import Runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        def run(runtime, steps):
            return [runtime.step(*(runtime.local_batch(t) for t in _batch(s))).loss for s in steps]

        before = Runtime(make_plan([5, 3], ["none", "full"]), rank, lr=1e-2)
        run(before, range(1, 4))
        torch.manual_seed(123 + rank)
        save_checkpoint(directory, before.chunks, before.optimizer, 3, {"next_step": 4, "epoch": 0})
        saved_params, saved_draw = _params(before), torch.rand(3)
        continued = run(before, range(4, 6))

        after = Runtime(make_plan([3, 5], ["selective", "none"]), rank, lr=1e-2)
        torch.manual_seed(999)
        resumed = load_checkpoint(directory, after.chunks, after.optimizer)
        loaded_draw = torch.rand(3)
        loaded_params = _params(after)
        queue.put((rank, dict(step=resumed.step, data=resumed.data_state, saved=saved_params, loaded=loaded_params,
                              rng_equal=bool(torch.equal(saved_draw, loaded_draw)), continued=continued,
                              resumed=run(after, range(4, 6)))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_checkpoint_loads_under_another_split(tmp_path):
    results = spawn_ranks(_worker, 2, str(tmp_path))
    saved = {**results[0]["saved"], **results[1]["saved"]}
    loaded = {**results[0]["loaded"], **results[1]["loaded"]}
    assert set(saved) == set(loaded)
    assert set(results[1]["loaded"]) & {"layers.3.attention.wq.weight"}  # layer 3 moved from rank 0 to 1
    for name in saved:
        assert (saved[name] == loaded[name]).all(), name  # bit-identical parameters
    for r in (0, 1):
        assert results[r]["step"] == 3 and results[r]["data"] == {"next_step": 4, "epoch": 0}
        assert results[r]["rng_equal"]
        assert results[r]["resumed"] == pytest.approx(results[r]["continued"], abs=LOSS_ATOL)
    assert os.path.isdir(tmp_path / "step-00000003") and not os.path.exists(tmp_path / "step-00000003.tmp")
