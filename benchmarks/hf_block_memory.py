"""memx-run's count of what one Hugging Face decoder layer keeps for its backward, against what
autograd saves for it, family by family (Transformers as installed, on CPU).

Each family's layer is built from a tiny config of its own (hidden 128, 4 heads, 2 KV heads,
MLP 352, two layers; mixtures: 8 experts of width 96, 2 a token), inside its causal LM, so that it
runs with the arguments the model passes it (rotary tables, no cache, no mask: causal attention).
Measured: the bytes of the storages autograd saves while the layer's forward runs
(``memx_launch/profiling/saved_tensors.py``), its parameters, their autocast casts and its
arguments aside, in fp32 and under bf16 autocast over fp32 weights (as memx-run trains). Counted:
memx's ``training_activation_bytes`` of the model read from the same config, under ``--setup
memx-run`` with the options memx-run reads off the layer's modules (``models/block_reading.py``).
Every layer besides: the mean of both layers' saved bytes over that count (a family whose layers
differ, as Gemma 4's sliding and global ones, shows there what its first layer does not).

Its backward's working set besides: what a later backward (the layer's gradients allocated, as
from a step's second micro-batch: torch's AccumulateGrad adds each fresh weight gradient into
them; under autocast the weights' casts made by the step's first forward, whose 16-bit gradients wait
for the backward's end) holds above what the forward kept, the incoming gradient included, as the
emulated device's guard counts it, against memx's ``working_bytes``.

Per family: measured, counted and their ratio in each precision, and the ratio to the count of the
same layer taken for Megatron-Core's (``--no-transformers-blocks``: its experts and its fused q, k,
v projection). What a ratio off 1 says: the layer keeps what memx does not count (above 1) or less
(below).

Writes benchmarks/results/hf_block_memory.json. Run: .venv/bin/python benchmarks/hf_block_memory.py
(a few seconds).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.models.block_reading import own_block_training  # noqa: E402
from memx_launch.planning import costmodel as cm  # noqa: E402
from memx_launch.profiling.emulation import EmulatedDevice  # noqa: E402
from memx_launch.profiling.saved_tensors import saved_storage_bytes  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "hf_block_memory.json")
SHAPE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=512, pad_token_id=0)
MIXTURE = dict(moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
# Each family's own fields beside SHAPE (None: the family's defaults).
FAMILIES = {
    "llama": None, "mistral": None, "qwen2": None, "qwen3": dict(head_dim=32), "granite": None,
    "gemma": dict(head_dim=32), "gemma2": dict(head_dim=32, sliding_window=512),
    "gemma3_text": dict(head_dim=32, sliding_window=512), "olmo2": None, "phi3": None, "glm": dict(head_dim=32),
    "stablelm": None, "cohere": None, "gpt_neox": dict(rotary_pct=0.25, use_parallel_residual=False, num_key_value_heads=4),  # no grouped queries
    "falcon": dict(new_decoder_architecture=False, parallel_attn=False, multi_query=False, num_kv_heads=4,
                   bias=False),
    "mixtral": dict(num_local_experts=8, intermediate_size=96), "qwen2_moe": {**MIXTURE, "shared_expert_intermediate_size": 256},
    "qwen3_moe": {**MIXTURE, "head_dim": 32},
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, head_dim=32, sliding_window=512),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=96, moe_num_shared_experts=2,
                         moe_layer_start_index=0),
    # Attention dropout off: on CPU SDPA with dropout falls back to its math path, keeping what CUDA's kernels
    # regenerate (Seed-OSS's and HunYuan's configs default it to 0.1). Seed-OSS's residual dropout stays on.
    "seed_oss": dict(head_dim=32, attention_dropout=0.0),
    "hunyuan_v1_dense": dict(head_dim=32, use_qk_norm=True, attention_dropout=0.0),
    "exaone4": dict(head_dim=32, sliding_window=4096, sliding_window_pattern=4),
    "dots1": dict(n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=96, num_experts_per_tok=2,
                  first_k_dense_replace=0, head_dim=32),
    "glm4": dict(head_dim=32), "apertus": dict(qk_norm=True), "arcee": None,
    "olmo": dict(clip_qkv=8.0),  # OLMo 1.7's: q, k and v clamped in place
    "exaone_moe": dict(num_experts=8, moe_intermediate_size=96, num_experts_per_tok=2, head_dim=32,
                       first_k_dense_replace=0),
    "granite_swa": None, "granitemoe_swa": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96),
    "flex_olmo": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=96),
    "granitemoeshared": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96,
                             shared_intermediate_size=96),
    "afmoe": dict(num_experts=8, moe_intermediate_size=96, num_experts_per_tok=2, head_dim=32, num_dense_layers=0,
                  num_shared_experts=1),
    "hyperclovax": None, "jais2": None, "nanochat": None, "ernie4_5": dict(head_dim=32),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96),
    "cohere2_moe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=96, head_dim=32),
    "mellum": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, head_dim=32),
    "solar_open": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1,
                       head_dim=32),
    "kolibri1": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                     shared_expert_intermediate_size=96, head_dim=32),
    # GLM-4.5's (partial rotary, query and key norms) and MiniMax-M2's (query and key norms over all heads at once,
    # which its Transformers model runs whatever use_qk_norm says; partial rotary by rotary_dim; a sigmoid router).
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1,
                     first_k_dense_replace=0, head_dim=32, use_qk_norm=True),
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, head_dim=32, rotary_dim=16,
                       use_qk_norm=True, qk_norm_type="per_layer", bos_token_id=None, eos_token_id=None),
    # Latent attention: queries as wide as the values (GLM-4.7-Flash's 192 + 64 = 256), as CPU's flash kernel
    # needs; DeepSeek-V3's narrower values send CPU's SDPA to its math path, which keeps fp32 probabilities.
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=0, n_group=2, topk_group=1, num_key_value_heads=4, kv_lora_rank=32,
                        q_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32),
    "glm4_moe_lite": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1,
                          mlp_layer_types=["sparse", "sparse"], num_key_value_heads=4, kv_lora_rank=32,
                          q_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32),
    # Llama 4: experts of intermediate_size (its dense blocks' MLP: intermediate_size_mlp), top-1 as it routes,
    # every block an expert one (interleave_moe_layer_step 1); block 0 has RoPE and the L2 query/key norms.
    "llama4_text": dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=96, intermediate_size_mlp=352,
                        interleave_moe_layer_step=1, head_dim=32),
    # Gemma 4 (E2B's layout): its first layer a sliding one of head_dim (its full ones global_head_dim wide), with
    # per-layer inputs (hidden_size_per_layer_input) from a table of vocab_size_per_layer_input rows.
    "gemma4_text": dict(head_dim=32, global_head_dim=64, hidden_size_per_layer_input=64,
                        vocab_size_per_layer_input=512),
    "gemma4_unified_text": dict(head_dim=32, global_head_dim=64),
    # GPT-2 style names (n_inner: SHAPE's intermediate_size is not theirs). Their dropout is off: attention
    # dropout sends CPU's SDPA down its math path, and CPU's residual dropout keeps its mask in the input's
    # dtype where CUDA keeps a byte (memx counts CUDA's). StarCoder's one key-value head: multi_query.
    "gpt2": dict(n_inner=352, attn_pdrop=0.0, resid_pdrop=0.0),
    "gpt_bigcode": dict(n_inner=352, multi_query=True, num_key_value_heads=1, attn_pdrop=0.0, resid_pdrop=0.0),
    "phi": None, "nemotron": None,  # Phi-1/2's parallel block and partial rotary; LayerNorm1P and squared ReLU
    "bloom": None,  # ALiBi attention as torch ops (its dropouts 0 by default); no grouped queries
    "hy_v3": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, num_shared_experts=1, head_dim=32,
                  mlp_layer_types=["sparse", "sparse"]),
    # MiMo-V2-Flash: eager attention (no SDPA), sinks on its sliding layers (its first, full, has none).
    "mimo_v2_flash": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, head_dim=32,
                          v_head_dim=32, mlp_layer_types=["sparse", "sparse"]),
    "aria_text": dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=2, intermediate_size=96),
    "minimax_m3_vl_text": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96,
                               shared_intermediate_size=96, head_dim=32, rotary_dim=16, bos_token_id=None,
                               eos_token_id=None),
    "persimmon": dict(num_key_value_heads=4), "phi4_multimodal": None,  # Persimmon: no grouped queries
    "modernbert-decoder": dict(num_key_value_heads=4),  # its first layer has no attention norm (an nn.Identity)
    # OPT's, MPT's, GPT-J's and CodeGen's own names; none has grouped queries (SHAPE's 2 KV heads are not theirs).
    "opt": dict(ffn_dim=352, intermediate_size=None, num_key_value_heads=4, word_embed_proj_dim=128, dropout=0.0,
                attention_dropout=0.0),
    "mpt": dict(d_model=128, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=512, num_key_value_heads=4),
    "gptj": dict(n_embd=128, n_head=4, n_layer=2, rotary_dim=16, n_inner=352, num_key_value_heads=4, attn_pdrop=0.0,
                 resid_pdrop=0.0, embd_pdrop=0.0),
    "codegen": dict(n_embd=128, n_head=4, n_layer=2, rotary_dim=16, n_inner=352, num_key_value_heads=4,
                    attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "laguna": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=96,
                   head_dim=32, mlp_layer_types=["sparse", "sparse"]),  # its per-head softplus output gate: not modelled
}
BATCH, SEQ = 2, 80  # 160 tokens: no activation shaped as a weight (autocast's casts are told apart by shape)


def decoder_layers(model):
    """The decoder layers of a causal LM, wherever its family keeps them."""
    base = getattr(model, "model", None) or getattr(model, "gpt_neox", None) or model.transformer
    base = getattr(base, "decoder", base)  # OPT's
    return getattr(base, "layers", None) or getattr(base, "blocks", None) or base.h  # MPT's blocks


def layer_inputs(captured: dict):
    """A layer's input as a leaf and its other arguments, from what its pre-hook captured: a further input
    the model computes with gradients (Gemma 4's per-layer input, a view of one tensor of every layer's)
    the layer's own leaf of its own size; no mask or cache (causal attention)."""
    import torch

    args, kwargs = captured["args"], dict(captured["kwargs"])
    x = (args[0] if args else kwargs.pop("hidden_states")).detach().requires_grad_(True)
    args = tuple(a.detach().clone().requires_grad_(True) if torch.is_tensor(a) and a.requires_grad else a
                 for a in args[1:])
    kwargs.update({k: None for k in ("attention_mask", "past_key_values", "past_key_value") if k in kwargs})
    return x, args, kwargs


def kept_bytes(layer, x, args, kwargs) -> int:
    """What autograd saves in ``layer``'s forward, its parameters, their casts and its arguments aside."""
    import torch

    weights = {tuple(p.shape[::k]) for p in layer.parameters() for k in (1, -1)}
    arguments = [t for v in kwargs.values() for t in (v if isinstance(v, tuple) else (v,)) if torch.is_tensor(t)]
    # x * 1.0: an op's output, as the layer's input is in the model (autocast caches its casts of a
    # leaf: the linears that read the input would share one).
    return saved_storage_bytes(lambda: layer(x * 1.0, *args, **kwargs), owned=(*layer.parameters(), *arguments),
                               skip_shapes=weights)


def family_config(kind: str, fields: dict | None = None, **overrides):
    """The tiny config of family ``kind``: SHAPE, the family's ``fields`` (default its FAMILIES entry)
    and ``overrides``, with its causal LM's class as its architecture."""
    import transformers

    config = transformers.AutoConfig.for_model(kind, **{**SHAPE, **((FAMILIES[kind] if fields is None else fields)
                                                                   or {}), **overrides})
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    return config


def measure(kind: str, fields: dict | None, folder: str) -> dict:
    import torch
    import transformers

    config = family_config(kind, fields or {})
    config.save_pretrained(folder)
    spec = get_model(folder)
    torch.manual_seed(0)  # Transformers' default attention (SDPA; eager where it has none, as Gemma 2)
    model = transformers.AutoModelForCausalLM.from_config(config)  # a mixture's experts: grouped GEMMs, the default
    model.config.use_cache = False
    layers = decoder_layers(model)
    layer, captured = layers[0], [{} for _ in layers]
    hooks = [each.register_forward_pre_hook(lambda _m, args, kwargs, into=into: into.update(args=args, kwargs=kwargs),
                                            with_kwargs=True) for each, into in zip(layers, captured)]
    row = {"family": kind}
    for dtype in ("fp32", "bf16"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            model(torch.randint(1, SHAPE["vocab_size"], (BATCH, SEQ)))
            every = [kept_bytes(each, *layer_inputs(into)) for each, into in zip(layers, captured)]
            kept = every[0]
            x, args, kwargs = layer_inputs(captured[0])
            held = backward_held_bytes(layer, x, args, kwargs)
        training, read = own_block_training(TrainingSpec(setup="memx-run", dtype=dtype), layer, spec)
        counted, as_megatron = (float(cm.training_activation_bytes(spec, tr, BATCH, SEQ, 1, cm.NONE).activation_bytes)
                                for tr in (training, replace(training, transformers_blocks=False)))
        working = float(cm.training_activation_bytes(spec, training, BATCH, SEQ, 1, cm.NONE).working_bytes)
        row[dtype] = {"measured_bytes": kept, "counted_bytes": round(counted), "measured_over_counted":
                      round(kept / counted, 3), "measured_over_counted_as_megatron_blocks": round(kept / as_megatron, 3),
                      "every_layer_measured_over_counted": round(sum(every) / len(every) / counted, 3),
                      "working_measured_bytes": held, "working_counted_bytes": round(working),
                      "working_measured_over_counted": round(held / working, 3)}
        row["block_read"] = read
    for hook in hooks:
        hook.remove()
    return row


def _fresh_gradient():
    import torch

    class FreshGradient(torch.autograd.Function):
        """The identity, whose backward hands its input a fresh random gradient (the engine's alone)."""

        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return torch.randn(grad.shape, dtype=grad.dtype)

    return FreshGradient


def backward_held_bytes(layer, x, args, kwargs) -> int:
    """What the layer's second backward holds above what its forward kept, its incoming gradient
    included, its gradients allocated (as from a step's second micro-batch): the step's first forward
    made autocast's weight casts on the device (their cache is the step's: one autocast region)."""
    import math

    import torch

    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    torch.clear_autocast_cache()
    with EmulatedDevice("probe", math.inf) as device:
        device.track([*layer.parameters(), *(p.grad for p in layer.parameters()), x])
        layer(x * 1.0, *args, **kwargs)  # the step's first micro-batch: makes (and caches) the weights' casts
        out = layer(x * 1.0, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        device.reset_peak()
        before = device.live_bytes
        # The incoming gradient as the next layer's backward hands it on: the engine's alone, freed once the
        # layer's last op has used it (held here, it would count twice where that op copies it: Gemma 4's
        # layer_scalar multiply).
        _fresh_gradient().apply(out).sum().backward()
    for p in layer.parameters():
        p.grad = None
    return device.peak_bytes - before


def main() -> int:
    warnings.filterwarnings("ignore")
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, fields in FAMILIES.items():
            rows.append(measure(kind, fields, os.path.join(tmp, kind)))
            print(f"{kind:12s} kept: fp32 {rows[-1]['fp32']['measured_over_counted']:.3f}  "
                  f"bf16 {rows[-1]['bf16']['measured_over_counted']:.3f}; backward: "
                  f"fp32 {rows[-1]['fp32']['working_measured_over_counted']:.3f}  "
                  f"bf16 {rows[-1]['bf16']['working_measured_over_counted']:.3f}", flush=True)
    ratios = [r[d]["measured_over_counted"] for r in rows for d in ("fp32", "bf16")]
    within = {f"{p:.0%}": sum(abs(x - 1) <= p for x in ratios) for p in (0.01, 0.05, 0.10)}
    working = [r[d]["working_measured_over_counted"] for r in rows for d in ("fp32", "bf16")]
    every = [r[d]["every_layer_measured_over_counted"] for r in rows for d in ("fp32", "bf16")]
    import transformers
    write_json_atomic(OUT, {"machine": machine_info(), "transformers": transformers.__version__,
                            "tokens": BATCH * SEQ, "rows": rows,
                            "summary": {"layers_x_precisions": len(ratios), "within": within,
                                        "min": min(ratios), "max": max(ratios)},
                            "every_layer_summary": {"within": {f"{p:.0%}": sum(abs(x - 1) <= p for x in every)
                                                               for p in (0.01, 0.05, 0.10)},
                                                    "min": min(every), "max": max(every)},
                            "backward_summary": {"within": {f"{p:.0%}": sum(abs(x - 1) <= p for x in working)
                                                            for p in (0.01, 0.05, 0.10)},
                                                 "min": min(working), "max": max(working)},
                            "seconds": round(time.time() - start, 1)}, overwrite=True)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
