"""Megatron's ``--recompute-modules`` as memx's selective level (``recompute_modules``): what each
module keeps no more, what it runs again, the refusals, the plan's record and the export. No
processes."""

import dataclasses

import pytest
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.activations import activation_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.matmuls import gemm_seconds, mlp_shapes
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

LLAMA = get_model("llama3-8b")
QWEN3 = get_model("qwen3-30b-a3b")
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))
SBH = 4096 * 4096  # one micro-batch of 4,096 tokens at llama3-8b's hidden size


def _training(**kw):
    return TrainingSpec(**{"global_batch_size": 64, "seq_len": 4096, "setup": "megatron", **kw})


def _kept(model, modules, **kw):
    return float(activation_bytes(model, 1, 4096, 1, cm.SELECTIVE, recompute_modules=modules, **kw).activation_bytes)


def test_each_module_drops_what_it_recomputes():
    none = float(activation_bytes(LLAMA, 1, 4096, 1, cm.NONE).activation_bytes)
    # layernorm: the two 16-bit normed tensors the QKV and MLP-up linears keep (2 x 2 bytes a hidden element).
    assert none - _kept(LLAMA, ("layernorm",)) == pytest.approx(4 * SBH)
    # Quantized linears keep their own FP8 copy of the input: the norms' recompute frees nothing.
    assert _kept(LLAMA, ("layernorm",), quantized_bytes=1.0) == pytest.approx(
        float(activation_bytes(LLAMA, 1, 4096, 1, cm.NONE, quantized_bytes=1.0).activation_bytes))
    # mlp: SwiGLU's gate and up outputs, silu(gate) and the product: (6 + 2) f / h.
    assert none - _kept(LLAMA, ("mlp",)) == pytest.approx(8 * 14336 / 4096 * SBH)
    # core_attn: fused attention's fp32 logsumexp, one a head.
    assert none - _kept(LLAMA, ("core_attn",)) == pytest.approx(4 * 32 / 4096 * SBH)
    # moe_act: the routed experts' down-projection inputs, top-8 of 768 wide, from Megatron's fused
    # activation, which keeps only its input; from megatron-core's eager one (unfused), what it keeps
    # beyond its input too: silu(gate), up plus its offset and the product, 2 + 2 + 2 bytes an element,
    # and GPT-OSS's clamped gate 2 more; a dense model has none.
    for fused, dropped in ((True, 2), (False, 2 + 6)):
        qwen_none = float(activation_bytes(QWEN3, 1, 4096, 1, cm.NONE, fused_activation=fused).activation_bytes)
        assert qwen_none - _kept(QWEN3, ("moe_act",), fused_activation=fused) == pytest.approx(
            dropped * 8 * 768 * 4096)
    clamped = dataclasses.replace(QWEN3, clamped_glu=True)
    assert float(activation_bytes(clamped, 1, 4096, 1, cm.NONE).activation_bytes) - _kept(
        clamped, ("moe_act",)) == pytest.approx((2 + 6 + 2) * 8 * 768 * 4096)
    qwen_none = float(activation_bytes(QWEN3, 1, 4096, 1, cm.NONE).activation_bytes)
    assert _kept(LLAMA, ("moe_act",)) == pytest.approx(none)
    assert _kept(QWEN3, ("mlp",)) == pytest.approx(qwen_none)  # Megatron's mlp is the dense MLP


def test_a_mixture_s_whole_mlp_or_its_shared_expert():
    from memx_launch.planning import experts

    shared = dataclasses.replace(QWEN3, shared_expert_ffn_hidden_size=768)
    sbh = 4096 * shared.hidden_size
    none = float(activation_bytes(shared, 1, 4096, 1, cm.NONE).activation_bytes)
    kept, down = experts.kept_units(shared, 1, 1.0, False, dtype_bytes=2)
    # moe keeps only the MLP's input: the router's logits and every routed and shared tensor go.
    assert none - _kept(shared, ("moe",)) == pytest.approx((kept + down) * sbh)
    # shared_experts: its gate and up outputs, silu(gate) and product, (6 + 2) x 768 / h.
    assert none - _kept(shared, ("shared_experts",)) == pytest.approx(8 * 768 / shared.hidden_size * sbh)
    assert _kept(LLAMA, ("moe",)) == _kept(LLAMA, ("shared_experts",)) == pytest.approx(
        float(activation_bytes(LLAMA, 1, 4096, 1, cm.NONE).activation_bytes))

    def seconds(modules):
        return float(cm.AnalyticalCostModel(shared, NODE, _training(recompute_modules=modules, expert_parallel=8))
                     .layer_costs(0, 1, 1, 4096, cm.SELECTIVE, host=False).time_s)
    # The whole MLP again: its experts' GEMMs and its two exchanges, more than its activation or shared expert.
    plain = float(cm.AnalyticalCostModel(shared, NODE, _training(expert_parallel=8)).layer_costs(
        0, 1, 1, 4096, cm.NONE, host=False).time_s)
    assert seconds(("moe",)) > max(seconds(("shared_experts",)), seconds(("moe_act",)))
    assert min(seconds(("shared_experts",)), seconds(("moe_act",))) > plain


def test_each_module_runs_its_part_again():
    def seconds(model, level, modules=None):  # the device's: the host's for Qwen3's 128 local experts' ops would hide it
        return float(cm.AnalyticalCostModel(model, NODE, _training(recompute_modules=modules))
                     .layer_costs(0, 1, 1, 4096, level, host=False).time_s)

    none = seconds(LLAMA, cm.NONE)
    # The dense MLP's GEMMs forward again, and its activation's passes.
    gemm = (float(cm.AnalyticalCostModel(LLAMA, NODE, _training())._linear_flops[0]), 3350e9, 132, 2)
    mlp_forward = sum(gemm_seconds(4096, n, k, *gemm) for n, k in mlp_shapes(LLAMA, _training(), 1))
    assert seconds(LLAMA, cm.SELECTIVE, ("mlp",)) - none > mlp_forward
    # Norms and an activation are element-wise passes: far cheaper than the attention core again.
    assert none < seconds(LLAMA, cm.SELECTIVE, ("layernorm",)) < seconds(LLAMA, cm.SELECTIVE, ("core_attn",))
    assert seconds(LLAMA, cm.SELECTIVE, ("core_attn",)) <= seconds(LLAMA, cm.SELECTIVE)
    assert seconds(QWEN3, cm.NONE) < seconds(QWEN3, cm.SELECTIVE, ("moe_act",)) < seconds(QWEN3, cm.FULL)


def test_modules_are_checked_recorded_and_exported():
    assert _training(recompute_modules="layernorm, moe_act").recompute_modules == ("layernorm", "moe_act")
    with pytest.raises(ConfigError, match="--recompute-modules: unknown module 'moe_preprocess'; use some of core_attn"):
        _training(recompute_modules="moe_preprocess")
    with pytest.raises(ConfigError, match="--recompute-modules: with --selective-recompute op"):
        _training(recompute_modules="core_attn", selective_recompute="op")
    plan = evaluate_layout(QWEN3, NODE, _training(recompute_modules=["layernorm", "moe_act"], expert_parallel=8),
                           tp=1, pp=1, dp=8, micro_batch_size=1, recompute="selective", references=(1, 1, 1))
    args = megatron_args(plan).args
    assert args[args.index("--recompute-granularity"):][:5] == ["--recompute-granularity", "selective",
                                                                "--recompute-modules", "layernorm", "moe_act"]
    restored = TrainingSpec(**{**dataclasses.asdict(_training()), **plan.training})
    assert restored.recompute_modules == ("layernorm", "moe_act")
    assert _training(recompute_modules="layernorm moe_act").recompute_modules == ("layernorm", "moe_act")
    from memx_launch.planning.runtime_support import check_runnable

    dense = evaluate_layout(LLAMA, NODE, _training(recompute_modules="layernorm"), tp=1, pp=1, dp=8,
                            micro_batch_size=1, recompute="selective", references=(1, 1, 1))
    with pytest.raises(ConfigError, match="--plan: recompute_modules=layernorm: memx's runtime recomputes its own"):
        check_runnable(dense)
