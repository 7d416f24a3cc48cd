"""What a Hugging Face causal LM's own forward does around its blocks, done the same way on
memx's stages (the LM found as the one whose decoder holds them: :func:`hf_causal_lm`): on the
first stage, its decoder's own forward up to the blocks, which records what the model passes each
block (:class:`HFEmbedding`); on a later stage, which has neither the token ids nor the
embedding's weights, the arguments that do not depend on them rebuilt as the model builds them
(:class:`BlockInputs`: each block's mask and rotary table by its attention type, full,
sliding-window or chunked, Transformers' ``layer_types``; ALiBi biases; Gemma 4's key-value
store); and what the LM does to its head's logits (:class:`LogitTransform`: Gemma 2 and 3's soft
cap, Cohere's and Granite's scales)."""

from __future__ import annotations

import copy
import inspect
import sys

import torch
from torch import nn

from memx_launch.errors import ConfigError


class _Recorded(Exception):
    """The decoder's forward reached the last block a stage runs: every block's arguments are recorded."""


class _Recording:
    """What the block stand-ins of one forward recorded, and after how many blocks it stops."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, tuple, dict]] = []
        self.stop = 1


class _BlockStandIn(nn.Module):
    """Stands in for a block in the decoder's own forward: keeps the hidden state and the other
    arguments the model passes it, and stops the forward at the last block the stage runs."""

    def __init__(self, recording: _Recording):
        super().__init__()
        self.recording = recording

    def forward(self, hidden_states, *args, **kwargs):
        self.recording.calls.append((hidden_states, args, kwargs))
        if len(self.recording.calls) == self.recording.stop:
            raise _Recorded
        return hidden_states


class HFEmbedding(nn.Module):
    """A Hugging Face decoder's forward up to its blocks: the decoder itself (same modules, no copies
    of weights) whose blocks are stand-ins, so that embeddings, learned positions, scaling, dropout
    and a norm before the blocks (nanochat's) are exactly the model's, and so are the arguments it
    passes each block (masks, rotary tables, ALiBi biases, Gemma 4's per-layer inputs and key-value
    store). Its final modules that hold weights are left out (the last stage holds them); the
    forward stops at the stage's last block, before any final module runs."""

    def __init__(self, decoder: nn.Module, blocks_name: str, num_blocks: int, finals: list[str]):
        super().__init__()
        self.recording = _Recording()
        shell = copy.copy(decoder)  # the modules dict is replaced below, never the decoder's own
        weighted = [name for name in finals if any(True for _ in getattr(decoder, name).parameters())]
        shell._modules = {**decoder._modules,
                          blocks_name: nn.ModuleList(_BlockStandIn(self.recording) for _ in range(num_blocks)),
                          **{name: nn.Identity() for name in weighted}}
        self.decoder = shell

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                blocks: int = 1) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
        """The hidden state entering the first block, and the arguments beside it of each of the
        first ``blocks`` blocks, as the model's forward gives them."""
        self.recording.calls, self.recording.stop = [], blocks
        try:
            self.decoder(input_ids=tokens, attention_mask=attention_mask, use_cache=False)
        except _Recorded:
            calls = self.recording.calls
            self.recording.calls = []  # holds no tensor past the forward
            return calls[0][0], [(args, kwargs) for _, args, kwargs in calls]
        raise ConfigError("model", f"{type(self.decoder).__name__}'s forward did not run its blocks",
                          "give memx a model whose forward is embedding -> blocks -> head")


def hf_causal_lm(model: nn.Module, container: nn.Module) -> tuple[nn.Module, str] | None:
    """The Hugging Face causal LM whose decoder holds ``container`` as its blocks, and its name
    prefix inside ``model``; None when the blocks are not such a model's. The decoder is the module
    holding the blocks, not ``get_decoder()``'s guess (Llama 4's and ModernBERT's name it wrong)."""
    for name, module in model.named_modules():
        if callable(getattr(module, "get_output_embeddings", None)) and callable(getattr(module, "get_decoder", None)) \
                and module.get_output_embeddings() is not None \
                and any(child is container for inner in module.modules() if inner is not module
                        for child in inner.children()):
            return module, name + "." if name else ""
    return None


def layer_types(config, num_layers: int) -> list[str]:
    """Each block's attention as its model masks it: the config's ``layer_types`` (Qwen2 and 3,
    Gemma 2 and 3, GPT-OSS, Llama 4), else one kind for all, a sliding window where the config
    gives one (Mistral's, Mixtral's and Phi-3's forward)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[:num_layers]
    return ["full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"] * num_layers


def _alibi(config, module, h, attention_mask):
    """BLOOM's ALiBi biases: its model's ``build_alibi_tensor`` over the padding mask (all ones without one)."""
    mask = attention_mask if attention_mask is not None else torch.ones(h.shape[:2], device=h.device)
    return module.build_alibi_tensor(mask, config.n_head, h.dtype)


def _position_bias(config, module, h, attention_mask):
    """MPT's ALiBi biases, as its model builds them (over its ``max_seq_len``)."""
    return module.build_mpt_alibi_tensor(config.n_heads, config.max_seq_len, device=h.device)


def _kv_store(config, module, h, attention_mask):
    """Gemma 4's store of the keys and values its sharing layers reuse: empty at the stage's start
    (a layer reusing another stage's is refused: ``ModelParts.stage``)."""
    from transformers.cache_utils import KVSharingDict

    return KVSharingDict()


def _per_layer_input(config, module, h, attention_mask):
    """Gemma 4's per-layer input, made from the token ids on the first stage: only calibration's
    probe runs such a block on a later stage (``ModelParts.stage`` refuses one), given zeros of its
    width, which change nothing of what the block keeps or how long it runs. None where its config
    has none (Gemma 4's 31B and 26B-A4B)."""
    width = getattr(config, "hidden_size_per_layer_input", 0)
    if not width:
        return None
    return torch.zeros(*h.shape[:2], width, dtype=h.dtype, device=h.device)


# A later stage's block arguments that are neither masks nor rotary tables, by the block's parameter name.
LATER_STAGE_INPUTS = {"alibi": _alibi, "position_bias": _position_bias, "shared_kv_states": _kv_store,
                      "per_layer_input": _per_layer_input}
# Blocks whose model passes them its mask as booleans, True where a score is masked (MPT's forward casts
# its additive mask so).
BOOLEAN_MASK_BLOCKS = ("MptBlock",)


class BlockInputs:
    """The keyword arguments a later stage's blocks take besides the hidden state, by attention type,
    built once per forward as the model's own forward builds them: positions, the mask of that
    type (with the batch's padding where there is a padding mask), the rotary table, and what else
    its blocks take (:data:`LATER_STAGE_INPUTS`)."""

    def __init__(self, config, rotary: nn.Module | None, types: set[str], block: nn.Module):
        from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

        self.config, self.rotary = config, rotary
        self.masks = {t: LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(t) for t in types}
        unknown = sorted(t for t, make in self.masks.items() if not callable(make))
        if unknown:
            raise ConfigError("model", f"blocks of attention type {', '.join(unknown)}, which memx cannot mask as "
                              "the model does", "use a model of full, sliding-window or chunked attention blocks")
        self.rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        taken = inspect.signature(block.forward).parameters
        self.module = sys.modules[type(block).__module__]
        self.others = {name: make for name, make in LATER_STAGE_INPUTS.items() if name in taken}
        self.boolean_mask = type(block).__name__ in BOOLEAN_MASK_BLOCKS

    def __call__(self, h: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, dict]:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        shared = None if self.rotary is None or self.rotary_by_type else self.rotary(h, positions)
        others = {name: make(self.config, self.module, h, attention_mask)
                  for name, make in self.others.items()}
        out = {}
        for kind, make in self.masks.items():
            mask = make(config=self.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                        position_ids=positions)
            mask = mask.to(torch.bool) if self.boolean_mask else mask
            out[kind] = {"attention_mask": mask, "position_ids": positions, **others}
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
