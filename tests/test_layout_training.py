"""planning/layout_training.py: memx-run runs a layout with TP > 1 and DP > 1 fully sharded (its DDP
cannot hold TP's DTensor parameters; runtime/training.py), and its plans are priced and recorded so."""

import os
from dataclasses import replace

import pytest
import yaml

from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.layout_training import layout_training, plan_sharded_stages
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.profiling.prediction_cache import CachedCostModel
from memx_launch.profiling.predictor import LearnedCostModel
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
A100S = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
    "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
    "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})
MODEL = get_model("llama2-7b")
MEMX_RUN = TrainingSpec(global_batch_size=32, seq_len=2048, setup="memx-run")
# Two communication domains: six A100s (NCCL) and two MI250s (RCCL).
TWO_VENDORS = {"version": 1, "device_types": {
    "a100": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039},
    "mi250": {"vendor": "amd", "memory_gib": 64, "peak_tflops": 191, "memory_bandwidth_gbps": 1638}},
    "nodes": [{"devices": {"a100": 6}, "intra_node_gbps": 300}, {"devices": {"mi250": 2}, "intra_node_gbps": 100}],
    "inter_node_gbps": 25}
# Stage 0: TP 2 x DP 2 on A100s; stage 1: TP 2 x DP 2 whose DP groups pair an A100 with an MI250.
ONE_STAGE_CROSSES = dict(tp=2, pp=2, dp=2, micro_batch_size=1, stage_devices=["a100", "a100+mi250"],
                         references=(1.0, 1.0, 1.0))


def _estimate(training, **layout):
    return evaluate_layout(MODEL, A100S, training, pp=1, micro_batch_size=1, references=(1.0, 1.0, 1.0), **layout)


def test_a_tp_by_dp_layout_of_memx_run_is_priced_and_recorded_fully_sharded():
    sharded = _estimate(MEMX_RUN, tp=2, dp=4)
    as_ddp = _estimate(replace(MEMX_RUN, fully_sharded_with_tp=False), tp=2, dp=4)
    assert sharded.training["fully_sharded"] and not as_ddp.training["fully_sharded"]
    # The plan is what a fully sharded estimate of the layout gives, part by part.
    explicit = _estimate(replace(MEMX_RUN, fully_sharded=True), tp=2, dp=4)
    assert sharded.stages[0].memory_parts_gib == explicit.stages[0].memory_parts_gib
    parts, ddp = sharded.stages[0].memory_parts_gib, as_ddp.stages[0].memory_parts_gib
    # Adam's moments and the fp32 weights sharded over the 4 replicas; no autocast: 16-bit residual stream.
    assert parts["optimizer_states"] == pytest.approx(ddp["optimizer_states"] / 4)
    assert parts["activations"] < ddp["activations"]
    # TP 1 (DDP) and DP 1 (nothing to shard) keep the training as given.
    assert not _estimate(MEMX_RUN, tp=1, dp=8).training["fully_sharded"]
    assert not evaluate_layout(MODEL, A100S, MEMX_RUN, tp=2, pp=4, dp=1, micro_batch_size=1,
                               references=(1.0, 1.0, 1.0)).training["fully_sharded"]
    # Other setups run DDP whatever TP is.
    assert not _estimate(TrainingSpec(global_batch_size=32, seq_len=2048, setup="ddp"), tp=2, dp=4).training["fully_sharded"]


def test_the_search_prices_each_layout_as_it_runs():
    plans = []
    for tp_degrees in ((1,), (2, 4, 8)):  # whole layouts and TP x DP ones, each ranked apart
        result = search(MODEL, A100S, MEMX_RUN, space=SearchSpace(
            micro_batch_sizes=(1,), recompute_levels=("none", "full"), tp_degrees=tp_degrees), top_k=50)
        plans += result.plans + result.pareto
    both = {(p.tp, p.dp) for p in plans}
    assert any(tp > 1 and dp > 1 for tp, dp in both) and any(tp == 1 for tp, _ in both)
    for plan in plans:
        assert plan.training["fully_sharded"] == (plan.tp > 1 and plan.dp > 1), (plan.tp, plan.dp)
        again = evaluate_layout(MODEL, A100S, MEMX_RUN, tp=plan.tp, pp=plan.pp, dp=plan.dp,
                                micro_batch_size=plan.micro_batch_size, schedule=plan.schedule,
                                virtual_stages=plan.virtual_stages, layers_per_stage=[s.num_layers for s in plan.stages],
                                recompute=",".join(s.recompute for s in plan.stages), references=(1.0, 1.0, 1.0))
        assert [s.predicted_peak_memory_gib for s in again.stages] == \
            pytest.approx([s.predicted_peak_memory_gib for s in plan.stages])


def test_a_dp_group_across_domains_keeps_its_replicas_whole():
    """memx-run averages such a group's gradients itself, whole on every replica."""
    cluster = ClusterSpec.from_yaml(os.path.join(EXAMPLES, "cpu-two-vendors.yaml"))
    training = TrainingSpec(global_batch_size=8, seq_len=64, dtype="fp32", setup="memx-run")
    crossing = evaluate_layout(get_model("llama-tiny"), cluster, training, tp=2, pp=1, dp=2, micro_batch_size=1,
                               stage_devices=["nv-small+amd-big"], references=(1.0, 1.0, 1.0))
    assert not crossing.training["fully_sharded"] and crossing.crossings
    within = evaluate_layout(get_model("llama-tiny"), cluster, training, tp=1, pp=2, dp=2, micro_batch_size=1,
                             stage_devices=["nv-small", "amd-big"], references=(1.0, 1.0, 1.0))
    assert not within.training["fully_sharded"]  # TP 1: DDP


def test_a_dp_group_across_domains_leaves_the_other_stages_with_tp_fully_sharded():
    """memx-run runs stage 0 as FSDP2 and averages stage 1's gradients itself, whole: each stage is
    priced as the training it runs, and the plan records the training as given."""
    cluster = ClusterSpec.from_dict(TWO_VENDORS)
    mixed = evaluate_layout(MODEL, cluster, MEMX_RUN, **ONE_STAGE_CROSSES)
    sharded = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded=True), **ONE_STAGE_CROSSES)
    whole = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded_with_tp=False), **ONE_STAGE_CROSSES)
    assert not mixed.training["fully_sharded"] and plan_sharded_stages(MEMX_RUN, mixed) == [0]
    assert mixed.stages[0].memory_parts_gib == sharded.stages[0].memory_parts_gib
    # Stage 1 receives stage 0's 16-bit hidden states: its backward's residual gradients (two hidden
    # states of micro-batch 1 in the attention's phase, its larger beside the MLP's 16-bit weight
    # gradients waiting for their casts) are 16-bit, 2 x 16 MiB less than its fp32 pricing; the rest equal.
    parts, as_whole = mixed.stages[1].memory_parts_gib, whole.stages[1].memory_parts_gib
    assert parts["activations"] == pytest.approx(as_whole["activations"] - 2 * 2048 * MODEL.hidden_size * 2 / 2**30)
    assert {k: v for k, v in parts.items() if k != "activations"} == \
        {k: v for k, v in as_whole.items() if k != "activations"}
    assert mixed.stages[0].predicted_peak_memory_gib < whole.stages[0].predicted_peak_memory_gib
    # Stage 1's gradients cross the bridge whole, as its whole pricing sends them; stage 0 sends it
    # 16-bit hidden states (no autocast), as its sharded pricing does.
    def crossing(plan, kind):
        return [(c.bytes_per_step, c.seconds_per_step) for c in plan.crossings if c.kind == kind]
    assert crossing(mixed, "data_parallel") == crossing(whole, "data_parallel") != []
    assert crossing(mixed, "pipeline") == crossing(sharded, "pipeline") != crossing(whole, "pipeline")


def test_a_sharded_stage_behind_whole_ones_keeps_their_wider_hidden_states():
    """Stage 0 (whole, its DP group across vendors) sends fp32 hidden states under autocast; stage 1
    (FSDP2) casts each to 16 bits for its blocks while torch's pipeline stage holds the received
    fp32 one until the micro-batch's backward: one in-flight micro-batch on the last 1F1B stage."""
    cluster = ClusterSpec.from_dict(TWO_VENDORS)
    layout = dict(ONE_STAGE_CROSSES, stage_devices=["a100+mi250", "a100"])
    mixed = evaluate_layout(MODEL, cluster, MEMX_RUN, **layout)
    sharded = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded=True), **layout)
    whole = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded_with_tp=False), **layout)
    assert plan_sharded_stages(MEMX_RUN, mixed) == [1]
    assert mixed.stages[0].memory_parts_gib == whole.stages[0].memory_parts_gib
    kept_input_gib = 1 * 2048 * MODEL.hidden_size * 4 / 2**30  # micro-batch 1, fp32
    parts, as_sharded = mixed.stages[1].memory_parts_gib, sharded.stages[1].memory_parts_gib
    assert parts["pipeline_buffers"] == pytest.approx(as_sharded["pipeline_buffers"] + kept_input_gib)
    assert {k: v for k, v in parts.items() if k != "pipeline_buffers"} == \
        {k: v for k, v in as_sharded.items() if k != "pipeline_buffers"}
    crossing = [c.bytes_per_step for c in mixed.crossings if c.kind == "pipeline"]
    assert crossing == [c.bytes_per_step for c in whole.crossings if c.kind == "pipeline"] != []
    # Interleaved, only stage 1's first chunk receives fp32 inputs: P = 2 of its micro-batches in flight.
    interleaved = dict(layout, schedule="interleaved", virtual_stages=2)
    mixed, sharded = (evaluate_layout(MODEL, cluster, training, **interleaved)
                      for training in (MEMX_RUN, replace(MEMX_RUN, fully_sharded=True)))
    assert mixed.stages[1].memory_parts_gib["pipeline_buffers"] == \
        pytest.approx(sharded.stages[1].memory_parts_gib["pipeline_buffers"] + 2 * kept_input_gib)


@pytest.mark.parametrize("recompute", ["full,full", "full,full:10"])
def test_a_whole_stage_behind_a_sharded_one_keeps_16_bit_block_inputs_under_full_recompute(recompute):
    """Full recompute keeps each layer's input: the 16 bits stage 1 receives from stage 0 (FSDP2),
    not its fp32 pricing's; its norms keep fp32 all the same (CUDA's autocast runs them in fp32)."""
    cluster = ClusterSpec.from_dict(TWO_VENDORS)
    layout = dict(ONE_STAGE_CROSSES, layers_per_stage=[16, 16], recompute=recompute)
    mixed = evaluate_layout(MODEL, cluster, MEMX_RUN, **layout)
    whole = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded_with_tp=False), **layout)
    hidden_gib = 2048 * MODEL.hidden_size / 2**30  # an element of one micro-batch's hidden state, in GiB
    recomputed = 10 if ":" in recompute else 16
    in_flight = 1  # the last of two 1F1B stages
    # block inputs, and the attention phase's two residual gradients (the backward's larger phase, beside
    # the MLP's 16-bit weight gradients waiting for their casts)
    narrower = recomputed * in_flight * 2 * hidden_gib + 2 * 2 * hidden_gib
    parts, as_whole = mixed.stages[1].memory_parts_gib, whole.stages[1].memory_parts_gib
    assert parts["activations"] == pytest.approx(as_whole["activations"] - narrower)
    assert mixed.stages[1].predicted_peak_memory_gib == pytest.approx(sum(parts.values()), abs=0.01)


def test_a_whole_stage_behind_a_sharded_one_sends_16_bit_hidden_states():
    """Under autocast a residual add keeps the received dtype: the whole middle stage keeps and
    passes on stage 0's 16-bit states, and the sharded stage 2 behind it keeps nothing wider."""
    cluster = ClusterSpec.from_dict(dict(TWO_VENDORS, nodes=[
        {"devices": {"a100": 8}, "intra_node_gbps": 300}, {"devices": {"a100": 2}, "intra_node_gbps": 300},
        {"devices": {"mi250": 2}, "intra_node_gbps": 100}]))
    layout = dict(ONE_STAGE_CROSSES, pp=3, stage_devices=["a100", "a100+mi250", "a100"])
    mixed = evaluate_layout(MODEL, cluster, MEMX_RUN, **layout)
    sharded = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded=True), **layout)
    whole = evaluate_layout(MODEL, cluster, replace(MEMX_RUN, fully_sharded_with_tp=False), **layout)
    assert plan_sharded_stages(MEMX_RUN, mixed) == [0, 2]
    assert mixed.stages[2].memory_parts_gib == sharded.stages[2].memory_parts_gib
    # Stage 1 keeps its two in-flight outputs (1F1B, stage 1 of 3) in 16 bits: 2 x 16 MiB less than at fp32.
    parts, as_whole = mixed.stages[1].memory_parts_gib, whole.stages[1].memory_parts_gib
    two_hidden_states_gib = 2 * 2048 * MODEL.hidden_size * 2 / 2**30
    assert parts["pipeline_buffers"] == pytest.approx(as_whole["pipeline_buffers"] - two_hidden_states_gib)
    # and its backward's two residual gradients in the attention's phase in 16 bits: 2 x 16 MiB less
    assert parts["activations"] == pytest.approx(as_whole["activations"] - two_hidden_states_gib)
    assert {k: v for k, v in parts.items() if k not in ("pipeline_buffers", "activations")} == \
        {k: v for k, v in as_whole.items() if k not in ("pipeline_buffers", "activations")}
    def pipeline(plan):
        return [(c.stages, c.bytes_per_step, c.seconds_per_step) for c in plan.crossings if c.kind == "pipeline"]
    assert [stages for stages, _, _ in pipeline(mixed)] == [[0, 1], [1, 2]]
    assert pipeline(mixed) == pipeline(sharded) != pipeline(whole)


def test_one_scorer_keeps_its_evaluator_of_mixed_stages_between_rows():
    """``memx estimate --cases`` asks one scorer row after row: a layout of both kinds of stage is
    scored by one kept evaluator, its rows alike."""
    from memx_launch.planning.estimate import LayoutScorer
    from memx_launch.planning.mixed_sharding import MixedShardingEvaluator

    scorer = LayoutScorer(MODEL, ClusterSpec.from_dict(TWO_VENDORS), MEMX_RUN)
    layout = {k: v for k, v in ONE_STAGE_CROSSES.items() if k != "references"}
    (first, kept), (again, reused) = (scorer.score(**layout) for _ in range(2))
    assert isinstance(kept, MixedShardingEvaluator) and reused is kept
    assert first.T.tolist() == again.T.tolist() and first.memory.tolist() == again.memory.tolist()
    # What it keeps of a layout follows the micro-batch: the reversed layout at 1 and then 2 equals fresh estimates.
    reversed_layout = dict(layout, stage_devices=["a100+mi250", "a100"])
    for mbs in (1, 2):
        row, _ = scorer.score(**dict(reversed_layout, micro_batch_size=mbs))
        fresh = evaluate_layout(MODEL, ClusterSpec.from_dict(TWO_VENDORS), MEMX_RUN,
                                **dict(ONE_STAGE_CROSSES, stage_devices=["a100+mi250", "a100"], micro_batch_size=mbs))
        assert row.memory[0] / 2**30 == pytest.approx([s.predicted_peak_memory_gib for s in fresh.stages], abs=1e-5)


def test_the_runtime_shards_every_stage_it_was_priced_sharded_and_no_other():
    from memx_launch.runtime.layout import stage_runs_fully_sharded

    plans = [evaluate_layout(MODEL, ClusterSpec.from_dict(TWO_VENDORS), MEMX_RUN, **ONE_STAGE_CROSSES),
             _estimate(MEMX_RUN, tp=2, dp=4), _estimate(MEMX_RUN, tp=1, dp=8),
             evaluate_layout(MODEL, A100S, MEMX_RUN, tp=None, stage_tp=[2, 1, 1], pp=3, dp=2, micro_batch_size=1,
                             references=(1.0, 1.0, 1.0))]
    checked = set()
    for plan in plans:
        crossing = [c.stages[0] for c in plan.crossings if c.kind == "data_parallel"]
        priced = set(plan_sharded_stages(MEMX_RUN, plan))
        for i, tp in enumerate(plan.stage_tps):
            runs = stage_runs_fully_sharded(plan, tp, i in crossing)
            assert runs == (i in priced), (plan.stage_tps, crossing, i)
            checked.add((runs, i in crossing))
    assert checked == {(True, False), (False, False), (False, True)}


def test_the_search_prices_a_layout_of_mixed_stages_as_its_estimate_does():
    cluster = ClusterSpec.from_dict(TWO_VENDORS)
    space = SearchSpace(micro_batch_sizes=(1,), recompute_levels=("none", "full"), mixed_stages=True,
                        pipeline_degrees=(2,), tp_degrees=(2,))
    result = search(MODEL, cluster, MEMX_RUN, space=space, top_k=20)
    plans = result.plans + result.pareto
    assert {tuple(plan_sharded_stages(MEMX_RUN, p)) for p in plans} == {(0,), (1,)}  # the A100-only stage
    for plan in plans:
        assert not plan.training["fully_sharded"]
        again = evaluate_layout(MODEL, cluster, MEMX_RUN, tp=2, pp=2, dp=2, micro_batch_size=1,
                                layers_per_stage=[s.num_layers for s in plan.stages],
                                recompute=",".join(s.recompute for s in plan.stages),
                                stage_devices=[s.device_type for s in plan.stages], references=(1.0, 1.0, 1.0))
        assert [s.ranks for s in again.stages] == [s.ranks for s in plan.stages]
        assert [s.predicted_peak_memory_gib for s in again.stages] == \
            pytest.approx([s.predicted_peak_memory_gib for s in plan.stages])
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)


def test_a_learned_cost_model_prices_the_sharded_training_with_its_predictor():
    from tests.test_predictor import CLUSTER, SPEC, TRAINING, synthetic_records
    from memx_launch.profiling.predictor import fit_predictor

    learned = LearnedCostModel(SPEC, CLUSTER, TRAINING, fit_predictor(synthetic_records(), trials=2))
    sharded = replace(TRAINING, fully_sharded=True)
    twin = CachedCostModel(learned).for_training(sharded)
    assert twin.inner.predictor is learned.predictor and twin.training is sharded
    assert twin.inner.analytical.training.fully_sharded and not learned.analytical.training.fully_sharded
    assert layout_training(TRAINING, type("L", (), {"dp": 2, "stage_tp": [2], "group_crossings": ()})) \
        is TRAINING  # fully_sharded_with_tp off: the training as given


def test_memx_estimate_says_a_layout_was_priced_fully_sharded(capsys):
    from memx_launch.cli import main

    base = ["estimate", "--model", "llama2-7b", "--cluster", os.path.join(EXAMPLES, "table1-2vendor.yaml"),
            "--setup", "memx-run", "--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "32", "--seq-len", "2048"]
    assert main([*base, "--tp", "2", "--dp", "4"]) == 0
    assert "priced fully sharded: TP > 1 with DP > 1 runs FSDP2" in capsys.readouterr().out
    assert main([*base, "--tp", "1", "--dp", "8"]) in (0, 3)  # DDP: no such line
    assert "priced fully sharded" not in capsys.readouterr().out


def test_memx_estimate_names_the_stages_it_priced_fully_sharded(tmp_path, capsys):
    import yaml

    from memx_launch.cli import main

    path = tmp_path / "two-vendors.yaml"
    path.write_text(yaml.safe_dump(TWO_VENDORS))
    assert main(["estimate", "--model", "llama2-7b", "--cluster", str(path), "--setup", "memx-run", "--tp", "2",
                 "--pp", "2", "--dp", "2", "--micro-batch-size", "1", "--global-batch-size", "32", "--seq-len", "2048",
                 "--stage-devices", "a100,a100+mi250"]) == 0
    assert "stage 0 priced fully sharded: TP > 1 with DP > 1 runs FSDP2" in capsys.readouterr().out


def test_memx_runs_search_keeps_only_layouts_whose_tied_ends_it_shards_alike(tmp_path, capsys):
    from memx_launch.cli import main
    from memx_launch.errors import ConfigError

    cluster, tied = ClusterSpec.from_dict(TWO_VENDORS), replace(MODEL, tie_embeddings=True)
    space = dict(micro_batch_sizes=(1,), recompute_levels=("none", "full"), mixed_stages=True, tp_degrees=(2,))
    # At PP 2 every layout shards one end only (the untied search above ranks such plans).
    with pytest.raises(ConfigError, match="--mixed-stages: every layout has one end of the tied embeddings"):
        search(tied, cluster, MEMX_RUN, space=SearchSpace(pipeline_degrees=(2,), **space))
    result = search(tied, cluster, MEMX_RUN, space=SearchSpace(pipeline_degrees=(2, 4), **space), top_k=20)
    plans = result.plans + result.pareto
    assert plans and all((0 in plan_sharded_stages(MEMX_RUN, p)) == (p.pp - 1 in plan_sharded_stages(MEMX_RUN, p))
                         for p in plans)
    # memx estimate prices such a layout and says memx-run would not run it.
    path = tmp_path / "two-vendors.yaml"
    path.write_text(yaml.safe_dump(TWO_VENDORS))
    args = ["estimate", "--cluster", str(path), "--setup", "memx-run", "--tp", "2", "--pp", "2", "--dp", "2",
            "--micro-batch-size", "1", "--global-batch-size", "32", "--seq-len", "2048",
            "--stage-devices", "a100,a100+mi250"]
    for model, refused in (("opt-350m", True), ("llama2-7b", False)):
        main([*args, "--model", model])
        assert ("memx-run refuses this layout" in capsys.readouterr().out) == refused, model
