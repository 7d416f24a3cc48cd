"""A checkpoint written under one pipeline split loads under another: same parameters, same
optimizer state (the same losses afterwards), data position and RNG restored."""

import os

import pytest
import torch

from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.specs.catalog import get_model
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
    (tmp_path / "step-00000001.tmp").mkdir()  # as a save killed with -9 leaves it
    (tmp_path / "step-00000001.tmp" / "rank00000.safetensors").write_bytes(b"x" * 1000)
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
    assert not os.path.exists(tmp_path / "step-00000001.tmp")  # a save killed earlier leaves nothing behind


def _tp_worker(rank, port, directory, queue):
    """Written under pp=2 (whole tensors), read under tp=2 (DTensor shards of them)."""
    import torch.distributed as dist
    from memx_launch.runtime.checkpoint import load_checkpoint, save_checkpoint
    from memx_launch.runtime.training import Runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        before = Runtime(make_plan([4, 4], ["none", "none"]), rank, lr=1e-2)
        before.step(*(before.local_batch(t) for t in _batch(1)))
        save_checkpoint(directory, before.chunks, before.optimizer, 1, {})
        saved = _params(before)
        stages = [StagePlan("cpu", [0, 1], 8, "none", 0.0, 0.0)]
        tp_plan = Plan("llama-tiny", SPEC, "test", 2, 1, 1, 2, 4, 32, "1f1b", 1, stages, 0.0,
                       Objective(1.0, "default", (0.4, 0.2, 0.4)))
        after = Runtime(tp_plan, rank, lr=1e-2)
        load_checkpoint(directory, after.chunks, after.optimizer)
        loaded = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().numpy()
                  for m in after.chunks for n, p in m.named_parameters()}
        states = [s for s in after.optimizer.state.values()]
        queue.put((rank, dict(saved=saved, loaded=loaded, optimizer_states=len(states),
                              exp_avg_nonzero=all(float(s["exp_avg"].to_local().abs().sum()
                                                        if hasattr(s["exp_avg"], "to_local")
                                                        else s["exp_avg"].abs().sum()) > 0 for s in states))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_checkpoint_reshards_into_tensor_parallel_shards(tmp_path):
    results = spawn_ranks(_tp_worker, 2, str(tmp_path))
    saved = {**results[0]["saved"], **results[1]["saved"]}
    for r in (0, 1):
        loaded = results[r]["loaded"]
        assert set(loaded) == set(saved)
        for name in saved:
            assert (saved[name] == loaded[name]).all(), name
        assert results[r]["optimizer_states"] and results[r]["exp_avg_nonzero"]
    assert not list(tmp_path.glob("step-*/.metadata"))  # no pickled DCP metadata is written


def _pickle_bomb(marker):
    """A pickle that creates ``marker`` when unpickled."""
    import pickle

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    return pickle.dumps(Bomb())


def test_a_crafted_pickle_in_a_checkpoint_folder_is_never_executed(tmp_path):
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.checkpoint import load_checkpoint

    marker = tmp_path / "pwned"
    step = tmp_path / "step-00000003"
    step.mkdir()
    for name in (".metadata", "__0_0.distcp", "memx.json"):
        (step / name).write_bytes(_pickle_bomb(marker))
    (tmp_path / "latest.json").write_text('{"step": 3, "path": "step-00000003"}')
    with pytest.raises(ConfigError, match="memx.json"):
        load_checkpoint(str(tmp_path), [], None)
    assert not marker.exists()


@pytest.mark.parametrize("latest", ['{"path": "/etc"}', '{"path": "../x"}', '{"path": "step-00000001/../../x"}',
                                    '[1]', 'garbage', '{"path": "step-00000009"}'])
def test_latest_json_cannot_point_outside_the_checkpoint_directory(tmp_path, latest):
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.checkpoint import latest_checkpoint

    (tmp_path / "latest.json").write_text(latest)
    with pytest.raises(ConfigError, match="latest.json"):
        latest_checkpoint(str(tmp_path))


def test_a_step_folder_linked_outside_is_refused(tmp_path):
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.checkpoint import latest_checkpoint

    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "step-00000001")
    (run / "latest.json").write_text('{"step": 1, "path": "step-00000001"}')
    with pytest.raises(ConfigError, match="outside"):
        latest_checkpoint(str(run))


@pytest.fixture
def one_rank(tmp_path):
    """This process as a job of one rank (the checkpoint's collectives need a process group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _saved_linear(directory):
    from memx_launch.runtime.checkpoint import save_checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, save_checkpoint(str(directory), [model], optimizer, step=1)


@pytest.mark.parametrize("key, value", [("lr", "abc"), ("lr", None), ("lr", True), ("betas", [0.9]),
                                        ("betas", ["a", "b"]), ("rng.rank0.python", [3, [1, 2], None]),
                                        ("rng.rank0.numpy", ["MT19937", [2**70] * 624, 0, 0, 0.0]),
                                        ("rng.rank0.numpy", "garbage")])
def test_a_tampered_checkpoint_scalar_is_one_error(tmp_path, one_rank, key, value):
    import json

    from memx_launch.errors import ConfigError
    from memx_launch.runtime.checkpoint import META, load_checkpoint

    model, optimizer, folder = _saved_linear(tmp_path / "ckpt")
    meta = json.loads(open(os.path.join(folder, META)).read())
    names = [k for k in meta["values"] if k == key or k.endswith("." + key)]
    assert names, sorted(meta["values"])
    for name in names:
        meta["values"][name] = value
    with open(os.path.join(folder, META), "w") as f:
        json.dump(meta, f)
    with pytest.raises(ConfigError, match="memx.json") as exc:
        load_checkpoint(str(tmp_path / "ckpt"), [model], optimizer)
    assert "\n" not in str(exc.value)


def test_an_untampered_checkpoint_loads_its_scalars(tmp_path, one_rank):
    from memx_launch.runtime.checkpoint import load_checkpoint

    model, optimizer, _ = _saved_linear(tmp_path / "ckpt")
    optimizer.param_groups[0]["lr"] = 5.0
    assert load_checkpoint(str(tmp_path / "ckpt"), [model], optimizer).step == 1
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_a_huge_checkpoint_metadata_file_is_refused_before_it_is_read(tmp_path, one_rank):
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.checkpoint import META, load_checkpoint

    model, optimizer, folder = _saved_linear(tmp_path / "ckpt")
    with open(os.path.join(folder, META), "r+b") as f:
        f.truncate(28 * 10**6)  # sparse: the size is what is refused, before any byte is parsed
    with pytest.raises(ConfigError, match="over the limit"):
        load_checkpoint(str(tmp_path / "ckpt"), [model], optimizer)


@pytest.mark.parametrize("failing", ["makedirs", "save_file", "replace"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, one_rank,
                                                                                  monkeypatch, failing):
    """The step's folder (rank 0), the tensors' file (every rank) or the folder's completion
    (rank 0: write_json_atomic's own error) meets ENOSPC."""
    import errno

    from memx_launch.errors import ConfigError
    from memx_launch.runtime import checkpoint

    model, optimizer, _ = _saved_linear(tmp_path / "ckpt")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint if failing == "save_file" else os, failing, disk_full)
    with pytest.raises(ConfigError, match=r"^checkpoint: step 2 was not saved under .*No space left on device.*"
                                          r"step-00000001 is intact; free space") as exc:
        checkpoint.save_checkpoint(str(tmp_path / "ckpt"), [model], optimizer, step=2)
    assert "\n" not in str(exc.value)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest.json", "step-00000001"]
    assert checkpoint.load_checkpoint(str(tmp_path / "ckpt"), [model], optimizer).step == 1
