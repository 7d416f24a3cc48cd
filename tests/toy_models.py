"""Models a user brings: a Hugging Face Llama from a small config, and a module with its own block class."""

import os

import torch
import torch.nn.functional as F
from torch import nn

from memx_launch.specs.model import ModelSpec

HF_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "models",
                       "hf-llama-tiny")
TOY_SPEC = ModelSpec("toy", 4, 64, 4, 4, 256, 128, 32, gated_mlp=False)


def hf_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig.from_pretrained(HF_TINY))


class ToyBlock(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP: a block class memx does not know."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class ToyModel(nn.Module):
    def __init__(self, spec: ModelSpec = TOY_SPEC, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(spec.hidden_size, spec.num_heads) for _ in range(spec.num_layers))
        self.norm = nn.LayerNorm(spec.hidden_size)
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens):
        return self.head(self.embed(tokens))
