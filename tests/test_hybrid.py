"""Hybrid models (Nemotron-H): Mamba-2, attention and MLP layers in Megatron's pattern, read from
Hugging Face's config with their published parameters, each kind priced for its own parts, the
checks memx makes of them, the search, and the Megatron export. No processes."""

import dataclasses

import numpy as np
import pytest
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.models.llama import TransformerBlock
from memx_launch.planning import costmodel as cm
from memx_launch.planning.config_exports import torchtitan_toml
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.matmuls import linear_shapes
from memx_launch.planning.runtime_support import runnable_model
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.specs.catalog import NEMOTRON_H_56B_PATTERN, get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

# Nemotron-H 56B's config.json, its keys as Hugging Face's NemotronHConfig names them.
NEMOTRON_H_56B = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "num_hidden_layers": 118,
                  "hidden_size": 8192, "intermediate_size": 32768, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 8192,
                  "hybrid_override_pattern": NEMOTRON_H_56B_PATTERN, "mamba_num_heads": 256, "mamba_head_dim": 64,
                  "ssm_state_size": 256, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
                  "mlp_hidden_act": "relu2", "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5}
# Each kind of layer, at a size a test plans in a moment (TP up to 2: two Mamba groups).
SMALL = ModelSpec("hybrid-small", 8, 512, 8, 2, 2048, 32000, 2048, gated_mlp=False, hybrid_pattern="M-M*M-M-",
                  mamba_heads=16, mamba_head_dim=64, mamba_state_size=64, mamba_groups=2, mamba_chunk_size=128)
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))
TRAINING = TrainingSpec(global_batch_size=32, seq_len=2048, setup="megatron")


def _estimate(model=SMALL, training=TRAINING, **layout):
    return evaluate_layout(model, NODE, training, references=(1, 1, 1),
                           **{"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "recompute": "none", **layout})


def test_nemotron_h_is_read_from_its_config_with_its_published_parameters():
    model = model_from_hf_dict(NEMOTRON_H_56B, "nemotron-h-56b")
    assert dataclasses.replace(model, tensor_parallel_blocks=True) == get_model("nemotron-h-56b")
    assert {kind.layer_kind: n for kind, n in model.layer_kinds} == {"mamba": 54, "attention": 10, "mlp": 54}
    assert not model.gated_mlp  # squared ReLU: two matrices
    assert model.total_params == pytest.approx(56e9, rel=0.01)  # "Nemotron-H-56B"


def test_a_mamba_layer_holds_megatrons_parameters_and_each_kind_only_its_own():
    mamba, attention, mlp = (kind for kind, _ in get_model("nemotron-h-56b").layer_kinds)
    h, inner, conv = 8192, 256 * 64, 256 * 64 + 2 * 8 * 256
    # in_proj to z, x, B, C and dt; conv1d weight and bias; A_log, D, dt_bias; gated norm; out_proj; pre-norm.
    assert mamba.layer_params == h * (2 * inner + 2 * 8 * 256 + 256) + conv * 5 + 3 * 256 + inner + inner * h + h
    assert attention.layer_params == h * (8192 + 2 * 1024) + 8192 * h + h
    assert mlp.layer_params == 2 * h * 32768 + h
    assert [len(linear_shapes(kind, TRAINING, 1)) for kind in (mamba, attention, mlp)] == [2, 2, 2]
    assert (attention.active_ffn_hidden_size, mlp.q_hidden_size, mamba.kv_hidden_size) == (0, 0, 0)


@pytest.mark.parametrize("change, field", [
    ({"hybrid_pattern": "M-M*M-ME"}, "model.num_experts"),      # expert layers without experts
    ({"hybrid_pattern": "M-M*M-M"}, "model.hybrid_pattern"),    # a character short
    ({"hybrid_pattern": "M-M*M-MX"}, "model.hybrid_pattern"),
    ({"num_experts": 8, "experts_per_token": 2}, "model.num_experts"),
    ({"sliding_window": 512}, "model.sliding_window"),
    ({"mamba_heads": 15}, "model.mamba_heads"),                 # not a multiple of the groups
    ({"layer_kind": "rwkv"}, "model.layer_kind"),
])
def test_a_hybrid_model_memx_does_not_price_is_refused_by_its_field(change, field):
    with pytest.raises(ConfigError) as refused:
        dataclasses.replace(SMALL, **change)
    assert refused.value.field == field


def test_a_hybrid_layer_costs_its_kinds_at_their_shares_and_needs_the_largest_working_set():
    costs = cm.AnalyticalCostModel(SMALL, NODE, TRAINING)
    query = (np.zeros(3, dtype=int), np.ones(3), np.ones(3), np.full(3, 2048.0), np.arange(3))
    mean = costs.layer_costs(*query)
    kinds = [(n / 8, cm.AnalyticalCostModel(kind, NODE, TRAINING).layer_costs(*query)) for kind, n in SMALL.layer_kinds]
    assert np.allclose(mean.time_s, sum(share * c.time_s for share, c in kinds))
    assert np.allclose(mean.activation_bytes, sum(share * c.activation_bytes for share, c in kinds))
    assert np.allclose(mean.working_bytes, np.max([c.working_bytes for _, c in kinds], axis=0))
    mamba = kinds[0][1]
    assert mamba.activation_bytes[1] == mamba.activation_bytes[0] > mamba.activation_bytes[2]  # selective drops none
    assert [cm.AnalyticalCostModel(kind, NODE, TRAINING).tp_allreduces(0) for kind, _ in SMALL.layer_kinds] == [2] * 3


def test_a_mamba_layer_is_slower_than_its_projections_and_its_scan_grows_with_the_state():
    mamba = SMALL.layer_kinds[0][0]
    wider_state = dataclasses.replace(mamba, mamba_state_size=256)
    seconds = [float(cm.AnalyticalCostModel(m, NODE, TRAINING).layer_costs(0, 1, 1, 2048, 0).time_s)
               for m in (mamba, wider_state)]
    assert seconds[1] > seconds[0]
    projections = 6.0 * 2048 * sum(n * k for n, k in linear_shapes(mamba, TRAINING, 1)) / (989e12)
    assert seconds[0] > projections  # never faster than its matmuls at the peak


def test_a_hybrid_model_plans_and_its_whole_step_counts_every_layer():
    plan = _estimate()
    per_layer = cm.AnalyticalCostModel(SMALL, NODE, TRAINING).layer_costs(0, 1, 1, 2048, 0)
    micro_batches = TRAINING.global_batch_size // 8
    assert plan.predicted_iteration_time_s > micro_batches * 8 * float(per_layer.time_s)
    found = search(SMALL, NODE, TRAINING, space=SearchSpace(tp_degrees=(1, 2), micro_batch_sizes=(1,)))
    assert found.best.tp in (1, 2) and sum(s.num_layers for s in found.best.stages) == 8


def test_tp_must_divide_the_mamba_groups():
    # Heads and KV heads split over TP 4; the two Mamba groups do not.
    model = dataclasses.replace(SMALL, num_kv_heads=4)
    _estimate(dataclasses.replace(model, hybrid_pattern="-**--*--"), tp=4, dp=2)  # no Mamba layer: TP 4 runs
    with pytest.raises(ConfigError, match="4 does not divide .* and 2 Mamba groups"):
        _estimate(model, tp=4, dp=2)
    space = SearchSpace(micro_batch_sizes=(1,), tp_degrees=(1, 2, 4))
    with pytest.raises(ConfigError, match="--tp: 4 does not divide"):
        search(model, NODE, TRAINING, space=space)
    space = SearchSpace(micro_batch_sizes=(1,))  # the search's own degrees: TP 4 and 8 left out
    assert {p.tp for p in search(model, NODE, TRAINING, space=space).plans} <= {1, 2}


@pytest.mark.parametrize("training, layout, flag", [
    (TRAINING, {"cp": 2, "dp": 4}, "--cp"),
    (dataclasses.replace(TRAINING, lora_rank=16), {}, "--lora-rank"),
    (dataclasses.replace(TRAINING, selective_recompute="op"), {}, "--selective-recompute op"),
])
def test_what_memx_does_not_price_in_a_hybrid_model_is_refused(training, layout, flag):
    with pytest.raises(ConfigError) as refused:
        _estimate(training=training, **layout)
    assert refused.value.field == flag


def test_memx_run_and_torchtitan_refuse_a_hybrid_model_and_megatron_builds_its_stack():
    with pytest.raises(ConfigError, match="Mamba"):
        runnable_model(SMALL)
    with pytest.raises(ConfigError, match="model.hybrid_pattern: .* is a hybrid model"):  # nor do calibration's blocks
        TransformerBlock(dataclasses.replace(SMALL, gated_mlp=True))
    plan = _estimate(tp=2, dp=4)
    args = megatron_args(plan).args
    assert args[args.index("--hybrid-override-pattern") + 1] == "M-M*M-M-"
    assert [args[args.index(f) + 1] for f in ("--mamba-num-heads", "--mamba-head-dim", "--mamba-state-dim",
                                              "--mamba-num-groups", "--position-embedding-type")] == \
        ["16", "64", "64", "2", "none"]
    assert "--rotary-base" not in args and "--swiglu" not in args
    with pytest.raises(ConfigError, match="torchtitan does not build"):
        torchtitan_toml(plan)


def test_megatron_splits_a_hybrid_model_evenly_and_the_export_says_when_the_plan_does_not():
    even = _estimate(pp=2, dp=4, layers_per_stage=[4, 4])
    assert "--pipeline-model-parallel-layout" not in megatron_args(even).args
    assert not [n for n in megatron_args(even).notes if "hybrid stack" in n]
    uneven = megatron_args(_estimate(pp=2, dp=4, layers_per_stage=[5, 3]))
    assert "--pipeline-model-parallel-layout" not in uneven.args
    assert any("splits the 8 layers evenly" in n and "as M-M*M|-M-" in n for n in uneven.notes), uneven.notes


def test_each_stage_holds_the_kinds_the_split_gives_it():
    # Four Mamba layers then four MLP layers over two stages: each stage is one kind, priced as it.
    model = dataclasses.replace(SMALL, hybrid_pattern="MMMM----")
    plan = _estimate(model, pp=2, dp=4, layers_per_stage=[4, 4])
    mamba, mlp = (cm.AnalyticalCostModel(kind, NODE, TRAINING) for kind, _ in model.layer_kinds)
    edges = cm.AnalyticalCostModel(model, NODE, TRAINING)
    first = 4 * mamba.layer_costs(0, 1, 1, 2048, 0).time_s + edges.embedding_time(0, 1, 1, 2048)
    last = 4 * mlp.layer_costs(0, 1, 1, 2048, 0).time_s + edges.head_time(0, 1, 1, 2048)
    assert [s.predicted_stage_time_s for s in plan.stages] == pytest.approx([float(first), float(last)], rel=1e-6)
    weights = [s.memory_parts_gib["parameters"] * 2**30 for s in plan.stages]
    assert weights[0] - model.embedding_params * 2 == pytest.approx(4 * mamba.model.layer_params * 2, rel=1e-6)
    for stage in plan.stages:  # the parts still add up to the stage's peak
        assert sum(stage.memory_parts_gib.values()) == pytest.approx(stage.predicted_peak_memory_gib, abs=1e-5)


# Nemotron 3 Nano's config.json (its model-specific keys; Megatron-Bridge's Nemotron3NanoProvider agrees).
NEMOTRON_3_NANO = {**NEMOTRON_H_56B, "num_hidden_layers": 52, "hidden_size": 2688, "intermediate_size": 1856,
                   "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                   "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                   "mamba_num_heads": 64, "ssm_state_size": 128, "n_routed_experts": 128, "num_experts_per_tok": 6,
                   "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1,
                   "n_group": 1, "topk_group": 1, "max_position_embeddings": 262144}
# Expert layers among the others, at a size a test plans in a moment.
SMALL_MOE = dataclasses.replace(SMALL, hybrid_pattern="MEM*EMEM", num_experts=8, experts_per_token=2,
                                expert_ffn_hidden_size=1024, shared_expert_ffn_hidden_size=1024)


def test_nemotron_3_nano_is_read_from_its_config_with_its_published_parameters():
    model = model_from_hf_dict(NEMOTRON_3_NANO, "nemotron-3-nano-30b-a3b")
    assert dataclasses.replace(model, tensor_parallel_blocks=True) == get_model("nemotron-3-nano-30b-a3b")
    assert {kind.layer_kind: n for kind, n in model.layer_kinds} == {"mamba": 23, "attention": 6, "moe": 23}
    assert model.total_params == pytest.approx(31.6e9, rel=0.005)  # "31.6B total"
    experts = {kind.layer_kind: kind.num_experts for kind, _ in model.layer_kinds}
    assert experts == {"mamba": 0, "attention": 0, "moe": 128}  # only the E layers hold experts


def test_expert_layers_of_a_hybrid_model_hold_their_states_where_the_split_puts_them():
    training = dataclasses.replace(TRAINING, expert_parallel=2)
    plan = _estimate(SMALL_MOE, training, pp=2, dp=4, layers_per_stage=[4, 4])  # MEM* | EMEM
    mamba, attention, moe = (kind for kind, _ in SMALL_MOE.layer_kinds)
    states = [s.memory_parts_gib["optimizer_states"] * 2**30 for s in plan.stages]
    # fp32 master weights and Adam's moments (12 bytes a parameter) over DP 4, the experts' over 4 / EP 2.
    dense_moe = moe.layer_params - moe.expert_params
    first = (2 * mamba.layer_params + attention.layer_params + dense_moe + SMALL_MOE.embedding_params) * 12 / 4
    assert states[0] == pytest.approx(first + moe.expert_params * 12 / 2 / 2, rel=1e-6)
    exchange = cm.AnalyticalCostModel(moe, NODE, training).layer_costs(0, 1, 1, 2048, 0).time_s
    assert plan.stages[1].predicted_stage_time_s > 2 * float(exchange)  # its two expert layers and their all-to-alls
    for stage in plan.stages:
        assert sum(stage.memory_parts_gib.values()) == pytest.approx(stage.predicted_peak_memory_gib, abs=1e-5)
    args = megatron_args(plan).args
    assert args[args.index("--num-experts") + 1] == "8" and "MEM*EMEM" in args
