"""Blocks as Transformers writes them (``transformers_blocks``): what autograd saves for Hugging
Face mixtures' layers and their grouped GEMMs in fp32 under autocast (planning/experts.py), a
fused q, k and v projection split into views, rotary embeddings that concatenate and norms that
centre in torch ops (planning/activations.py)."""

import dataclasses
import os

import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning import elementwise
from memx_launch.planning.peaks import hbm_gbps
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

# An H100 node given its fp32 peak (67 TFLOPS: CUDA cores) beside its dense 16-bit one.
H100_NODE = {"version": 1, "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}],
             "device_types": {"h100": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "peak_tflops_fp32": 67,
                                       "compute_capability": 9.0, "memory_bandwidth_gbps": 3350}}}
HF_MIXTRAL = os.path.join(os.path.dirname(__file__), "..", "examples", "models", "hf-mixtral-tiny")
# Tiny configs of Transformers' Qwen mixtures and GPT-OSS: Qwen2-MoE's shared expert and its sigmoid
# gate, Qwen3-MoE's query and key norms, GPT-OSS's attention sinks (eager attention), clamped GLU and
# biases. Their token counts below differ from every weight's width.
TINY_MOE = {"qwen2_moe": dict(shared_expert_intermediate_size=256), "qwen3_moe": dict(head_dim=32),
            "gpt_oss": dict(intermediate_size=96, num_local_experts=8, head_dim=32, sliding_window=512)}


def _moe_model(kind: str, tmp_path) -> str:
    """The folder of ``kind``'s config: Mixtral's example, or a tiny Qwen mixture written there."""
    if kind == "mixtral":
        return HF_MIXTRAL
    import transformers

    config = transformers.AutoConfig.for_model(kind, **{
        "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "moe_intermediate_size": 96, "num_experts": 8,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], **TINY_MOE[kind]})
    config.save_pretrained(tmp_path / kind)
    return str(tmp_path / kind)


def _moe_layer_saves(folder: str, dtype: str, b: int, seq: int) -> tuple[int, set]:
    """Bytes autograd saves for ``folder``'s decoder layer (:func:`hf_decoder_layer`: its experts as
    the causal LM builds them, grouped GEMMs) as memx-run trains it (:func:`hf_layer_kept_bytes`),
    and the dtypes of the experts' saved tensors."""
    import torch

    from test_framework_memory import hf_decoder_layer, hf_layer_kept_bytes

    layer, x, rotary = hf_decoder_layer(folder, seq, b)
    experts = layer.mlp.experts
    width = getattr(experts, "intermediate_dim", None) or experts.intermediate_size
    expert_dtypes = set()

    def note(t):  # the experts' f-wide tensors
        if t.shape[-1] in (width, 2 * width) and t.shape[0] != b:
            expert_dtypes.add(str(t.dtype).removeprefix("torch."))
        return t

    kept = hf_layer_kept_bytes(layer, x, rotary, dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            layer(x, position_embeddings=rotary, attention_mask=None)
    return kept, expert_dtypes


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_what_autograd_saves_for_a_transformers_mixture_s_layer_is_what_memx_run_counts(kind, dtype, tmp_path):
    """Per routed copy Transformers keeps the sorted token, the gate-and-up output, silu(gate), the
    product and the down projection's output (which the routing weights multiply after it), all
    in fp32 under autocast: its grouped GEMMs are not autocast-enabled and it casts their input to
    the weights' dtype; Qwen2-MoE's shared expert its MLP's tensors and its output, which its
    gate's sigmoid multiplies; GPT-OSS's clamped GLU three tensors of the width more, and its
    attention, eager (SDPA has no sinks), the fp32 probabilities and their 16-bit copy. memx-run's
    and ``--setup ddp``'s count holds it to 1%; Megatron-Core's experts' count (the weights
    multiplied inside the activation, 16-bit; GPT-OSS's sinks in a fused kernel) is more than 3%
    off either way."""
    folder, b, seq = _moe_model(kind, tmp_path), 2, 128 if kind == "mixtral" else 80
    spec = get_model(folder)
    kept, expert_dtypes = _moe_layer_saves(folder, dtype, b, seq)
    assert expert_dtypes == {"float32"}  # under bf16 autocast too
    for setup in ("memx-run", "ddp"):
        training = TrainingSpec(setup=setup, dtype=dtype)
        counted = float(cm.training_activation_bytes(spec, training, b, seq, 1, cm.NONE).activation_bytes)
        assert kept == pytest.approx(counted, rel=0.01), setup
    megatron = float(cm.training_activation_bytes(spec, TrainingSpec(setup="memx-run", dtype=dtype,
                                                                     transformers_blocks=False),
                                                  b, seq, 1, cm.NONE).activation_bytes)
    assert abs(megatron / kept - 1) > 0.03


def test_transformers_blocks_under_autocast_run_their_gemms_at_the_fp32_rate():
    """An H100's block of Mixtral under ``--setup ddp`` in bf16: the routed experts' grouped GEMMs
    at the fp32 peak (67 of 989 TFLOPS) make the block slower than Megatron-Core's 16-bit experts;
    with ``--tf32`` at half the 16-bit peak, in between; in bf16 weights (``--setup zero3``) the
    same as Megatron's under its flex dispatcher (the all-to-all one also sorts its copies into
    expert order, :func:`~memx_launch.planning.experts.permutation_bytes`) but for megatron-core's
    eager experts' chunk and routing-weight passes (``EAGER_ROUTED_EXTRA_BYTES``) beyond Transformers'
    chunk's (``TRANSFORMERS_CHUNK_BYTES``) at HBM speed."""
    h100 = ClusterSpec.from_dict(H100_NODE)
    spec = get_model("mixtral-8x7b")

    def block_s(**kw) -> float:
        training = TrainingSpec(global_batch_size=8, seq_len=4096, **kw)
        return float(cm.AnalyticalCostModel(spec, h100, training).layer_costs(0, 1, 1, 4096, cm.NONE).time_s)

    fp32, tf32, megatron = (block_s(setup="ddp"), block_s(setup="ddp", tf32=True),
                            block_s(setup="ddp", transformers_blocks=False))
    assert fp32 > tf32 > megatron
    assert 4.5 < fp32 / megatron < 6  # the experts hold most of the block's FLOPs (docs/setups.md: 5x)
    zero3, zero3_megatron = block_s(setup="zero3"), block_s(setup="zero3", transformers_blocks=False,
                                                            expert_dispatcher="flex")
    routed = 4096 * spec.experts_per_token * spec.moe_ffn_hidden_size * 2 * (
        sum(elementwise.EAGER_ROUTED_EXTRA_BYTES) - sum(elementwise.TRANSFORMERS_CHUNK_BYTES))
    assert zero3_megatron - zero3 == pytest.approx(routed / (hbm_gbps(h100.device_type("h100")) * 1e9))
    assert block_s(setup="zero3", transformers_blocks=False) > zero3_megatron


@pytest.mark.parametrize("kind, dtype, batch, seq", [("mixtral", "fp32", 2, 128), ("mixtral", "fp32", 4, 128),
                                                     ("mixtral", "fp32", 2, 16), ("qwen3_moe", "fp32", 8, 128),
                                                     ("qwen2_moe", "fp32", 8, 128), ("qwen2_moe", "bf16", 8, 128)])
def test_the_backward_of_transformers_blocks_holds_what_memx_counts(kind, dtype, batch, seq, tmp_path):
    """Transformers' mixtures' layers, their gradients allocated (as from a step's second
    micro-batch, and as calibration measures a block): what the backward holds above what the
    forward kept, as the emulated device's guard counts it, is memx's backward working set to
    0.5% from 256 tokens on: the stream's gradient and per routed copy the larger of its
    gate-and-up gradient and the three h-wide tensors of the routing weights' multiply's
    backward (Qwen3-MoE's narrow experts: their gate-and-up gradients alone, counted before, 57%
    of it; Mixtral's 93%), with Qwen2-MoE's gated shared expert its output's gradient besides. At
    few tokens the experts' gate-and-up weights' gradient binds, one 3-D parameter made whole
    (12% over at 32 tokens; the routed copies' gradients alone under a fifth of what it holds)."""
    import math

    import torch

    from memx_launch.profiling.emulation import EmulatedDevice
    from test_framework_memory import hf_decoder_layer

    folder = _moe_model(kind, tmp_path)
    layer, x, rotary = hf_decoder_layer(folder, seq, batch)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        with EmulatedDevice("probe", math.inf) as device:
            device.track([*layer.parameters(), *(p.grad for p in layer.parameters()), x, *rotary])
            y = layer(x, position_embeddings=rotary, attention_mask=None)
            device.reset_peak()
            kept = device.live_bytes
            y.backward(torch.randn_like(y))
    held = device.peak_bytes - kept
    model = get_model(folder)
    # The casts are made in the measured forward, as a region per forward makes them (under memx-run's region a
    # step a later micro-batch's 16-bit weight gradients wait instead: benchmarks/hf_block_memory.py).
    training = TrainingSpec(setup="memx-run", dtype=dtype, autocast_per_step=False)
    counted = cm.training_activation_bytes(model, training, batch, seq, 1, cm.NONE).working_bytes
    gate_up = 4 * next(p.numel() for name, p in layer.named_parameters() if name.endswith("gate_up_proj"))
    tokens, k, f = batch * seq, model.experts_per_token, model.moe_ffn_hidden_size
    if seq < 128:  # the weights' gradient binds; the routed copies' gradients alone (counted before) a fifth of it
        assert float(counted) == gate_up and held <= gate_up <= 1.12 * held
        assert 5 * 4 * tokens * k * 2 * f < held
    else:
        assert float(counted) == pytest.approx(held, rel=0.005) and counted > gate_up
        gate_up_grads = 4 * tokens * (model.hidden_size + k * 2 * f)  # the stream's gradient and theirs
        assert gate_up_grads / held < {"mixtral": 0.94, "qwen3_moe": 0.58, "qwen2_moe": 0.54}[kind]


def test_the_report_says_where_the_experts_run_in_fp32(tmp_path, capsys):
    """``memx estimate``'s rates line names the experts' fp32 rate under ``--setup ddp`` (autocast
    over fp32 weights), and not under ``--setup zero3`` (their weights gathered in bf16)."""
    import json

    from memx_launch.cli import main

    cluster = tmp_path / "h100.json"
    cluster.write_text(json.dumps(H100_NODE))
    lines = {}
    for setup, pp, dp in (("ddp", "8", "1"), ("zero3", "1", "8")):
        main(["estimate", "--model", "mixtral-8x7b", "--cluster", str(cluster), "--setup", setup, "--tp", "1",
              "--pp", pp, "--dp", dp, "--micro-batch-size", "1", "--global-batch-size", "16", "--seq-len", "4096",
              "--recompute", "full"])
        lines[setup] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rates"))
    assert "64 in its experts' fp32 GEMMs" in lines["ddp"] and "experts" not in lines["zero3"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_fused_qkv_projection_split_into_views_stays_whole(dtype, tmp_path):
    """Transformers' Phi-3 layer (one ``qkv_proj``, rotary embedding) as memx-run plans it, its
    block read (``fused_qkv``, ``fused_gate_up``): the attention keeps v, a view of the projection's
    output, so the whole output stays, and its rotary embedding concatenates (even whole heads), so
    the attention's output is copied for ``o_proj``: what
    autograd saves is memx-run's count to 1% (11-13% under without the rule)."""
    transformers = pytest.importorskip("transformers")
    from memx_launch.models.block_reading import own_block_training
    from test_framework_memory import hf_decoder_layer, hf_layer_kept_bytes

    config = transformers.AutoConfig.for_model("phi3", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                               pad_token_id=0)
    config.save_pretrained(tmp_path)
    b, seq = 2, 80
    layer, x, rotary = hf_decoder_layer(str(tmp_path), seq, b)
    spec = get_model(str(tmp_path))
    training, read = own_block_training(TrainingSpec(setup="memx-run", dtype=dtype), layer, spec)
    assert read == {"fused_qkv": True, "fused_gate_up": True, "selective_recompute": "block"}
    kept = hf_layer_kept_bytes(layer, x, rotary, dtype)

    def counted(tr):
        return float(cm.training_activation_bytes(spec, tr, b, seq, 1, cm.NONE).activation_bytes)
    assert kept == pytest.approx(counted(training), rel=0.01)
    assert kept / counted(dataclasses.replace(training, transformers_blocks=False)) > 1.09


# Tiny configs beside a family's defaults: rotary positions on part of each head (StableLM, GLM), a
# LayerNorm of torch ops that centres twice (Cohere), a rotary embedding on a fused projection's
# views that does not concatenate (Falcon's original blocks).
ROTARY_AND_NORMS = {"stablelm": ("rotary_concatenates", {}), "glm": ("rotary_concatenates", dict(head_dim=32)),
                    "cohere": ("centred_norm_ops", {}), "olmo2": ("norm_weight_in_fp32", {}),
                    "falcon": (None, dict(new_decoder_architecture=False, parallel_attn=False, multi_query=False,
                                          num_kv_heads=4, bias=False))}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(ROTARY_AND_NORMS))
def test_what_a_rotary_embedding_and_norms_keep_is_what_memx_run_counts(kind, dtype, tmp_path):
    """A rotary embedding that concatenates each head's turned and passed parts makes the
    attention's output a copy (``rotary_concatenates``, read off the config); Cohere's norms keep
    ``x - mean`` twice (``centred_norm_ops``); Falcon's rotary embedding concatenates nothing:
    what autograd saves is memx-run's count to 1.5%, and 3% or more off without the field."""
    transformers = pytest.importorskip("transformers")
    from memx_launch.models.block_reading import own_block_training
    from test_framework_memory import hf_decoder_layer, hf_layer_kept_bytes

    field, own = ROTARY_AND_NORMS[kind]
    config = transformers.AutoConfig.for_model(kind, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                               pad_token_id=0, **own)
    config.save_pretrained(tmp_path)
    b, seq = 2, 80
    layer, x, rotary = hf_decoder_layer(str(tmp_path), seq, b)
    spec = get_model(str(tmp_path))
    training, _ = own_block_training(TrainingSpec(setup="memx-run", dtype=dtype), layer, spec)
    kept = hf_layer_kept_bytes(layer, x, rotary, dtype)

    def counted(model):
        return float(cm.training_activation_bytes(model, training, b, seq, 1, cm.NONE).activation_bytes)
    assert kept == pytest.approx(counted(spec), rel=0.015)  # GLM's in bf16 the farthest: 1.0%
    flags = {name: getattr(spec, name) for name in ("rotary_concatenates", "centred_norm_ops", "norm_weight_in_fp32")}
    assert flags == {name: name == field for name in flags}
    if field and (dtype == "bf16" or field != "norm_weight_in_fp32"):  # fp32 keeps fp32 either way
        assert kept / counted(dataclasses.replace(spec, **{field: False})) > 1.03
