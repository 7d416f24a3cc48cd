"""Train your own nn.Module, with a block class memx has never seen, under the plan memx chose.

    memx-run --nproc-per-node 4 --cluster examples/clusters/cpu-emulated.yaml \\
        examples/train_own_model.py --model examples/models/own-gpt-tiny
    python examples/train_own_model.py --reference      # the whole model in one process

memx finds the blocks (the largest list of same-class modules: ``blocks`` here), runs what is
registered before them (the embedding) on the first stage and what is registered after them (norm,
head) on the last, and checks that reading against the model's own forward once at start. The
shape memx-run plans for comes from a GPT-2 style config.json (n_layer, n_embd, n_head, n_inner).
TP stays 1 for a block class memx does not know; "selective" recompute recomputes the whole block.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from train_hf import main

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "own-gpt-tiny")


class OwnBlock(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP."""

    def __init__(self, width: int, heads: int, inner: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, inner), nn.GELU(), nn.Linear(inner, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class OwnModel(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, inner: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(OwnBlock(width, heads, inner) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(model_dir: str, seed: int) -> OwnModel:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    torch.manual_seed(seed)  # every rank builds the same weights
    return OwnModel(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_inner"], cfg["vocab_size"])


if __name__ == "__main__":
    sys.exit(main(build, __doc__, DEFAULT_MODEL))
