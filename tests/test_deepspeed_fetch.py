"""DeepSpeed ZeRO-3's weight fetches as memx prices them (``max_live_params``, ``--setup zero3``),
held to DeepSpeed's own coordinator traced on CPU (``benchmarks/deepspeed_zero3_fetch.py`` ->
``benchmarks/results/deepspeed_zero3_fetch.json``): one all-gather per linear module a pass, at
most the live budget gathered, with the linear whose fetch crosses it, and the gradients
reduce-scattered a bucket at a time; a model within the budget gathered whole, in the forward
only, a prefetch bucket at a time; every micro-batch fetching again."""

import json
import os

import numpy as np
import pytest

from memx_launch.planning.collectives import collective_seconds
from memx_launch.planning.data_parallel import bucketed_block_seconds, deepspeed_fetches, fully_sharded_exposed_time
from memx_launch.planning.matmuls import linear_module_params
from memx_launch.planning.model_states import fully_sharded_working_parts
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

RESULT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "deepspeed_zero3_fetch.json")
with open(RESULT) as f:
    TRACE = json.load(f)
TRACED = TRACE["model"]
BLOCK = TRACED["block_params"]
# The budgets under which DeepSpeed releases and fetches again (the model outgrows them).
BINDING = ("llama2_7b_defaults", "llama2_70b_defaults", "huggingface_auto")
# Those the model fits, which keep it gathered from the forward to the backward.
UNDER_BUDGET = ("model_under_budget", "under_budget_huggingface_auto", "under_budget_small_blocks")


def collectives_counted(sizes, counts):
    """A ``price`` for :func:`bucketed_block_seconds` that counts the collectives instead."""
    return sum(count * (np.asarray(size) > 0) for size, count in zip(sizes, counts))


def linear_gathers(linears, bytes_per_param=2.0, ranks=64, nodes=8, gbps=25.0) -> float:
    """Seconds of one all-gather per linear module's parameters, each on its own."""
    return sum(float(collective_seconds("all_gather", bytes_per_param * p, ranks, gbps, nodes)) for p in linears)


def traced_model(layers: int) -> ModelSpec:
    return ModelSpec("traced", layers, TRACED["hidden"], TRACED["heads"], TRACED["heads"], TRACED["ffn"],
                     TRACED["vocab"], TRACED["seq"])


def test_zero3_counts_the_traced_models_linear_modules_as_hugging_face_builds_them():
    modules = linear_module_params(traced_model(24), TrainingSpec(setup="zero3"), 1)
    assert modules == pytest.approx(list(TRACED["linear_modules"].values()))
    assert len(linear_module_params(traced_model(24), TrainingSpec(setup="megatron"), 1)) == 4  # fused QKV, gate-up


@pytest.mark.parametrize("budget", BINDING)
def test_each_linear_module_is_one_all_gather_a_pass_whatever_the_prefetch_bucket(budget):
    per_block = TRACE["budgets"][budget]["per_block"]
    modules = len(linear_module_params(traced_model(24), TrainingSpec(setup="zero3"), 1))
    assert per_block["forward allgather_base"] == per_block["backward allgather_base"] == modules


@pytest.mark.parametrize("budget", BINDING)
def test_gathered_weights_are_the_live_budget_and_the_linear_that_crosses_it(budget):
    traced = TRACE["budgets"][budget]
    live_blocks = traced["blocks_of_prefetch_bucket_live_reuse_reduce_bucket"][1]
    training = TrainingSpec(setup="zero3", max_live_params=live_blocks * BLOCK)
    gathered, _ = fully_sharded_working_parts(traced_model(24), training, 1, 2)
    predicted = float(gathered) / training.dtype_bytes / BLOCK
    assert predicted == pytest.approx(traced["peak_gathered_blocks"]["24"], rel=0.08)


@pytest.mark.parametrize("budget", [*BINDING, "model_under_budget"])
def test_gradients_are_reduce_scattered_a_bucket_at_a_time_as_traced(budget):
    traced = TRACE["budgets"][budget]
    bucket = traced["blocks_of_prefetch_bucket_live_reuse_reduce_bucket"][3] * BLOCK
    gradients = deepspeed_fetches(traced_model(24), TrainingSpec(setup="zero3"), 1).gradients
    assert sum(gradients) == pytest.approx(BLOCK)
    flushes = float(bucketed_block_seconds(gradients, bucket, collectives_counted))
    # A bucket spans blocks where it holds more than one: the trace's 5 or 11 over 12 or 24 blocks.
    assert flushes == pytest.approx(traced["per_block"]["backward reduce_scatter_base"], rel=0.04)


@pytest.mark.parametrize("budget", UNDER_BUDGET)
def test_a_model_under_the_live_budget_is_gathered_a_prefetch_bucket_at_a_time(budget):
    traced = TRACE["budgets"][budget]
    bucket = traced["blocks_of_prefetch_bucket_live_reuse_reduce_bucket"][0] * BLOCK
    forward = deepspeed_fetches(traced_model(24), TrainingSpec(setup="zero3"), 1).gradients[::-1]
    gathers = float(bucketed_block_seconds(forward, bucket, collectives_counted, fill_past=True))
    # Under one linear a bucket: each linear its own (7); four blocks a bucket: a quarter a block.
    assert gathers == pytest.approx(traced["per_block"]["forward allgather_base"], rel=0.08)
    assert "backward allgather_base" not in traced["per_block"]


@pytest.mark.parametrize("budget", ["llama2_7b_defaults", "model_under_budget"])
def test_each_micro_batch_fetches_and_reduces_again_whether_or_not_the_model_fits_the_budget(budget):
    one, two = TRACE["budgets"][budget], TRACE["budgets"][f"{budget}_two_micro_batches"]
    assert two["micro_batches_a_step"] == 2
    assert two["per_block"] == {key: 2 * count for key, count in one["per_block"].items()}
    # So memx adds a stage's fetches to each micro-batch's time, within the budget too, and nothing once a step.
    from types import SimpleNamespace

    from memx_launch.planning.collectives import NVLINK
    from memx_launch.planning.data_parallel import stage_gradient_sync

    model = traced_model(24)
    live = one["blocks_of_prefetch_bucket_live_reuse_reduce_bucket"][1] * BLOCK
    training = TrainingSpec(setup="zero3", max_live_params=live)
    layout = SimpleNamespace(tp_degrees=np.array([1.0]), dp_cp=np.array([64.0]), dp_nodes=np.array([8.0]),
                             dp_hop=np.array([NVLINK]), pp=1)
    stage = np.array([24 * model.layer_params + 2 * TRACED["vocab"] * TRACED["hidden"]])
    per_microbatch, once_a_step = stage_gradient_sync(model, training, layout, np.array([24.0]), 1, stage,
                                                      np.array([0.0]), 25.0, 0.0)
    assert once_a_step.tolist() == [0.0]
    exposed = fully_sharded_exposed_time(stage, model.layer_params, 24, 0.0, training, 64, 25.0, 8,
                                         fetches=deepspeed_fetches(model, training, 1, stage))
    assert per_microbatch.tolist() == pytest.approx(exposed.tolist()) and exposed.tolist()[0] > 0


def test_a_model_under_the_live_budget_stays_gathered_whole():
    traced = TRACE["budgets"]["model_under_budget"]
    # Kept from the forward to the backward: fetched in the forward only, where a model over its
    # budget fetches in both.
    passes = {name: 1 + ("backward allgather_base" in budget["last_step"]["24"])
              for name, budget in TRACE["budgets"].items()}
    model = traced_model(24)
    stage = 24 * model.layer_params + 2 * TRACED["vocab"] * TRACED["hidden"] + TRACED["hidden"]
    for name, budget in TRACE["budgets"].items():
        live = budget["blocks_of_prefetch_bucket_live_reuse_reduce_bucket"][1] * BLOCK
        fetched = deepspeed_fetches(model, TrainingSpec(setup="zero3", max_live_params=live), 1, stage).passes
        assert float(fetched) == passes[name]
    assert passes["model_under_budget"] == 1
    # Priced so: with nothing to hide them, one pass of all-gathers fewer.
    training = TrainingSpec(setup="zero3")
    args = (stage, model.layer_params, 24, 0.0, training, 64, 25.0, 8)
    kept, refetched = (float(fully_sharded_exposed_time(*args, fetches=deepspeed_fetches(model, training, 1, params)))
                       for params in (stage, np.inf))
    per_linear = linear_gathers(linear_module_params(model, training, 1))

    def all_gathers(sizes, counts):
        return sum(count * collective_seconds("all_gather", 2.0 * np.asarray(size), 64, 25.0, 8)
                   for size, count in zip(sizes, counts))
    forward = deepspeed_fetches(model, training, 1).gradients[::-1]
    bucket = min(training.prefetch_bucket_params, stage)  # a stage smaller than the bucket: one all-gather
    prefetched = float(bucketed_block_seconds(forward, bucket, all_gathers, fill_past=True))
    assert 0 < prefetched < per_linear  # fewer, larger all-gathers
    # Every block's, the first block's exposed ones again, and the embedding and head's, gathered once fewer.
    rest = float(collective_seconds("all_gather", 2.0 * (stage - 24 * model.layer_params), 64, 25.0, 8))
    assert refetched - kept == pytest.approx(24 * (2 * per_linear - prefetched) + per_linear - prefetched + rest)
    training = TrainingSpec(setup="zero3", max_live_params=50 * BLOCK)
    gathered, _ = fully_sharded_working_parts(traced_model(24), training, 1, 2)
    blocks = float(gathered) / training.dtype_bytes / BLOCK
    assert blocks == pytest.approx(24)  # the blocks; the trace's peak adds the embedding and head
    assert traced["peak_gathered_blocks"]["24"] == pytest.approx(blocks, rel=0.05)


def test_fsdp_units_gather_two_blocks_where_deepspeed_holds_its_budget():
    fsdp = TrainingSpec(setup="zero3", max_live_params=0.0)
    gathered, _ = fully_sharded_working_parts(traced_model(24), fsdp, 1, 2)
    assert float(gathered) / fsdp.dtype_bytes == pytest.approx(2 * traced_model(24).layer_params)


def test_zero_plus_plus_hpz_gathers_the_backward_from_a_second_shard_within_a_node():
    traced = TRACE["budgets"]["llama2_7b_defaults_hpz_2_of_4"]
    assert (traced["ranks"], traced["hpz_partition_size"]) == (4, 2)
    modules = len(TRACED["linear_modules"])
    # The forward over every rank, the backward over the shard's two, one linear a gather each
    # (and one gather over two a step, whatever the blocks).
    assert {key: n for key, n in traced["per_block_by_ranks"].items() if n} == {
        "forward allgather_base over 4": modules, "backward allgather_base over 2": modules}
    model, dp, gbps, nodes = traced_model(24), 64, 25.0, 8
    stage = 24 * model.layer_params
    linears = linear_module_params(model, TrainingSpec(setup="zero3"), 1)

    def exposed(hpz):
        training = TrainingSpec(setup="zero3", hpz_partition_size=hpz)
        return float(fully_sharded_exposed_time(stage, model.layer_params, 24, 0.0, training, dp, gbps, nodes,
                                                fetches=deepspeed_fetches(model, training, 1)))

    # A node's eight ranks over NVLink where the backward gathered over the 64 of eight nodes.
    assert exposed(8) - exposed(1) == pytest.approx(24 * (linear_gathers(linears, 2.0, 8, 1) - linear_gathers(linears)))
    assert exposed(8) < exposed(1)
    # Its memory: the second shard, the stage over hpZ's ranks (the trace's holds the embedding and head too).
    shard = TrainingSpec(setup="zero3", hpz_partition_size=2)
    with_shard, without = (float(fully_sharded_working_parts(model, t, 1, 4)[0]) / shard.dtype_bytes / BLOCK
                           for t in (shard, TrainingSpec(setup="zero3")))
    assert with_shard - without == pytest.approx(12.0)
    assert traced["second_shard_blocks"]["24"] == pytest.approx(with_shard - without, rel=0.05)


def test_zero_plus_plus_qwz_fetches_int8_weights_then_their_scales_two_collectives_each():
    """``partition_parameters.py``: a quantized fetch all-gathers the int8 weights, then their fp32
    scales (one per group of up to 8,000); nothing on CPU builds its quantizer, so this is read,
    not traced."""
    from memx_launch.planning.data_parallel import QWZ_SCALE_BYTES

    model, dp, gbps, nodes = traced_model(24), 64, 25.0, 8
    linears = linear_module_params(model, TrainingSpec(setup="zero3"), 1)

    def exposed(**zero_plus_plus):
        training = TrainingSpec(setup="zero3", **zero_plus_plus)
        return float(fully_sharded_exposed_time(24 * model.layer_params, model.layer_params, 24, 0.0, training, dp,
                                                gbps, nodes, fetches=deepspeed_fetches(model, training, 1)))

    def quantized_over_bf16(ranks=dp, spanned=nodes):
        return sum(linear_gathers(linears, b, ranks, spanned) for b in (1.0, QWZ_SCALE_BYTES)) \
            - linear_gathers(linears, 2.0, ranks, spanned)
    # Both passes' gathers of 24 blocks and the first block's exposed again: int8 and scales where bf16 was.
    assert exposed(quantized_weights=True) - exposed() == pytest.approx(49 * quantized_over_bf16())
    # Latency-bound at this size: two collectives of half the bytes cost more than one.
    assert quantized_over_bf16() > 0
    # With hpZ the backward's pair spans the second shard's ranks.
    both, hpz_only = exposed(quantized_weights=True, hpz_partition_size=8), exposed(hpz_partition_size=8)
    assert both - hpz_only == pytest.approx(25 * quantized_over_bf16() + 24 * quantized_over_bf16(8, 1))


@pytest.mark.parametrize("field, value, flag", [("prefetch_bucket_params", 0, "--prefetch-bucket-params"),
                                                ("reduce_bucket_params", -5e8, "--reduce-bucket-params"),
                                                ("hpz_partition_size", 0, "--hpz-partition-size"),
                                                ("hpz_partition_size", 2.5, "--hpz-partition-size")])
def test_deepspeed_options_out_of_range_name_their_flag(field, value, flag):
    from memx_launch.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{flag}: "):
        TrainingSpec(setup="zero3", **{field: value})


def test_routed_experts_are_one_all_gather_a_layer_as_deepspeeds_leaf_expert_blocks():
    """DeepSpeed 0.19.8 makes Hugging Face's Mixtral and Qwen MoE blocks ZeRO-3 leaf modules by
    default (``DEFAULT_LEAF_MODULE_CLASSES``): one fetch gathers every expert, so memx prices a
    layer's routed experts as one all-gather a pass and one reduce-scatter, where its attention's
    linears are one each."""
    from memx_launch.specs.catalog import get_model

    model, training = get_model("mixtral-8x7b"), TrainingSpec(setup="zero3")
    dense, experts = model.layer_params - model.expert_params, model.expert_params
    fetches = deepspeed_fetches(model, training, 1)
    layers, dp, gbps, nodes = model.num_layers, 64, 25.0, 8

    def exposed(layer, expert):
        return float(fully_sharded_exposed_time(layers * layer, layer, layers, 0.0, training, dp, gbps, nodes,
                                                expert_params=expert, expert_dp=dp, fetches=fetches))
    gather, reduce_scatter = (float(collective_seconds(op, 2.0 * experts, dp, gbps, nodes))
                              for op in ("all_gather", "reduce_scatter"))
    # Both passes' gathers and the reduce-scatter each layer, and the first layer's gather exposed.
    assert exposed(dense + experts, experts) - exposed(dense, 0.0) == pytest.approx(
        layers * (2 * gather + reduce_scatter) + gather)
    assert len(fetches.linears) == 4  # the attention's q, k, v and o: the MLP is the experts'


def test_per_linear_gathers_pay_a_latency_each_and_more_of_it_on_larger_rings():
    model, training = ModelSpec("llama-7b-like", 32, 4096, 32, 32, 11008, 32000, 4096), TrainingSpec(setup="zero3")
    fetches = deepspeed_fetches(model, training, 1)
    layer = model.layer_params
    args = (32 * layer, layer, 32, 0.0, training)  # no compute to hide behind: every collective shows

    def extra(ranks, nodes):
        split = float(fully_sharded_exposed_time(*args, ranks, 25.0, nodes, fetches=fetches))
        whole = float(fully_sharded_exposed_time(*args, ranks, 25.0, nodes))
        return split - whole

    small, large = extra(64, 8), extra(1024, 128)
    assert 0 < small < large
    # At least six more all-gathers' latency per layer and pass than one gather of the layer.
    one_step = float(collective_seconds("all_gather", 1.0, 1024, 25.0, 128))
    assert large > 32 * 2 * 6 * one_step


def test_deepspeed_export_writes_the_live_budget_the_plan_counted_and_notes_fsdp_units():
    from memx_launch.planning.config_exports import deepspeed_json
    from tests.test_exporters import make_plan

    plan = make_plan(layers=(32,), recompute=("none",), devices=("vendor-x-32gb",), dp=8, mbs=2, gbs=64)
    plan.training = TrainingSpec(setup="zero3").plan_fields()
    config = deepspeed_json(plan)
    zero = json.loads(config.text)["zero_optimization"]
    assert zero == {"stage": 3, "stage3_max_live_parameters": 1_000_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                    "reduce_bucket_size": 500_000_000}
    auto = dict(reduce_bucket_params=4096**2, prefetch_bucket_params=15099494)  # Hugging Face's for hidden 4,096
    plan.training = TrainingSpec(setup="zero3", hpz_partition_size=8, quantized_weights=True, **auto).plan_fields()
    zero = json.loads(deepspeed_json(plan).text)["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (4096**2, 15099494)
    assert zero["zero_hpz_partition_size"] == 8 and zero["zero_quantized_weights"] is True
    assert not any("per block" in n for n in config.notes)
    plan.training = TrainingSpec(setup="zero3", max_live_params=0.0).plan_fields()
    config = deepspeed_json(plan)
    assert "stage3_max_live_parameters" not in json.loads(config.text)["zero_optimization"]
    assert any("one all-gather per block" in n and "--setup zero3" in n for n in config.notes)


def test_deepspeed_export_refuses_a_pipeline_of_fully_sharded_stages():
    """DeepSpeed's pipeline engine asserts ZeRO below stage 2 (``runtime/pipe/engine.py``)."""
    from memx_launch.errors import ConfigError
    from memx_launch.planning.config_exports import deepspeed_json
    from tests.test_exporters import make_plan

    plan = make_plan(layers=(16, 16), recompute=("none", "none"), devices=("vendor-x-32gb",) * 2, dp=4)
    plan.training = TrainingSpec(setup="zero3").plan_fields()
    with pytest.raises(ConfigError, match="pipeline engine refuses ZeRO-2 and 3"):
        deepspeed_json(plan)
    plan.training = TrainingSpec(setup="zero1").plan_fields()
    with pytest.raises(ConfigError, match="holds data parallelism only"):  # ZeRO-1 pipelines, in code
        deepspeed_json(plan)


def test_a_search_over_stages_of_different_tp_prices_each_stages_linear_gathers_and_says_deepspeed_cannot_run_them():
    """The per-linear gathers broadcast over a search's stages (TP per stage, two device types, so no
    one-stage layout), and its fastest plan is no faster than FSDP's units' (more gathers, more host
    time, and for LLaMA-2 7B more weights gathered, so no layout fits that did not). ``memx plan``
    says under such a winner that DeepSpeed's pipeline engine refuses ZeRO-3; FSDP's units, which
    torch pipelines, get no such note."""
    from memx_launch.planning.report import plan_report
    from memx_launch.planning.search import search
    from memx_launch.specs.catalog import get_model
    from memx_launch.specs.cluster import ClusterSpec

    cluster = ClusterSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                                                 "table1-2vendor.yaml"))
    model = get_model("llama2-7b")
    deepspeed, fsdp = (search(model, cluster, TrainingSpec(global_batch_size=64, seq_len=4096, setup="zero3",
                                                           max_live_params=live), top_k=1) for live in (1e9, 0.0))
    assert deepspeed.fastest.predicted_iteration_time_s >= fsdp.fastest.predicted_iteration_time_s
    assert deepspeed.best.pp > 1 and fsdp.best.pp > 1
    assert "pipeline engine refuses ZeRO-3" in plan_report(deepspeed, cluster)
    assert "pipeline engine refuses ZeRO-3" not in plan_report(fsdp, cluster)


def test_memx_plan_says_deepspeed_does_not_run_zero3_with_the_experts_split():
    """DeepSpeed's engine asserts no MoE layer under ZeRO-3 (its export refuses such a plan): a
    searched winner with expert parallelism says so; one that keeps every expert whole does not."""
    from memx_launch.planning.report import plan_report
    from memx_launch.planning.search import search
    from memx_launch.planning.search_space import SearchSpace
    from memx_launch.specs.catalog import get_model
    from memx_launch.specs.cluster import ClusterSpec

    a100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039,
            "compute_capability": 8.0}
    cluster = ClusterSpec.from_dict({"version": 1, "name": "two-dgx", "inter_node_gbps": 25, "device_types": {"a100": a100},
                                     "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300, "nics": 8}] * 2})
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="zero3")
    space = dict(pipeline_degrees=(1,), micro_batch_sizes=(1,), recompute_levels=("full",))
    split, whole = (search(get_model("mixtral-8x7b"), cluster, training, top_k=1,
                           space=SearchSpace(**space, expert_degrees=degrees)) for degrees in ((2,), (1,)))
    assert split.best.training["expert_parallel"] == 2
    assert "DeepSpeed's MoE layers refuse ZeRO-3" in plan_report(split, cluster)
    assert "DeepSpeed's MoE layers refuse ZeRO-3" not in plan_report(whole, cluster)
