"""A user's block read for how it runs (memx_launch/models/block_reading.py): q, k and v as one
linear or three, a gated MLP's gate and up as one or two, RMSNorms of torch ops; memx-run and the
Lightning callback plan and calibrate the block so."""

import dataclasses
import os

import pytest
import torch
from torch import nn

from memx_launch.models.block_reading import own_block_training, read_block
from memx_launch.models.llama import TransformerBlock
from memx_launch.specs.catalog import get_model
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.training import TrainingSpec


def _hf_block(config):
    from transformers import AutoModelForCausalLM

    decoder = AutoModelForCausalLM.from_config(config).get_decoder()
    return (decoder.layers if hasattr(decoder, "layers") else decoder.h)[0]


@pytest.mark.parametrize("family,expected", [
    # c_attn, a Conv1D: q, k and v as one; torch's LayerNorm; its defaults' resid_pdrop and attn_pdrop (0.1)
    ("gpt2", {"fused_qkv": True, "dropout": True, "attention_dropout": True}),
    ("gpt_neox", {"fused_qkv": True}),  # query_key_value
    ("llama", {"fused_qkv": False, "fused_gate_up": False, "fused_norm": False}),  # LlamaRMSNorm: torch ops
    ("phi3", {"fused_qkv": True, "fused_gate_up": True, "fused_norm": False}),  # qkv_proj, gate_up_proj
    ("opt", {"fused_qkv": False}),
])
def test_a_hugging_face_block_is_read_as_it_runs(family, expected):
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=97)
    config = {"gpt2": lambda: transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, vocab_size=97),
              "gpt_neox": lambda: transformers.GPTNeoXConfig(**small, intermediate_size=256),
              "llama": lambda: transformers.LlamaConfig(**small, num_key_value_heads=2, intermediate_size=176),
              "phi3": lambda: transformers.Phi3Config(**small, num_key_value_heads=2, intermediate_size=176,
                                                      pad_token_id=0),
              "opt": lambda: transformers.OPTConfig(**small, ffn_dim=256, word_embed_proj_dim=64)}[family]()
    spec = model_from_hf_dict(config.to_dict(), family)
    assert read_block(_hf_block(config), spec) == expected


def test_memx_s_block_runs_as_memx_run_plans_it_and_the_default_setup_does_not():
    """memx's block: five linears, torch's nn.RMSNorm (whose kernel depends on the device: not read)."""
    spec = get_model("llama-tiny")
    block = TransformerBlock(spec, "none")
    assert read_block(block, spec) == {"fused_qkv": False, "fused_gate_up": False}
    unchanged, changed = own_block_training(TrainingSpec(setup="memx-run"), block, spec)
    assert changed == {} and unchanged == TrainingSpec(setup="memx-run")
    # Megatron's defaults (one linear each) are not how this block runs.
    trained, changed = own_block_training(TrainingSpec(), block, spec)
    assert changed == {"fused_qkv": False, "fused_gate_up": False}
    assert (trained.fused_qkv, trained.fused_gate_up, trained.fused_norm) == (False, False, True)


def test_nothing_is_read_where_the_block_has_no_linear_module_or_its_widths_are_ambiguous():
    spec = get_model("llama-tiny")

    class BareWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Parameter(torch.zeros(spec.q_hidden_size + 2 * spec.kv_hidden_size, spec.hidden_size))

    assert read_block(BareWeights(), spec) == {}
    # q, k and v together as wide as gate and up together: a linear of that width could be either.
    ambiguous = dataclasses.replace(spec, num_kv_heads=spec.num_heads,
                                    ffn_hidden_size=3 * spec.hidden_size // 2)
    assert read_block(nn.Linear(spec.hidden_size, 3 * spec.hidden_size), ambiguous) == {}
    # Nor where a mixture's shared expert is as wide as q, k and v together (a tiny Qwen2-MoE's).
    mixture = dataclasses.replace(spec, num_experts=8, experts_per_token=2, expert_ffn_hidden_size=96,
                                  shared_expert_ffn_hidden_size=spec.q_hidden_size + 2 * spec.kv_hidden_size)
    assert "fused_qkv" not in read_block(nn.Linear(spec.hidden_size, mixture.shared_expert_ffn_hidden_size), mixture)


def test_an_rms_norm_class_of_the_model_s_own_is_read_as_torch_ops():
    spec = get_model("llama-tiny")

    class MyRMSNorm(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    assert read_block(nn.Sequential(MyRMSNorm()), spec) == {"fused_norm": False}
    assert read_block(nn.Sequential(nn.RMSNorm(spec.hidden_size)), spec) == {}
    # Weight-only norms read as RMSNorm's (MPT's config) that run torch's LayerNorm kernel: fused.
    assert read_block(nn.Sequential(nn.LayerNorm(spec.hidden_size)), spec) == {"fused_norm": True}


def test_a_block_memx_cannot_see_into_is_priced_searched_and_run_with_its_selective_level_as_full():
    """GPT-2's block (memx cannot reach its attention core): memx-run reads ``selective_recompute=
    "block"`` off it, the cost model prices its selective level as full recompute (it priced the
    attention core's before, a peak far above what ran), the search leaves the level out, and the
    stage checkpoints the whole block; torchtitan's op-level policy reads ops and stays."""
    transformers = pytest.importorskip("transformers")
    from memx_launch.models.adapters import ModelParts
    from memx_launch.planning import costmodel as cm
    from memx_launch.planning.search import search
    from memx_launch.planning.search_space import SearchSpace
    from memx_launch.specs.cluster import ClusterSpec

    config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=97, n_positions=64)
    spec = model_from_hf_dict(config.to_dict(), "gpt2-tiny")
    model = transformers.AutoModelForCausalLM.from_config(config)
    block = model.transformer.h[0]
    training, read = own_block_training(TrainingSpec(setup="memx-run", dtype="fp32"), block, spec)
    assert read["selective_recompute"] == "block"
    assert "selective_recompute" not in own_block_training(TrainingSpec(setup="memx-run", selective_recompute="op"),
                                                           block, spec)[1]
    cluster = ClusterSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                                                 "cpu-emulated.yaml"))
    costs = {policy: [cm.AnalyticalCostModel(spec, cluster, dataclasses.replace(training, selective_recompute=policy))
                      .layer_costs(0, 1, 2, 64, level) for level in (cm.SELECTIVE, cm.FULL)]
             for policy in ("block", "attention")}
    (selective, full), (attention, _) = costs["block"], costs["attention"]
    for part in ("time_s", "activation_bytes", "working_bytes"):
        assert getattr(selective, part) == pytest.approx(getattr(full, part))
    assert attention.activation_bytes > full.activation_bytes  # what was priced before
    plans = search(spec, cluster, dataclasses.replace(training, global_batch_size=8, seq_len=64),
                   space=SearchSpace(micro_batch_sizes=(1,))).plans
    assert plans and all("selective" not in stage.recompute for plan in plans for stage in plan.stages)
    stage = ModelParts(model).stage(0, 2, first=True, last=True, recompute="selective", selective_policy="block")
    assert stage.levels == ["full", "full"]
