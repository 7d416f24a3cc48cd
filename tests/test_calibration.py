"""In-job calibration: rank timeouts, and a rank killed mid-way whose samples are kept."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch.distributed as dist

from memx_launch.planning.tp_links import TpLink
from memx_launch.runtime.faults import Faults
from memx_launch.profiling.profiledb import ProfileDB
from memx_launch.runtime.calibration import CalibrationTimeout, TypeCalibration, TypeGroups, make_groups
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from test_replan_e2e import at_cpu_speed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
CPU_CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")


def test_a_rank_that_never_reports_is_named_with_its_device(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cluster = ClusterSpec.from_yaml(CPU_CLUSTER)
        model = get_model("llama-tiny")
        # Rank 1 belongs to the type but is not in this one-process job: it never reports.
        groups = TypeGroups([0, 1], None)
        calibration = TypeCalibration(model, cluster.device_type("fast-small"), groups,
                                      ProfileDB(str(tmp_path / "p.jsonl")), [], device="cpu", dtype="fp32",
                                      slowdown=1.0, tp_link=lambda tp: TpLink(2.0, False),
                                      describe_rank=lambda r: f"fast-small (emulated) #{r}", faults=Faults(),
                                      timeout_s=0.3)
        with pytest.raises(CalibrationTimeout, match=r"rank 1 \(fast-small \(emulated\) #1\) did not report"):
            calibration.measure([])
    finally:
        dist.destroy_process_group()


def test_the_user_s_block_is_calibrated_with_its_own_kv_heads_and_projections(tmp_path):
    """memx's block is built with a sample's KV heads, the user's with its own: a user block's
    samples at other counts would measure the same block under another label. Its records say
    the projections and norms it runs (the toy's one q, k, v linear, memx-run's setup three; its
    LayerNorm kernel, where its shape reads as RMSNorm's), and a later
    job with the same options reuses them."""
    from memx_launch.models.adapters import ModelParts
    from memx_launch.models.block_reading import own_block_training
    from memx_launch.profiling.kernel import CALIBRATED_AS
    from memx_launch.specs.training import TrainingSpec
    from toy_models import TOY_SPEC, ToyModel

    parts = ModelParts(ToyModel())
    _, own = own_block_training(TrainingSpec(setup="memx-run"), parts.blocks[0], TOY_SPEC)
    # one q, k, v linear; torch's LayerNorm kernel; its selective level the whole block (memx cannot see inside)
    assert own == {"fused_qkv": True, "fused_norm": True, "selective_recompute": "block"}
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cluster = ClusterSpec.from_yaml(CPU_CLUSTER)
        groups = TypeGroups([0], None, {1: [(None, [0])]})

        def calibration(stored):
            return TypeCalibration(TOY_SPEC, cluster.device_type("fast-small"), groups,
                                   ProfileDB(str(tmp_path / "p.jsonl")), stored, device="cpu", dtype="fp32",
                                   slowdown=None, tp_link=lambda tp: TpLink(2.0, False), describe_rank=str,
                                   faults=Faults(), user_parts=parts, log=lambda line: None,
                                   run_options={**CALIBRATED_AS, **own})
        measured = calibration([]).run([1], budget=8)
        again = calibration(measured)
        assert again.run([1], budget=8) == measured and again.done == 0
    finally:
        dist.destroy_process_group()
    assert len(measured) > 1
    assert {m.block_shape["num_kv_heads"] for m in measured} == {TOY_SPEC.num_kv_heads}
    assert all(m.run_options == {"setup": "memx-run", "fused_qkv": True, "fused_norm": True,
                                 "selective_recompute": "block"} for m in measured)


def test_tp_subgroups_are_the_search_degrees_inside_one_node(monkeypatch):
    # new_group is collective; here each call just records the ranks it was given.
    from memx_launch.runtime import communication
    monkeypatch.setattr(communication, "new_group", lambda ranks, backend: tuple(ranks))
    groups = make_groups(ClusterSpec.from_yaml(CPU_CLUSTER), get_model("llama-tiny"))
    assert sorted(groups) == ["fast-small", "slow-big"]
    assert groups["fast-small"].tp_groups[2] == [((0, 1), [0, 1])]
    assert groups["slow-big"].tp_groups[2] == [((2, 3), [2, 3])]
    assert set(groups["fast-small"].tp_groups) == {1, 2}  # the search never uses TP 4 here


@pytest.mark.slow
def test_rank_killed_during_calibration_job_finishes_and_samples_are_not_measured_again(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, MEMX_FAULT_KILL_CALIBRATION="rank=2,after=3", MEMX_FAULT_MARKER_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4", "--max-restarts", "1",
         "--cluster", at_cpu_speed(tmp_path), "--run-dir", str(run_dir), "--profile-db",
         str(tmp_path / "profile.jsonl"),
         TRAIN, "--model", "llama-tiny", "--steps", "3", "--synthetic"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "kill-calibration-rank2").exists()  # the fault did fire
    assert "done: 3 steps" in out
    # After the restart the profile's samples were read back ...
    assert "already holds" in out and "not measured again" in out
    # ... and none was measured twice: every sample key appears once in the profile.
    records = [json.loads(line) for line in open(tmp_path / "profile.jsonl")]
    keys = Counter((r["device_type"], r["tp"], r["micro_batch_size"], r["seq_len"], r["recompute"],
                    r["block_shape"]["num_kv_heads"]) for r in records)
    assert keys and max(keys.values()) == 1
