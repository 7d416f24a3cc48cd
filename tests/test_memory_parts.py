"""`memx estimate` says what it counted: each stage's peak by part, adding up to the peak."""

import json
import os

import pytest

from memx_launch.cli import main
from memx_launch.planning import costmodel as cm
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.layouts import layout_from_stage_devices
from memx_launch.planning.plan import Plan
from memx_launch.planning.memory_parts import MEMORY_PARTS
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
PAPER20 = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "paper-20gpu.yaml"))  # a100: overhead and communicators
TABLE1 = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
MODEL = get_model("llama2-7b")
BATCH = 80  # whole rounds of pp=5 micro-batches for the interleaved schedule


def estimate(cluster=PAPER20, training=None, **layout):
    training = training or TrainingSpec(global_batch_size=BATCH, seq_len=MODEL.seq_len)
    return evaluate_layout(MODEL, cluster, training, micro_batch_size=layout.pop("mbs", 1), references=(1, 1, 1),
                           **layout)


def parts(plan, stage):
    return plan.stages[stage].memory_parts_gib


LAYOUTS = {
    "1f1b": dict(tp=1, pp=5, dp=4),
    "interleaved": dict(tp=1, pp=5, dp=4, schedule="interleaved", virtual_stages=2),
    "selective": dict(tp=2, pp=5, dp=2, recompute="selective", mbs=2),
    "full:K and none": dict(tp=1, pp=5, dp=4, recompute="full:3,none,full,none,selective"),
    "full:everyN": dict(tp=1, pp=5, dp=4, recompute="full:every2,full:every3,none,full:every2,full"),
    "per-stage TP": dict(tp=None, stage_tp=[2, 4, 4], pp=3, dp=2,
                         stage_devices=["a100-80gb", "vendor-b-32gb", "vendor-c-32gb"]),
    "mixed stage": dict(cluster=TABLE1, tp=4, pp=2, dp=2, recompute="full",
                        stage_devices=["vendor-x-32gb+vendor-y-64gb"] * 2),
}
SETUPS = {"plain": {}, "distributed optimizer": dict(distributed_optimizer=True), "megatron": dict(setup="megatron"),
          "zero2": dict(setup="zero2"), "fully sharded": dict(fully_sharded=True, keep_stage_outputs=True),
          "fully sharded, gathered every micro-batch": dict(fully_sharded=True, hold_gathered="never"),
          "fp32 sgd": dict(dtype="fp32", optimizer="sgd")}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_the_parts_add_up_to_each_stages_peak(name, setup):
    training = TrainingSpec(global_batch_size=BATCH, seq_len=MODEL.seq_len, **SETUPS[setup])
    plan = estimate(training=training, **LAYOUTS[name])
    for stage in plan.stages:
        assert list(stage.memory_parts_gib) == list(MEMORY_PARTS)
        assert min(stage.memory_parts_gib.values()) >= 0
        # The peak is written to 6 decimals; the parts are its terms, told apart.
        assert sum(stage.memory_parts_gib.values()) == pytest.approx(stage.predicted_peak_memory_gib, abs=1e-6)


def test_each_part_moves_the_way_its_setting_moves_it():
    gib = cm.GIB
    base = estimate(tp=1, pp=5, dp=4)
    a100 = PAPER20.device_type("a100-80gb")
    # Fixed overhead and communicator buffers are the device type's (stage 0 is on the a100s),
    # logits only on the last stage, no pipeline buffers unless the engine keeps its outputs.
    communicators = layout_from_stage_devices(MODEL, PAPER20, tuple(d.name for d in PAPER20.device_types), 1, 5, 4,
                                              None).communicators[0]
    assert a100.overhead_bytes > 0 and communicators * a100.communicator_bytes > 0
    assert parts(base, 0)["fixed_overhead"] == pytest.approx(a100.overhead_bytes / gib)
    assert parts(base, 0)["communicator_buffers"] == pytest.approx(communicators * a100.communicator_bytes / gib)
    assert [parts(base, i)["logits_loss"] > 0 for i in range(5)] == [False] * 4 + [True]
    assert all(parts(base, i)["pipeline_buffers"] == 0 for i in range(5))
    kept = estimate(training=TrainingSpec(global_batch_size=BATCH, seq_len=MODEL.seq_len, keep_stage_outputs=True,
                                          keep_previous_logits=True), tp=1, pp=5, dp=4)
    assert all(parts(kept, i)["pipeline_buffers"] > 0 for i in range(5))
    # Mixed-precision Adam: 2 + 4 + 12 bytes per parameter; the distributed optimizer shards the 12.
    assert parts(base, 1)["gradients"] == pytest.approx(2 * parts(base, 1)["parameters"])
    assert parts(base, 1)["optimizer_states"] == pytest.approx(6 * parts(base, 1)["parameters"])

    def optimizer_per_weight(dp, pp, **setup):
        plan = estimate(training=TrainingSpec(global_batch_size=BATCH, seq_len=MODEL.seq_len, **setup),
                        cluster=TABLE1, tp=1, pp=pp, dp=dp)
        return [parts(plan, i)["optimizer_states"] / parts(plan, i)["parameters"] for i in range(pp)]

    assert optimizer_per_weight(4, 4, distributed_optimizer=True) == pytest.approx([6 / 4] * 4)
    assert optimizer_per_weight(8, 2, distributed_optimizer=True) == pytest.approx([6 / 8] * 2)  # more DP, less
    assert optimizer_per_weight(8, 2) == pytest.approx([6] * 2)  # unsharded: DP changes nothing
    # Recompute and the micro-batch move activations (and the last stage's logits), never model states.
    full, mbs2 = estimate(tp=1, pp=5, dp=4, recompute="full"), estimate(tp=1, pp=5, dp=4, mbs=2)
    states = ("parameters", "gradients", "optimizer_states")
    for i in range(5):
        assert parts(full, i)["activations"] < parts(base, i)["activations"]
        assert [parts(full, i)[k] for k in states] == [parts(base, i)[k] for k in states]
        assert parts(mbs2, i)["activations"] > parts(base, i)["activations"]
    assert parts(mbs2, 4)["logits_loss"] == pytest.approx(2 * parts(base, 4)["logits_loss"])
    # Interleaving keeps more micro-batches in flight on the first stage.
    interleaved = estimate(tp=1, pp=5, dp=4, schedule="interleaved", virtual_stages=2)
    assert parts(interleaved, 0)["activations"] > parts(base, 0)["activations"]
    # Full sharding, gathered every micro-batch: model states over DP, plus two gathered layers of
    # weights (one prefetched) and one layer's gradient.
    sharded = estimate(training=TrainingSpec(global_batch_size=BATCH, seq_len=MODEL.seq_len, fully_sharded=True,
                                             hold_gathered="never"), tp=1, pp=5, dp=4)
    gathered = MODEL.layer_params * 2 * 2 / gib
    assert parts(sharded, 1)["parameters"] > gathered and parts(sharded, 1)["parameters"] < parts(base, 1)["parameters"]
    # Held through the step, as torch's pipelining runs FSDP2: every layer's weights gathered in bf16
    # and its gradient unsharded in fp32, none per layer in flight but a fresh bf16 gradient.
    held = estimate(training=TrainingSpec(global_batch_size=BATCH, seq_len=MODEL.seq_len, fully_sharded=True),
                    tp=1, pp=5, dp=4)
    layers, layer = held.stages[1].num_layers, MODEL.layer_params / gib
    assert sharded.stages[1].num_layers == layers
    assert parts(held, 1)["parameters"] - parts(sharded, 1)["parameters"] == pytest.approx((layers - 2) * layer * 2)
    assert parts(held, 1)["gradients"] - parts(sharded, 1)["gradients"] == pytest.approx(layers * layer * 4
                                                                                          - layer * 4 + layer * 2)
    assert parts(held, 1)["optimizer_states"] == pytest.approx(parts(sharded, 1)["optimizer_states"])


def test_the_plan_file_and_the_report_carry_the_parts(tmp_path, capsys):
    path = tmp_path / "est.json"
    code = main(["estimate", "--model", "llama2-7b", "--cluster", os.path.join(CLUSTERS, "paper-20gpu.yaml"),
                 "--tp", "1", "--pp", "5", "--dp", "4", "--micro-batch-size", "1", "--global-batch-size", "80",
                 "--recompute", "full", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "memory by part, per device:" in out
    lines = out.splitlines()
    header = lines[lines.index("memory by part, per device:") + 1]
    assert header.split() == ["params", "grads", "optimizer", "step", "end", "activations", "logits", "pipeline",
                              "comm", "fixed", "=", "peak"]
    assert [line.split()[:2] for line in lines if line.startswith("stage ") and "GiB" in line][:2] == \
        [["stage", "0"], ["stage", "1"]]
    data = json.loads(path.read_text())
    assert set(data["stages"][0]["memory_parts_gib"]) == set(MEMORY_PARTS)
    loaded = Plan.load(str(path))
    assert loaded.stages[0].memory_parts_gib == data["stages"][0]["memory_parts_gib"]
    # A plan without parts (memx plan's) writes no key; a negative part is refused in one line.
    loaded.stages[0].memory_parts_gib = None
    assert "memory_parts_gib" not in loaded.to_dict()["stages"][0]
    data["stages"][0]["memory_parts_gib"]["activations"] = -1.0
    with pytest.raises(Exception, match=r"stages\[0\]\.memory_parts_gib\.activations"):
        Plan.from_dict(data)
