"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): blocks of a Gated DeltaNet or gated-attention mixer and
experts, read from Hugging Face's config with its parameters, each kind priced for its own parts,
the checks memx makes of them and the Megatron export of their blocks. No processes."""

import dataclasses
import os

import numpy as np
import pytest
from one_node import H100, one_node
from test_exporters import _built, _megatron_config, _megatron_parse

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.gated_deltanet import step_scan_flops
from memx_launch.planning.matmuls import linear_shapes
from memx_launch.planning.runtime_support import runnable_model
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.training import TrainingSpec
from memx_launch.specs.tp_split import splits_over_tp

# Qwen3-Next-80B-A3B's config.json (its model-specific keys, as Hugging Face's Qwen3NextConfig names them).
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 48,
              "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16, "num_key_value_heads": 2,
              "head_dim": 256, "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 10000000,
              "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": 512, "num_experts_per_tok": 10,
              "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "hidden_act": "silu"}
# Its shape at a size a test plans in a moment: 4 blocks (8 layers), heads that split over TP 2.
TINY = {**QWEN3_NEXT, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 48, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96, "vocab_size": 1000}
# Qwen3.5-35B-A3B's language model (Hugging Face's Qwen3_5MoeTextConfig defaults), 24 of its 40 blocks.
QWEN3_5_MOE_24 = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "num_hidden_layers": 24,
                  "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                  "vocab_size": 248320, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 256,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))
PAPER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "paper-20gpu.yaml")
TRAINING = TrainingSpec(global_batch_size=32, seq_len=2048, setup="megatron")


def _estimate(model, training=TRAINING, **layout):
    return evaluate_layout(model, NODE, training, references=(1, 1, 1),
                           **{"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "recompute": "none", **layout})


def test_qwen3_next_is_read_from_its_config_with_its_published_parameters():
    model = model_from_hf_dict(QWEN3_NEXT, "qwen3-next-80b-a3b")
    assert dataclasses.replace(model, tensor_parallel_blocks=True) == get_model("qwen3-next-80b-a3b")
    assert model.hybrid_pattern == "GEGEGE*E" * 12 and model.num_layers == 96  # a block's mixer, then its experts
    assert {kind.layer_kind: n for kind, n in model.layer_kinds} == {"gated_deltanet": 36, "attention": 12, "moe": 48}
    assert model.total_params == pytest.approx(80e9, rel=0.01)  # "Qwen3-Next-80B"
    assert round(model.total_params / 1e9, 1) == 79.7  # as docs/setups.md gives it
    types = ["linear_attention"] * 3 + ["full_attention"]
    spelled = {k: v for k, v in QWEN3_NEXT.items() if k != "full_attention_interval"}
    assert model_from_hf_dict({**spelled, "layer_types": types * 12}, "qwen3-next-80b-a3b") == model


# Qwen3.5's language models (Qwen3.5-35B-A3B's experts, Qwen3.5-27B's dense MLP) at TINY's sizes:
# Hugging Face's config classes name no interval or sparse step, and the dense one no experts.
QWEN3_5 = {k: v for k, v in TINY.items() if k not in ("architectures", "model_type", "full_attention_interval",
                                                      "decoder_sparse_step", "mlp_only_layers", "intermediate_size")}
QWEN3_5_DENSE = {**{k: v for k, v in QWEN3_5.items() if not k.startswith(("num_experts", "moe_", "shared_expert"))},
                 "intermediate_size": 512}


@pytest.mark.parametrize("family, module, config, sizes", [
    ("qwen3_next", "qwen3_next", "Qwen3NextConfig", TINY),
    ("qwen3_next", "qwen3_next", "Qwen3NextConfig", {**TINY, "mlp_only_layers": [1]}),  # block 1: a dense MLP
    ("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeTextConfig", QWEN3_5),
    ("qwen3_5", "qwen3_5", "Qwen3_5TextConfig", QWEN3_5_DENSE)])
def test_each_layer_holds_hugging_faces_parameters(family, module, config, sizes):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    hf_config = getattr(transformers, config)(**{k: v for k, v in sizes.items() if k not in ("architectures", "model_type")})
    causal_lm = next(getattr(modeling, name) for name in dir(modeling) if name.endswith("ForCausalLM"))
    with torch.device("meta"):
        hf = causal_lm(hf_config)
    model = model_from_hf_dict({**hf_config.to_dict(), "architectures": [causal_lm.__name__]}, "tiny")
    kinds = {kind.layer_kind: kind for kind, _ in model.layer_kinds}

    def count(*modules):
        return sum(p.numel() for m in modules for p in m.parameters())

    deltanet, attention = hf.model.layers[0], hf.model.layers[3]
    assert kinds["gated_deltanet"].layer_params == count(deltanet.linear_attn, deltanet.input_layernorm)
    assert kinds["attention"].layer_params == count(attention.self_attn, attention.input_layernorm)
    assert kinds["moe" if model.num_experts else "mlp"].layer_params == \
        count(deltanet.mlp, deltanet.post_attention_layernorm)  # a mixture's shared expert gate counted too
    assert model.shared_expert_gate == bool(model.num_experts)
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "shared_expert_gate")]
    assert model.hybrid_pattern[1::2] == "".join("-" if i in dense else "E" if model.num_experts else "-"
                                                 for i in range(4))
    if model.num_experts and dense:  # Qwen3-Next's dense blocks among the expert ones
        layer = hf.model.layers[dense[0]]
        assert kinds["mlp"].layer_params == count(layer.mlp, layer.post_attention_layernorm)
    assert model.total_params == count(hf)


def test_tp_must_divide_the_deltanet_key_heads():
    model = model_from_hf_dict({**TINY, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}, "tiny")
    assert splits_over_tp(model, 2) and not splits_over_tp(model, 4)  # two key heads
    with pytest.raises(ConfigError, match="4 does not divide .* and 2 Gated DeltaNet key heads"):
        _estimate(model, tp=4, dp=2)
    with pytest.raises(ConfigError) as refused:  # value heads not a multiple of the key heads
        model_from_hf_dict({**TINY, "linear_num_value_heads": 3}, "tiny")
    assert refused.value.field == "model.linear_value_heads"


def test_a_gated_deltanet_layer_is_priced_for_its_projections_its_kernel_and_what_it_keeps():
    model = get_model("qwen3-next-80b-a3b")
    deltanet, attention, moe = (kind for kind, _ in model.layer_kinds)
    costs = cm.AnalyticalCostModel(deltanet, NODE, TRAINING)
    levels = costs.layer_costs(0, 1, 1, 4096, np.arange(3))
    projections = 6.0 * 4096 * sum(n * k for n, k in linear_shapes(deltanet, TRAINING, 1)) / 989e12
    assert levels.time_s[0] > projections  # never faster than its matmuls at the peak
    assert levels.activation_bytes[1] == levels.activation_bytes[0] > levels.activation_bytes[2]  # selective drops none
    # Linear in the sequence: twice the tokens, twice what it keeps (no s x s term).
    longer = costs.layer_costs(0, 1, 1, 8192, 0)
    assert float(longer.activation_bytes) == pytest.approx(2 * float(levels.activation_bytes[0]))
    # What it keeps a token: its norm's input and output, the convolution's input (q, k, v), q and k
    # normed and repeated to the 32 value heads, v, the gate, the output before and after its norm,
    # the output projection's input, A (64 a value head) and 5 values a head (beta, alpha, g in fp32).
    kept = 2 * 2048 + (2 * 2048 + 4096) + 2 * 2048 + 2 * 4096 + 5 * 4096 + 32 * (64 + 5)
    assert float(levels.activation_bytes[0]) == pytest.approx(2 * 4096 * kept)
    # The chunked rule's multiply-adds a token and value head (module docstring), forward and backward.
    forward = 64 * (3 * 128 + 2 * 128) + 64 * 64 / 3 + 3 * 128 * 128
    backward = 2 * forward + 64 * 256 + 2 * 128 * 128
    assert step_scan_flops(deltanet, 4096, 1, False) == pytest.approx(2 * 4096 * 32 * (forward + backward))
    assert step_scan_flops(attention, 4096, 1, False) == 0.0 == step_scan_flops(moe, 4096, 1, True)


def test_the_attention_output_gate_doubles_the_query_projection_and_keeps_the_gate():
    attention = next(kind for kind, _ in get_model("qwen3-next-80b-a3b").layer_kinds if kind.layer_kind == "attention")
    ungated = dataclasses.replace(attention, attention_output_gate=False)
    q = 16 * 256
    assert attention.layer_params - ungated.layer_params == 2048 * q
    assert linear_shapes(attention, TRAINING, 2)[0][0] - linear_shapes(ungated, TRAINING, 2)[0][0] == q / 2
    kept = [float(cm.AnalyticalCostModel(m, NODE, TRAINING).layer_costs(0, 1, 1, 4096, 0).activation_bytes)
            for m in (attention, ungated)]
    assert kept[0] - kept[1] == pytest.approx(2 * 2 * q * 4096)  # the core's output and sigmoid(gate), 16-bit
    gated = dataclasses.replace(get_model("llama2-7b"), attention_output_gate=True)  # AFMoE's, in its own module
    assert runnable_model(gated) is gated


def test_a_qwen3_next_model_plans_with_its_blocks_whole_and_memx_run_refuses_it():
    model = model_from_hf_dict(TINY, "tiny")
    found = search(model, NODE, TRAINING, space=SearchSpace(tp_degrees=(1, 2), micro_batch_sizes=(1,)))
    assert sum(s.num_layers for s in found.best.stages) == 8
    # On the paper's mixed cluster the uneven split keeps each block's mixer and experts on one
    # stage (split layer by layer, it gave stages of 3 and 5 layers here).
    twelve = model_from_hf_dict({**TINY, "num_hidden_layers": 12}, "tiny")
    space = SearchSpace(micro_batch_sizes=(1,), schedules=("1f1b",), pipeline_degrees=(2, 4, 5))
    plans = search(twelve, ClusterSpec.from_yaml(PAPER), TRAINING, space=space).plans
    assert plans and all(s.num_layers % 2 == 0 for p in plans for s in p.stages)
    # Qwen3.5-35B-A3B's language model cut to 24 blocks, tight on the paper's 32 GiB devices: the
    # stages that recompute some of their layers recompute whole blocks (layer by layer: full:5).
    tight = model_from_hf_dict(QWEN3_5_MOE_24, "qwen3.5")
    space = SearchSpace(micro_batch_sizes=(1,), schedules=("1f1b",), tp_degrees=(1,))
    training = TrainingSpec(global_batch_size=16, seq_len=4096, setup="megatron")
    levels = {s.recompute for p in search(tight, ClusterSpec.from_yaml(PAPER), training, space=space).plans
              for s in p.stages}
    partial = [int(level[len("full:"):]) for level in levels if level.startswith("full:")]
    assert partial and all(n % 2 == 0 for n in partial), levels
    with pytest.raises(ConfigError, match="Gated DeltaNet"):
        runnable_model(model)
    with pytest.raises(ConfigError) as refused:
        _estimate(model, cp=2, dp=4)
    assert refused.value.field == "--cp"


def test_megatron_builds_its_blocks_with_the_plans_split_in_blocks():
    model = model_from_hf_dict(TINY, "tiny")
    plan = _estimate(model, pp=2, dp=4, layers_per_stage=[6, 2])
    export = megatron_args(plan)
    parsed = _megatron_parse(export.args)
    assert (parsed.num_layers, parsed.experimental_attention_variant, parsed.linear_attention_freq) == \
        (4, "gated_delta_net", "4")
    assert (parsed.linear_num_key_heads, parsed.linear_num_value_heads, parsed.linear_key_head_dim,
            parsed.linear_value_head_dim, parsed.linear_conv_kernel_dim) == (2, 4, 32, 48, 4)
    assert parsed.attention_output_gate and parsed.position_embedding_type == "rope"
    assert "--hybrid-override-pattern" not in export.args
    config = _megatron_config(plan, export.args)  # megatron-core checks the Gated DeltaNet settings
    assert config.linear_attention_freq == 4 and config.attention_output_gate
    assert _built(config) == [[3], [1]]  # the plan's 6 and 2 layers: 3 blocks and 1
    cut = megatron_args(_estimate(model, pp=2, dp=4, layers_per_stage=[5, 3]))
    assert "--pipeline-model-parallel-layout" not in cut.args
    assert any("cut blocks between their mixer and their MLP" in n for n in cut.notes), cut.notes
    # Three of each stage's four layers recompute: Megatron's block method counts blocks, two (rounded up).
    partial = megatron_args(_estimate(model, pp=2, dp=4, layers_per_stage=[4, 4], recompute=["full:3", "full:3"]))
    assert partial.args[partial.args.index("--recompute-num-layers") + 1] == "2"
    with pytest.raises(ConfigError, match="model.hybrid_pattern: .* only in blocks"):  # two mixers in a row
        megatron_args(_estimate(dataclasses.replace(model, hybrid_pattern="GGE*EEGE")))


def test_qwen3_5s_multimodal_config_is_read_as_its_language_model():
    transformers = pytest.importorskip("transformers")
    wrapped = transformers.Qwen3_5MoeConfig(text_config=QWEN3_5).to_dict()  # its vision encoder is not planned
    model = model_from_hf_dict({**wrapped, "architectures": ["Qwen3_5MoeForConditionalGeneration"]}, "qwen3.5")
    assert (model.hybrid_pattern, model.num_experts, model.attention_output_gate) == ("GEGEGE*E", 8, True)
    assert model.rope_theta == 10000000 and model.lm_head  # its rope_parameters' base; a generation class's head
