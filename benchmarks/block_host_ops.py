"""How much host work an eager transformer block issues: Megatron-Core's local TransformerLayer
(plain torch modules, no Transformer Engine: the code family of Megatron-LM's and Megatron-
DeepSpeed's eager layers) run forward and backward on this CPU in bf16, every ATen op it dispatches
counted (a TorchDispatchMode), TP 1. The base block is GPT's (fused LayerNorm, biased linears,
GELU, no dropout, learned positions, unfused attention: Megatron's baddbmm, torch's masked softmax,
bmm); each variant changes one option memx prices, and its count less the base's is what the option
adds (checked additive: every option at once is the base plus the sum):

- ``hidden_dropout`` (memx ``dropout``), ``attention_dropout``, ``softmax_in_fp32`` (the scores'
  fp32 copy), ``rotary`` (rotary embeddings: a model without learned positions), ``gated``
  (SwiGLU, gate and up as one linear), ``no_biases`` (``linear_biases`` off);
- ``flash_attention``: the core attention as one fused kernel (torch's scaled_dot_product_attention,
  its inputs transposed to [b, h, s, d] and back, as Megatron-DeepSpeed's flash path does);
- ``torch_norm``: both norms as Hugging Face's LlamaRMSNorm (torch ops) instead of one kernel each
  (memx ``fused_norm`` off).

The MLP's own ops are counted too (GELU or SwiGLU, biased or not): a mixture of experts replaces
them by its MoE layer's (``benchmarks/moe_host_ops.py``). Another framework's block as a check:
Hugging Face's LlamaDecoderLayer (SDPA or eager attention) against the sum of its options' counts. Also timed: the host seconds per op of the
base and of a LLaMA-style block (least of several steps, taking turns), beside the MoE layer's 14 us.
``memx_launch.planning.host_time`` prices an eager block (``--eager-block``) from these counts
(``EAGER_BLOCK_OPS``); a test holds the constants to this file. Not counted: the TP collectives
(four c10d calls per layer where TP > 1), Megatron's fused scale-mask-softmax kernel (counted as
torch's path), separate gate and up linears, query/key norms and parallel blocks.

Writes benchmarks/results/block_host_ops.json.
Run: .venv/bin/python benchmarks/block_host_ops.py   (seconds, after megatron-core's import)
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.moe_host_ops import forward_backward_ops, start_megatron_on_cpu  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

OUT = os.path.join(HERE, "results", "block_host_ops.json")
SEQ, BATCH, HIDDEN, HEADS = 16, 2, 64, 4
BASE = dict(add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=False)
# One option at a time against the base: (TransformerConfig fields, rotary, flash, torch-op norms).
VARIANTS = {
    "hidden_dropout": (dict(hidden_dropout=0.1), False, False, False),
    "attention_dropout": (dict(attention_dropout=0.1), False, False, False),
    "softmax_in_fp32": (dict(attention_softmax_in_fp32=True), False, False, False),
    "rotary": ({}, True, False, False),
    "gated": (dict(gated_linear_unit=True, activation_func=F.silu), False, False, False),
    "no_biases": (dict(add_bias_linear=False), False, False, False),
    "flash_attention": ({}, False, True, False),
    "torch_norm": ({}, False, False, True),
}
ROUNDS, STEPS_PER_ROUND = 8, 4


class SdpaCoreAttention(torch.nn.Module):
    """The core attention as one fused kernel, Megatron's [s, b, h, d] in and [s, b, h * d] out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class TorchOpRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: the norm in separate torch ops on an fp32 copy."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, x):
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(x.dtype)


def block(config_fields: dict, flash: bool, torch_norm: bool, dtype=torch.bfloat16):
    """Megatron-Core's local TransformerLayer with ``config_fields`` over the base, in ``dtype``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
                               use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                               **{**BASE, **config_fields})
    spec = get_gpt_layer_local_spec()
    if flash:
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SdpaCoreAttention)
    if torch_norm:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ModuleSpec(module=TorchOpRMSNorm)
    return build_module(spec, config=config, layer_number=1).to(dtype)


def _inputs(rotary: bool, dtype=torch.bfloat16):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype, requires_grad=True)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    return x, dict(attention_mask=mask, rotary_pos_emb=RotaryEmbedding(HIDDEN // HEADS, 1.0)(SEQ) if rotary else None)


def _step(module, x, kwargs):
    out = module(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out


def _with_bias(out, bias):
    """A Megatron linear's output with its returned bias added (the layer adds it after)."""
    return out if bias is None else out + bias


def count_ops(module, rotary: bool) -> tuple[int, int]:
    """ATen ops one forward and one backward of a block dispatch."""
    x, kwargs = _inputs(rotary)
    return forward_backward_ops(lambda: _step(module, x, kwargs))


def hugging_face_llama_ops(attention: str) -> tuple[int, int]:
    """ATen ops one forward and backward of Hugging Face's LlamaDecoderLayer dispatch (bf16, its
    torch-op RMSNorm, rotary embeddings, SwiGLU, no biases) with ``attention`` "sdpa" (one fused
    kernel) or "eager" (matmuls and an fp32 softmax): another framework's block, against what the
    options' counts add up to."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, num_hidden_layers=1)
    config._attn_implementation = attention
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    causal = torch.triu(torch.full((SEQ, SEQ), float("-inf"), dtype=torch.bfloat16), 1)[None, None]
    kwargs = dict(position_embeddings=LlamaRotaryEmbedding(config)(x, positions), position_ids=positions,
                  attention_mask=causal.expand(BATCH, 1, SEQ, SEQ) if attention == "eager" else None)
    return forward_backward_ops(lambda: _step(layer, x, kwargs))


def host_seconds(modules) -> list[float]:
    """Fewest seconds one forward and backward of each of ``(module, rotary)`` took, taking turns
    over several rounds (a shared host's other work only ever adds to a step)."""
    best = [float("inf")] * len(modules)
    for _ in range(ROUNDS):
        for i, (module, rotary) in enumerate(modules):
            x, kwargs = _inputs(rotary, torch.float32)
            for step in range(STEPS_PER_ROUND + 1):  # the first of each turn warms up
                start = time.perf_counter()
                _step(module, x, kwargs).float().sum().backward()
                if step:
                    best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    megatron_version = start_megatron_on_cpu(29562)
    from megatron.core import tensor_parallel

    class _NoRngTracker:  # dropout's CUDA RNG fork: the CPU's generator instead
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: _NoRngTracker()
    started = time.perf_counter()
    torch.manual_seed(0)
    base = count_ops(block({}, False, False), False)
    added = {}
    for name, (fields, rotary, flash, torch_norm) in VARIANTS.items():
        forward, backward = count_ops(block(fields, flash, torch_norm), rotary)
        added[name] = [forward - base[0], backward - base[1]]
        print(f"{name:18s} {added[name][0]:+4d} forward {added[name][1]:+4d} backward", flush=True)
    # Additive: every option at once is the base plus what each adds (the attention dropout and the
    # fp32 softmax exist only without fused attention, the fused kernel only with it).
    every, as_sum = {}, {}
    for flash in (False, True):
        unused = ("attention_dropout", "softmax_in_fp32") if flash else ("flash_attention",)
        fields = {k: v for name, (f, *_) in VARIANTS.items() if name not in unused for k, v in f.items()}
        key = "fused attention" if flash else "unfused attention"
        every[key] = list(count_ops(block(fields, flash, True), True))
        as_sum[key] = [base[i] + sum(a[i] for name, a in added.items() if name not in unused) for i in (0, 1)]
    mlp = {}
    for gated in (False, True):
        for biases in (True, False):
            fields = dict(add_bias_linear=biases, **(dict(gated_linear_unit=True, activation_func=F.silu) if gated else {}))
            mlp_of_block = block(fields, False, False).mlp
            x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
            mlp[f"{'swiglu' if gated else 'gelu'}{'' if biases else ' no biases'}"] = list(
                forward_backward_ops(lambda: _with_bias(*mlp_of_block(x))))
    # Hugging Face's LLaMA block against the counts' sum for its options (torch-op norms, rotary,
    # SwiGLU, no biases; SDPA's fused kernel, or eager attention with its fp32 softmax).
    hugging_face = {}
    for attention, options in (("sdpa", ("flash_attention",)), ("eager", ("softmax_in_fp32",))):
        summed = [base[i] + sum(added[name][i] for name in ("torch_norm", "rotary", "gated", "no_biases", *options))
                  for i in (0, 1)]
        counted = list(hugging_face_llama_ops(attention))
        hugging_face[attention] = {"counted": counted, "options_sum": summed,
                                   "counted_over_sum": round(sum(counted) / sum(summed), 3)}
    llama_fields = dict(add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu)
    llama = block(llama_fields, True, False)
    llama_ops = count_ops(llama, True)
    # Timed in fp32: a few tokens of CPU arithmetic, the host's work only.
    timed = host_seconds([(block({}, False, False, torch.float32), False),
                          (block(llama_fields, True, False, torch.float32), True)])
    per_op = {"gpt": round(timed[0] * 1e6 / sum(base), 1), "llama": round(timed[1] * 1e6 / sum(llama_ops), 1)}
    dist.destroy_process_group()
    result = {
        "machine": machine_info(),
        "megatron_core": megatron_version,
        "torch": torch.__version__,
        "block": "Megatron-Core's local TransformerLayer (get_gpt_layer_local_spec), bf16 on CPU, TP 1, "
                 f"hidden {HIDDEN}, {HEADS} heads, {SEQ} tokens x {BATCH}: the base is GPT's (fused LayerNorm, "
                 "biased linears, GELU, unfused attention with torch's masked softmax, no dropout, learned positions)",
        "base": list(base),
        "added_by_option": added,
        "every_option": every,
        "every_option_as_sum": as_sum,
        "mlp": mlp,
        "llama_block": {"ops": list(llama_ops), "options": "rotary, SwiGLU, no biases, fused attention, fused norms"},
        "hugging_face_llama": hugging_face,
        # What the base and the LLaMA-style block cost the host per op on this CPU (least of several steps).
        "host_us_per_op": per_op,
        "host_ms_this_cpu": {"gpt": round(timed[0] * 1e3, 3), "llama": round(timed[1] * 1e3, 3)},
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_json_atomic(OUT, result, overwrite=True)
    print(f"base {base}, every option {every} (sum {as_sum}), MLP {mlp}, Hugging Face {hugging_face}, "
          f"host us per op {per_op} -> {OUT}")


if __name__ == "__main__":
    main()
