"""A mixture of experts whose dense blocks sit between its expert ones (``moe_layer_step``: Llama 4
Maverick, Qwen's ``decoder_sparse_step``): read from Hugging Face configs, the parameters as
published, each stage's blocks counted where the split and the export put them, the search and
the Megatron export. No processes."""

import dataclasses
import re

import numpy as np
import pytest
from one_node import H100, one_node
from test_model_families import SCOUT, SMALL as SMALL_CONFIG, _active

from memx_launch.errors import ConfigError
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args, pipeline_layout
from memx_launch.planning.extra_blocks import interleaved_dense_counts
from memx_launch.planning.model_states import rank_layer_params
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

GIB = 2**30
MAVERICK = {**SCOUT, "text_config": {**SCOUT["text_config"], "num_local_experts": 128, "interleave_moe_layer_step": 2,
                                     "use_qk_norm": False}}
# Maverick's kinds of blocks at a size a test plans in a moment: dense MLPs twice an expert's width.
SMALL = ModelSpec("maverick-small", 8, 512, 8, 2, 2048, 32000, 2048, num_experts=8, experts_per_token=1,
                  expert_ffn_hidden_size=1024, shared_expert_ffn_hidden_size=1024, moe_layer_step=2)
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))


def _estimate(model, layers, **layout):
    training = TrainingSpec(global_batch_size=32, seq_len=2048, setup="megatron", expert_parallel=2)
    return evaluate_layout(model, NODE, training, references=(1, 1, 1),
                           **{"tp": 1, "pp": len(layers), "dp": 8 // len(layers), "micro_batch_size": 1,
                              "recompute": "none", "layers_per_stage": layers, **layout})


def _exported_dense_blocks(plan) -> list[int]:
    """Dense blocks of each stage, read off the export: its layout string's chunks in model order
    (chunk k on stage k mod P) and its --moe-layer-freq pattern, as Megatron-Core evaluates it."""
    args = megatron_args(plan).args
    pattern = eval(args[args.index("--moe-layer-freq") + 1], {"__builtins__": {}})  # as Megatron-LM does
    sizes = [sum(int(n or 1) for n in re.findall(r"t(?:\*(\d+))?", chunk)) for chunk in pipeline_layout(plan).split("|")]
    dense, start = [0] * plan.pp, 0
    for k, size in enumerate(sizes):
        dense[k % plan.pp] += pattern[start:start + size].count(0)
        start += size
    return dense


def test_maverick_is_read_from_its_config_with_its_published_parameters():
    maverick = model_from_hf_dict(MAVERICK, "llama4-maverick")
    assert dataclasses.replace(maverick, seq_len=8192, tensor_parallel_blocks=True) == get_model("llama4-maverick")
    assert (maverick.moe_layer_step, maverick.dense_block_count) == (2, 24)
    assert (maverick.ffn_hidden_size, maverick.moe_ffn_hidden_size) == (16384, 8192)
    # Published: 400B, 17B active (the vision encoder, not planned, is under 1B).
    assert maverick.total_params == pytest.approx(400e9, rel=0.005)
    dense = maverick.dense_block
    active = (_active(maverick) + _active(dense)) / 2  # half its blocks of each kind
    assert active == pytest.approx(17e9, rel=0.02)
    # Llama 4's own list of its expert blocks, where the config gives it, must be the step's.
    text = MAVERICK["text_config"]
    assert model_from_hf_dict({**text, "moe_layers": list(range(1, 48, 2))}, "llama4-maverick") == maverick
    # Qwen2-MoE's decoder_sparse_step counts the same way.
    qwen = model_from_hf_dict({**SMALL_CONFIG, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 128, "decoder_sparse_step": 2}, "q")
    assert (qwen.moe_layer_step, qwen.dense_block_count, qwen.ffn_hidden_size) == (2, 4, 512)


@pytest.mark.parametrize("extra", [{"moe_layers": [0, 2, 4]}, {"mlp_only_layers": [0, 3]}, {"moe_layer_freq": 2}])
def test_dense_blocks_elsewhere_are_refused_by_name(extra):
    config = {**SMALL_CONFIG, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, **extra}
    with pytest.raises(ConfigError, match="dense MLP blocks among the expert ones at places memx does not model"):
        model_from_hf_dict(config, "m")


def test_a_malformed_list_or_both_kinds_of_dense_blocks_are_refused():
    with pytest.raises(ConfigError, match=r"model \(config\)\.moe_layers: must be a list of block indices, got 2"):
        model_from_hf_dict({**SMALL_CONFIG, "num_local_experts": 4, "num_experts_per_tok": 1, "moe_layers": 2}, "m")
    with pytest.raises(ConfigError, match="model.moe_layer_step: set beside dense_layers"):
        dataclasses.replace(SMALL, dense_layers=1)


@pytest.mark.parametrize("seed", range(12))
def test_each_stage_s_dense_blocks_are_those_the_export_gives_it(seed):
    rng = np.random.default_rng(seed)
    step = int(rng.integers(2, 5))
    model = dataclasses.replace(SMALL, num_layers=24, moe_layer_step=step)
    pp = int(rng.choice([2, 4]))
    v = int(rng.integers(1, 4))
    layers = rng.multinomial(24 - pp * v, np.ones(pp) / pp) + v  # every chunk a block at least
    schedule = {"schedule": "interleaved", "virtual_stages": v} if v > 1 else {}
    plan = _estimate(model, layers.tolist(), **schedule)
    assert interleaved_dense_counts(model, layers, v).tolist() == _exported_dense_blocks(plan)


def test_a_stage_holds_the_parameters_of_the_blocks_it_is_given():
    even, uneven = _estimate(SMALL, [4, 4]), _estimate(SMALL, [3, 5])
    dense, expert = (sum(rank_layer_params(m, TrainingSpec(expert_parallel=2), 1)) for m in (SMALL.dense_block, SMALL))
    # Blocks 1, 3, 5 and 7 run the experts: blocks 0-3 and 4-7 hold two of each kind; blocks 0-2
    # two dense and one expert block, 3-7 two dense and three expert blocks. bf16 weights:
    first, last = (even.stages[i].memory_parts_gib["parameters"] for i in (0, 1))
    assert first - last == pytest.approx(2 * SMALL.embedding_params / GIB - 2 * SMALL.head_params / GIB)
    assert uneven.stages[0].memory_parts_gib["parameters"] == pytest.approx(first - 2 * expert / GIB)
    assert uneven.stages[1].memory_parts_gib["parameters"] == pytest.approx(last + 2 * expert / GIB)
    assert expert > 2 * dense  # eight experts over two ranks, each half a dense MLP
    for plan in (even, uneven):
        for stage in plan.stages:
            assert sum(stage.memory_parts_gib.values()) == pytest.approx(stage.predicted_peak_memory_gib, abs=1e-5)
    # An expert block is slower than a dense one here (its router and all-to-alls): the stage of
    # three expert blocks beside the one of a single one.
    assert uneven.stages[1].predicted_stage_time_s > even.stages[1].predicted_stage_time_s


def test_the_search_s_plans_are_what_estimate_predicts_and_the_export_builds_them():
    from test_exporters import _megatron_config

    from memx_launch.planning.estimate import evaluate_plan

    training = TrainingSpec(global_batch_size=32, seq_len=2048, setup="megatron", expert_parallel=2)
    plans = search(SMALL, NODE, training, top_k=5,
                   space=SearchSpace(micro_batch_sizes=(1, 2), pipeline_degrees=(2, 4))).plans
    assert any(plan.pp > 1 for plan in plans)
    # The split is weighed at the blocks' mean, then every plan is scored where its blocks are.
    for plan in plans:
        again = evaluate_plan(plan, NODE, training)
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
        assert [s.predicted_peak_memory_gib for s in again.stages] == pytest.approx(
            [s.predicted_peak_memory_gib for s in plan.stages])
    plan = _estimate(SMALL, [4, 4])
    config = _megatron_config(plan, megatron_args(plan).args)
    assert config.moe_layer_freq == [0, 1] * 4 and config.ffn_hidden_size == 2048
    assert config.moe_ffn_hidden_size == 1024


def test_a_stage_that_recomputes_some_of_its_blocks_is_scored_on_its_own_blocks():
    # 6 GiB devices: the search fully recomputes the first blocks of the fullest stage only
    # (Megatron's block method), the path that prices every stage's blocks at no recompute too.
    from memx_launch.planning.estimate import evaluate_plan

    small = ClusterSpec.from_dict(one_node({**H100, "memory_gib": 6}, 8, 450))
    model = dataclasses.replace(SMALL, num_layers=16, hidden_size=1024, num_heads=16, num_kv_heads=4,
                                ffn_hidden_size=4096, expert_ffn_hidden_size=2048, shared_expert_ffn_hidden_size=2048)
    training = TrainingSpec(global_batch_size=32, seq_len=4096, setup="megatron", expert_parallel=2,
                            host_ms_per_layer=0.01)  # device bound, as at a real size
    plans = search(model, small, training, top_k=5,
                   space=SearchSpace(micro_batch_sizes=(1, 2), pipeline_degrees=(2, 4))).plans
    partial = [p for p in plans if any(s.recompute.startswith("full:") for s in p.stages)]
    assert partial
    for plan in partial:
        again = evaluate_plan(plan, small, training)
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
        assert [s.predicted_peak_memory_gib for s in again.stages] == pytest.approx(
            [s.predicted_peak_memory_gib for s in plan.stages])
        assert all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in plan.stages)
