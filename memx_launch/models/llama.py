"""A LLaMA-style decoder built per pipeline stage, with per-stage activation recompute.

Weights are initialised from a generator seeded by (seed, global layer index), so a stage
built on any rank under any layer split holds exactly the weights of the single-process
reference model: the equivalence tests and checkpoint resume across plans rely on it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memx_launch.errors import ConfigError
from memx_launch.models.checkpointing import op_level_checkpoint
from memx_launch.planning.plan import RECOMPUTE_LEVELS, layer_recompute_levels
from memx_launch.specs.local_attention import attends_locally
from memx_launch.specs.model import ModelSpec

ROPE_THETA = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02
# Generator tags for the parts that are not transformer blocks (blocks use their layer index).
EMBEDDING_TAG = -1
HEAD_TAG = -2


def _generator(seed: int, tag: int) -> torch.Generator:
    # Large odd multiplier keeps (seed, tag) pairs from colliding for any realistic layer count.
    return torch.Generator().manual_seed(seed * 1_000_003 + tag + 3)


def _rope_tables(seq_len: int, head_dim: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [b, heads, s, d] by the position angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


def local_attention_mask(seq_len: int, window: int, chunk: int, device) -> torch.Tensor:
    """[s, s] True where query i may attend key j: causally, within the ``window`` last tokens
    (Mistral's and Gemma's sliding windows: i - j < window) or within its chunk of ``chunk``
    tokens (Llama 4's chunked attention)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window:
        allowed &= i - j < window
    if chunk:
        allowed &= i // chunk == j // chunk
    return allowed


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """RoPE plus causal scaled-dot-product attention on [b, heads, s, d], within a window or a
    chunk where given; the part that selective recompute drops (it holds the s^2-sized
    intermediates)."""
    cos, sin = _rope_tables(q.shape[2], q.shape[3], q.device, q.dtype)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    gqa = q.shape[1] != k.shape[1]
    s = q.shape[2]
    if (window and window < s) or (chunk and chunk < s):
        mask = local_attention_mask(s, window, chunk, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Attention(nn.Module):
    """Causal self-attention; ``local``: within the model's sliding window or chunk."""

    def __init__(self, spec: ModelSpec, local: bool = False):
        super().__init__()
        self.head_dim = spec.head_dim
        self.window, self.chunk = (spec.sliding_window, spec.attention_chunk_size) if local else (0, 0)
        self.wq = nn.Linear(spec.hidden_size, spec.q_hidden_size, bias=spec.qkv_bias)  # Qwen2's biases
        self.wk = nn.Linear(spec.hidden_size, spec.kv_hidden_size, bias=spec.qkv_bias)
        self.wv = nn.Linear(spec.hidden_size, spec.kv_hidden_size, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.q_hidden_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, selective: bool) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts follow from the projections' local output widths, so the same code runs
        # on a tensor-parallel shard (wq/wk/wv split column-wise) and on the whole layer.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if selective:
            out = checkpoint(_attention_core, q, k, v, self.window, self.chunk, use_reentrant=False)
        else:
            out = _attention_core(q, k, v, self.window, self.chunk)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.w3 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, selective: bool) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        hidden = checkpoint(_swiglu, gate, up, use_reentrant=False) if selective else _swiglu(gate, up)
        return self.w2(hidden)


def per_layer(recompute: str | list[str], num_layers: int) -> list[str]:
    """The level of each layer: from a stage's recompute text (``full:K`` the first K), or given."""
    levels = layer_recompute_levels(recompute, num_layers) if isinstance(recompute, str) else list(recompute)
    if len(levels) != num_layers:
        raise ConfigError("recompute", f"{len(levels)} levels for {num_layers} layers", "give one level per layer")
    return levels


class TransformerBlock(nn.Module):
    """RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU -> residual.

    ``recompute``: "none" keeps every activation; "selective" recomputes the attention core
    and the SwiGLU element-wise product in the backward pass (``selective_policy`` "op":
    torchtitan's op-level policy instead, :mod:`memx_launch.models.checkpointing`; "block": the
    whole block, as "full"); "full" keeps only the block input. ``local_attention``: the block attends within the model's
    window or chunk (:func:`~memx_launch.specs.local_attention.attends_locally`).
    """

    def __init__(self, spec: ModelSpec, recompute: str = "none", selective_policy: str = "attention",
                 local_attention: bool = False):
        super().__init__()
        if not spec.gated_mlp:
            raise ConfigError("model.gated_mlp", f"{spec.name} uses a GELU MLP",
                              "the torch-native runtime builds LLaMA (SwiGLU) models only")
        if spec.num_experts:
            raise ConfigError("model.num_experts", f"{spec.name} is a mixture of experts, which memx's LLaMA block "
                              "does not build", "train the model's own module (its config.json as --model, "
                              "memx_launch.prepare in your script), or plan it with memx plan for Megatron-LM")
        if spec.hybrid_pattern:  # its layers are Mamba, attention, MLP or experts alone, not blocks
            raise ConfigError("model.hybrid_pattern", f"{spec.name} is a hybrid model",
                              "the torch-native runtime builds LLaMA blocks only: plan it with memx plan and "
                              "run it with Megatron-LM (memx export)")
        self.attention_norm = nn.RMSNorm(spec.hidden_size, eps=NORM_EPS)
        self.attention = Attention(spec, local_attention)
        self.ffn_norm = nn.RMSNorm(spec.hidden_size, eps=NORM_EPS)
        self.feed_forward = FeedForward(spec)
        self.recompute = recompute
        self.selective_policy = selective_policy

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, level: str) -> None:
        if level not in RECOMPUTE_LEVELS:
            raise ConfigError("recompute", f"unknown level {level!r}", f"use one of {', '.join(RECOMPUTE_LEVELS)}")
        self._recompute = level

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        selective = self._recompute == "selective" and self.selective_policy == "attention"
        h = x + self.attention(self.attention_norm(x), selective)
        return h + self.feed_forward(self.ffn_norm(h), selective)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._recompute == "full" or (self._recompute == "selective" and self.selective_policy == "block"):
            return checkpoint(self._block, x, use_reentrant=False)
        if self._recompute == "selective" and self.selective_policy == "op":
            return op_level_checkpoint(self._block, x)
        return self._block(x)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, num_layers: int) -> None:
        """GPT-2/LLaMA style: N(0, 0.02), output projections scaled by 1/sqrt(2 * layers)."""
        out_std = INIT_STD / math.sqrt(2 * num_layers)
        for linear, std in ((self.attention.wq, INIT_STD), (self.attention.wk, INIT_STD),
                            (self.attention.wv, INIT_STD), (self.attention.wo, out_std),
                            (self.feed_forward.w1, INIT_STD), (self.feed_forward.w3, INIT_STD),
                            (self.feed_forward.w2, out_std)):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class LlamaStage(nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of the model, plus the token embedding
    when ``first`` and the final norm and (untied) LM head when ``last``.

    Takes token ids [b, s] on the first stage and hidden states [b, s, h] otherwise; returns
    logits [b, s, vocab] on the last stage and hidden states otherwise.
    """

    def __init__(self, spec: ModelSpec, num_layers: int, *, first: bool, last: bool,
                 recompute: str | list[str] = "none", layer_offset: int = 0, seed: int = 0,
                 selective_policy: str = "attention"):
        super().__init__()
        if num_layers < 0 or layer_offset < 0 or layer_offset + num_layers > spec.num_layers:
            raise ConfigError("num_layers", f"layers [{layer_offset}, {layer_offset + num_layers}) "
                              f"exceed the model's {spec.num_layers}", "split the model's layers across stages")
        self.spec = spec
        self.first, self.last = first, last
        self.layer_offset = layer_offset
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        # Keyed by global layer index, so checkpoints keep their names under any split.
        levels = per_layer(recompute, num_layers)
        self.layers = nn.ModuleDict({str(layer_offset + i): TransformerBlock(
            spec, levels[i], selective_policy, attends_locally(spec, layer_offset + i)) for i in range(num_layers)})
        self.norm = nn.RMSNorm(spec.hidden_size, eps=NORM_EPS) if last else None
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None
        self.reset_parameters(seed)

    @classmethod
    def full(cls, spec: ModelSpec, recompute: str | list[str] = "none", seed: int = 0,
             selective_policy: str = "attention") -> "LlamaStage":
        """The whole model in one module: the single-process reference."""
        return cls(spec, spec.num_layers, first=True, last=True, recompute=recompute, seed=seed,
                   selective_policy=selective_policy)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        if self.tok_embeddings is not None:
            self.tok_embeddings.weight.copy_(
                torch.randn(self.tok_embeddings.weight.shape, generator=_generator(seed, EMBEDDING_TAG)) * INIT_STD)
        for index, block in self.layers.items():
            block.reset_parameters(_generator(seed, int(index)), self.spec.num_layers)
        if self.last:
            self.norm.reset_parameters()
            self.output.weight.copy_(
                torch.randn(self.output.weight.shape, generator=_generator(seed, HEAD_TAG)) * INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.last:
            h = self.output(self.norm(h))
        return h


def apply_tensor_parallel(module: nn.Module, tp_mesh) -> nn.Module:
    """Megatron-style TP through DTensor in every block of ``module``: wq/wk/wv/w1/w3 split by
    output columns, wo/w2 by input rows (one all-reduce after attention and after the MLP)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    for block in module.modules():
        if not isinstance(block, TransformerBlock):
            continue
        heads = block.attention.wq.out_features // block.attention.head_dim
        kv_heads = block.attention.wk.out_features // block.attention.head_dim
        if heads % tp or kv_heads % tp:
            raise ConfigError("tp", f"{tp} does not divide the {heads} heads and {kv_heads} KV heads",
                              "choose a TP degree that divides num_kv_heads")
        if block.feed_forward.w1.out_features % tp:
            raise ConfigError("tp", f"{tp} does not divide ffn_hidden_size={block.feed_forward.w1.out_features}",
                              "choose a TP degree that divides the FFN width")
        parallelize_module(block, tp_mesh, plan)
    return module
