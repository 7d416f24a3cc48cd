"""What a Hugging Face causal LM's own forward does around its blocks, done the same way on
memx's stages: the embeddings before them (:class:`HFEmbedding`), each block's mask and rotary
table by its attention type (:class:`BlockInputs`: full, sliding-window or chunked, Transformers'
``layer_types``; Gemma 3's rotary table per type), and what the LM does to its head's logits
(:class:`LogitTransform`: Gemma 2 and 3's soft cap, Cohere's and Granite's scales)."""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from memx_launch.errors import ConfigError


class HFEmbedding(nn.Module):
    """A Hugging Face decoder's forward up to its blocks: the decoder itself (same modules, no
    copies of weights) with no blocks and no final modules, so that token and position embeddings,
    scaling and dropout are exactly the model's."""

    def __init__(self, decoder: nn.Module, blocks_name: str, finals: list[str]):
        super().__init__()
        shell = copy.copy(decoder)  # the modules dict is replaced below, never the decoder's own
        shell._modules = {**decoder._modules, blocks_name: nn.ModuleList(),
                          **{name: nn.Identity() for name in finals}}
        self.decoder = shell

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids=tokens, use_cache=False).last_hidden_state


def layer_types(config, num_layers: int) -> list[str]:
    """Each block's attention as its model masks it: the config's ``layer_types`` (Qwen2 and 3,
    Gemma 2 and 3, GPT-OSS, Llama 4), else one kind for all, a sliding window where the config
    gives one (Mistral's, Mixtral's and Phi-3's forward)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[:num_layers]
    return ["full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"] * num_layers


class BlockInputs:
    """The keyword arguments a stage's blocks take besides the hidden state, by attention type,
    built once per forward as the model's own forward builds them: positions, the mask of that
    type (with the batch's padding where there is a padding mask) and the rotary table."""

    def __init__(self, config, rotary: nn.Module | None, types: set[str]):
        from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

        self.config, self.rotary = config, rotary
        self.masks = {t: LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(t) for t in types}
        unknown = sorted(t for t, make in self.masks.items() if not callable(make))
        if unknown:
            raise ConfigError("model", f"blocks of attention type {', '.join(unknown)}, which memx cannot mask as "
                              "the model does", "use a model of full, sliding-window or chunked attention blocks")
        self.rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def __call__(self, h: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, dict]:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        shared = None if self.rotary is None or self.rotary_by_type else self.rotary(h, positions)
        out = {}
        for kind, make in self.masks.items():
            mask = make(config=self.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                        position_ids=positions)
            out[kind] = {"attention_mask": mask, "position_ids": positions}
            if self.rotary is not None:
                out[kind]["position_embeddings"] = self.rotary(h, positions, kind) if self.rotary_by_type else shared
        return out


class LogitTransform(nn.Module):
    """What a causal LM's forward does to its head's logits: divide by ``logits_scaling`` (Granite),
    multiply by ``logit_scale`` (Cohere), then soft-cap them at ``final_logit_softcapping``
    (Gemma 2 and 3: ``cap * tanh(logits / cap)``)."""

    def __init__(self, divisor: float, multiplier: float, softcap: float | None):
        super().__init__()
        self.divisor, self.multiplier, self.softcap = divisor, multiplier, softcap

    @classmethod
    def of(cls, lm: nn.Module) -> "LogitTransform | None":
        config = lm.config
        divisor = getattr(config, "logits_scaling", None) or 1.0
        multiplier = getattr(config, "logit_scale", None) or 1.0
        softcap = getattr(config, "final_logit_softcapping", None)
        return None if divisor == multiplier == 1.0 and softcap is None else cls(divisor, multiplier, softcap)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
