"""A DP degree per stage (Sailor's plans): ``memx estimate --stage-dp``, the --cases column
``stage_dp`` and plan files. A pipeline micro-batch is the largest degree x micro-batch sequences
on every stage; a stage of fewer replicas runs larger local micro-batches. No torch."""

import json

import pytest
from estimates import cases_rows, cluster_file, estimated_plan
from one_node import A100, H100, one_node

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.config_exports import torchtitan_toml
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.plan import Plan
from memx_launch.planning.runtime_support import check_runnable
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
MIXED = {"version": 1, "name": "h100-a100", "device_types": {"h100": H100, "a100": A100},
         "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}, {"devices": {"a100": 8}, "intra_node_gbps": 300}],
         "inter_node_gbps": 50}
TRAINING = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron")


def _estimate(stage_tp, stage_dp, layers=(20, 12), mbs=1, training=TRAINING):
    uniform_tp, uniform_dp = len(set(stage_tp)) == 1, len(set(stage_dp)) == 1
    return evaluate_layout(MODEL, ClusterSpec.from_dict(MIXED), training, pp=2, micro_batch_size=mbs,
                           tp=stage_tp[0] if uniform_tp else None, stage_tp=None if uniform_tp else list(stage_tp),
                           dp=stage_dp[0] if uniform_dp else None, stage_dp=None if uniform_dp else list(stage_dp),
                           layers_per_stage=list(layers), stage_devices=["h100", "a100"], references=(1.0, 1.0, 1.0))


def test_a_stage_of_fewer_replicas_runs_larger_local_micro_batches():
    """Stage 1 on half the replicas: each runs the pipeline micro-batch's 8 sequences over 4
    replicas, 2 each. Its layer costs are those of micro-batch 2, stage 0's of micro-batch 1, each
    as a uniform layout of that micro-batch would give them; the gradients of each stage sync over
    its own replicas."""
    mixed = _estimate((1, 2), (8, 4))
    assert (mixed.dp, mixed.stage_dp, mixed.num_microbatches, mixed.world_size) == (8, [8, 4], 8, 16)
    ones, twos = _estimate((1, 1), (8, 8)), _estimate((2, 2), (4, 4), mbs=2)
    assert ones.num_microbatches == twos.num_microbatches == 8
    assert mixed.stages[0].predicted_stage_time_s == pytest.approx(ones.stages[0].predicted_stage_time_s, rel=1e-12)
    assert mixed.stages[1].predicted_stage_time_s == pytest.approx(twos.stages[1].predicted_stage_time_s, rel=1e-12)
    # Optimizer states shard over each stage's own replicas (the distributed optimizer).
    for stage, same in ((0, ones), (1, twos)):
        assert mixed.stages[stage].memory_parts_gib["optimizer_states"] == pytest.approx(
            same.stages[stage].memory_parts_gib["optimizer_states"], rel=1e-12)


def test_equal_degrees_are_the_uniform_layout():
    spec = ClusterSpec.from_dict(MIXED)
    given = evaluate_layout(MODEL, spec, TRAINING, tp=2, pp=2, dp=None, stage_dp=[4, 4], micro_batch_size=1,
                            layers_per_stage=[20, 12], references=(1.0, 1.0, 1.0))
    uniform = evaluate_layout(MODEL, spec, TRAINING, tp=2, pp=2, dp=4, micro_batch_size=1,
                              layers_per_stage=[20, 12], references=(1.0, 1.0, 1.0))
    assert given.stage_dp is None and given.predicted_iteration_time_s == uniform.predicted_iteration_time_s
    assert [s.predicted_peak_memory_gib for s in given.stages] == [s.predicted_peak_memory_gib for s in uniform.stages]


def test_sends_carry_the_larger_sides_share():
    """Stage 0's replicas send 1 sequence each, stage 1's receive 2: the edge carries 2 per rank."""
    from memx_launch.planning.pipeline_sends import edge_micro_batch
    from memx_launch.planning.layouts import layout_from_stage_devices

    spec = ClusterSpec.from_dict(MIXED)
    layout = layout_from_stage_devices(MODEL, spec, ("h100", "a100"), (1, 2), 2, (8, 4), ["h100", "a100"])
    assert layout.local_micro_batch(1).tolist() == [1, 2]
    assert edge_micro_batch(layout, 1).tolist() == [2, 2]
    assert layout.communicators.tolist() == [cm.communicators_per_rank(1, 2, 8, 16), cm.communicators_per_rank(2, 2, 4, 16)]


def test_plan_files_keep_the_degrees_and_the_runtimes_refuse_them():
    training = TrainingSpec(global_batch_size=48, seq_len=4096, setup="megatron")
    plan = evaluate_layout(MODEL, ClusterSpec.from_dict(one_node(H100, 8, 450)), training, tp=1, pp=2, dp=None,
                           stage_dp=[6, 2], micro_batch_size=1, layers_per_stage=[24, 8], references=(1.0, 1.0, 1.0))
    assert [len(s.ranks) for s in plan.stages] == [6, 2]
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.stage_dp == [6, 2] and again.world_size == 8
    from memx_launch.planning.estimate import evaluate_plan
    redone = evaluate_plan(again, ClusterSpec.from_dict(one_node(H100, 8, 450)), training)
    assert redone.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s, rel=1e-12)
    for consumer in (megatron_args, torchtitan_toml, check_runnable):
        with pytest.raises(ConfigError, match="different DP degrees"):
            consumer(plan)
    data = plan.to_dict()
    data["stage_dp"] = [6, 4]
    with pytest.raises(ConfigError, match="stage_dp"):
        Plan.from_dict(data)


def test_cli_flag_cases_column_and_refusals(tmp_path, capsys):
    path = cluster_file(tmp_path, MIXED)
    flags = ["--model", "llama2-7b", "--cluster", path, "--global-batch-size", "64", "--setup", "megatron"]
    layout = ["--pp", "2", "--stage-tp", "1,2", "--stage-dp", "8,4", "--micro-batch-size", "1",
              "--layers-per-stage", "20,12", "--stage-devices", "h100,a100"]
    plan = estimated_plan(tmp_path, "sdp", [*flags, *layout])
    assert plan["stage_dp"] == [8, 4] and plan["dp"] == 8
    rows = cases_rows(capsys, tmp_path, "id,pp,stage_tp,stage_dp,layers_per_stage,stage_devices\n"
                      "a,2,1|2,8|4,20|12,h100|a100\n", flags)
    assert rows["a"]["iteration_time_s"] == pytest.approx(plan["predicted_iteration_time_s"], rel=1e-12)
    assert rows["a"]["num_microbatches"] == 8
    for bad, problem in ((["--stage-dp", "8,3"], "--stage-dp"), (["--stage-dp", "8,4,2"], "--stage-dp"),
                         (["--stage-dp", "8,4", "--dp", "4"], "--dp")):
        args = [a for a in layout if a not in ("--stage-dp", "8,4")]
        capsys.readouterr()
        assert main(["estimate", *flags, *args, *bad]) != 0
        err = capsys.readouterr().err
        assert problem in err and len(err.strip().splitlines()) == 1, err


def test_the_search_gives_each_device_type_its_own_dp_degree_when_asked():
    from memx_launch.planning.search import search
    from memx_launch.planning.search_space import SearchSpace

    cluster = ClusterSpec.from_dict({**MIXED, "nodes": [*MIXED["nodes"], MIXED["nodes"][1]]})  # 8 H100, 16 A100
    plain = search(MODEL, cluster, TRAINING, top_k=5)
    per_type = search(MODEL, cluster, TRAINING, space=SearchSpace(per_type_dp=True), top_k=200)
    assert per_type.stats.enumerated > plain.stats.enumerated
    assert all(p.stage_dp is None for p in plain.plans)
    unequal = [p for p in per_type.plans if p.stage_dp is not None]
    assert unequal and all(max(p.stage_dp) % d == 0 for p in unequal for d in p.stage_dp)
    # A superset of the layouts: never a slower fastest plan.
    assert per_type.fastest.predicted_iteration_time_s <= plain.fastest.predicted_iteration_time_s
    # Its plans are what memx estimate predicts for them again.
    from memx_launch.planning.estimate import evaluate_plan
    again = evaluate_plan(unequal[0], cluster, TRAINING)
    assert again.predicted_iteration_time_s == pytest.approx(unequal[0].predicted_iteration_time_s, rel=1e-9)
