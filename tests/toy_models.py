"""Models a user brings: a Hugging Face Llama from a small config, and a module with its own block class."""

import os
import sys

import torch
from torch import nn

from memx_launch.specs.model import ModelSpec

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
HF_TINY = os.path.join(EXAMPLES, "models", "hf-llama-tiny")
TOY_SPEC = ModelSpec("toy", 4, 64, 4, 4, 256, 128, 32, gated_mlp=False)

sys.path.insert(0, EXAMPLES)  # the examples import each other as siblings
from train_own_model import OwnModel  # noqa: E402


def hf_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig.from_pretrained(HF_TINY))


def hf_example(name: str, seed: int = 0, **config):
    """examples/models/<name>'s causal LM (hf-gpt2-tiny, hf-qwen2-tiny: tied embeddings), its
    config.json's values replaced by ``config``'s."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.join(EXAMPLES, "models", name),
                                                                       **config))


class ToyModel(OwnModel):
    """examples/train_own_model.py's model (a block class memx does not know) at TOY_SPEC."""

    def __init__(self, spec: ModelSpec = TOY_SPEC, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__(spec.num_layers, spec.hidden_size, spec.num_heads, 4 * spec.hidden_size, spec.vocab_size)


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens):
        return self.head(self.embed(tokens))
