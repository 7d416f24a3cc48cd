"""A plan applied to the user's own nn.Module: its transformer blocks, the parts before and after
them, pipeline stages with uneven layer counts, per-stage activation recompute and tensor parallel.

What is found (:class:`ModelParts`):

- the blocks: the ModuleList (or ModuleDict) the user names with ``blocks="path"``, else the first
  of ``model.layers`` (Hugging Face decoders, memx's LlamaStage), ``layers`` (torchtitan style),
  ``transformer.h``, else the largest list of modules of one class;
- Hugging Face causal LMs (``*ForCausalLM``: GPT-2, OPT, Llama 1-4, Mistral, Qwen2 and 3, Gemma
  1-4, Phi and any other whose decoder holds the blocks): before the blocks, the decoder's own
  forward up to them (embeddings, learned positions, scaling, dropout and a norm before the
  blocks as the model does them), which records what it passes each block; after them, the final
  norm (OPT: and projection) and the LM head; on a later stage the blocks' arguments rebuilt as
  the model builds them (positions, rotary tables, masks by attention type with the batch's padding
  mask, ALiBi biases, Gemma 4's key-value store). Gemma 4's E models (per-layer inputs made from
  the token ids) run on one stage only;
- any other model: the modules registered before the blocks (in each module on the path from the
  root to the blocks) run before them, in registration order, and those registered after run after
  them, innermost first.

``verify`` runs the whole module against this reading on a small input and raises when they
differ, so a forward that does more is caught at start. Tied embeddings (the head holding the
embedding's weight) are :attr:`ModelParts.tied`: one parameter when one stage holds both ends,
else a copy on the first and the last stage whose gradients the runtime sums every step.

A stage (:class:`StageModule`) keeps the user's module objects (their weights, pretrained or not)
under names that do not depend on the split (``blocks.{global index}``), so checkpoints load under
another plan.

Block kinds memx knows get selective recompute of their attention core (Gemma 2's soft-capped
attention: its own implementation, recomputed); on any other block "selective" recomputes the
whole block (the same as "full") because memx cannot see inside it. Tensor parallelism splits memx's
LLaMA and the dense blocks of the Hugging Face families whose own TP plan is Megatron's split
(:mod:`memx_launch.models.hf_tensor_parallel`; a mixture's blocks: TP = 1, each expert whole); any
other block trains with TP = 1. A plan whose selective level is
torchtitan's op-level policy runs it on every kind of block: the policy reads the block's ops,
not its structure (:mod:`memx_launch.models.checkpointing`).
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memx_launch.errors import ConfigError
from memx_launch.models.checkpointing import op_level_checkpoint
from memx_launch.models.hf_attention import hf_selective, recompute_own_attention, use_memx_sdpa
from memx_launch.models.hf_decoder import BlockInputs, HFEmbedding, LogitTransform, hf_causal_lm, layer_types
from memx_launch.models.hf_tensor_parallel import block_tp_plan, split_blocks
from memx_launch.models.llama import TransformerBlock, apply_tensor_parallel, per_layer
from memx_launch.models.router_loss import RouterLoss

log = logging.getLogger("memx")

BLOCK_PATHS = ("model.layers", "layers", "transformer.h")
# Qwen3's and Gemma 3's query and key norms act per head: TP keeps whole heads on a rank.
HF_LLAMA_FAMILY = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                   "GemmaDecoderLayer", "Gemma2DecoderLayer", "Gemma3DecoderLayer")
# What a Hugging Face decoder runs after its blocks, in this order (OPT: norm, then projection).
HF_FINAL_MODULES = ("norm", "ln_f", "norm_f", "final_norm", "final_layernorm", "final_layer_norm", "project_out")
_WARNED: set[str] = set()


@dataclass(frozen=True)
class BlockKind:
    name: str
    knows_attention: bool
    """Selective recompute reaches the attention core (else it falls back to the whole block)."""
    padding_mask: bool = False
    """Its blocks take a padding mask (else batches may pad only on the right: runtime/batches.py)."""


MEMX_KIND = BlockKind("memx LLaMA", True)
HF_KIND = BlockKind("Hugging Face Llama family", True, padding_mask=True)
# Gemma 2's soft-capped attention runs as its own (Transformers' eager: SDPA has no soft cap), its
# core recomputed in the backward on blocks of "selective" stages as memx_sdpa's.
HF_OWN_ATTENTION_KIND = BlockKind("Hugging Face Llama family, its own attention", True, padding_mask=True)
# A Hugging Face mixture's block: Llama's attention (memx_sdpa reaches its core) beside the experts.
HF_MOE_FAMILY = ("MixtralDecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer")
HF_MOE_KIND = BlockKind("Hugging Face mixture of experts", True, padding_mask=True)
HF_KINDS = (HF_KIND, HF_MOE_KIND, HF_OWN_ATTENTION_KIND)


def block_kind(block: nn.Module) -> BlockKind:
    if isinstance(block, TransformerBlock):
        return MEMX_KIND
    if type(block).__name__ in HF_LLAMA_FAMILY:
        return HF_KIND if getattr(block.self_attn, "attn_logit_softcapping", None) is None else HF_OWN_ATTENTION_KIND
    if type(block).__name__ in HF_MOE_FAMILY:
        return HF_MOE_KIND
    return BlockKind(type(block).__name__, False)


def _container(model: nn.Module, path: str) -> nn.Module | None:
    try:
        found = model.get_submodule(path)
    except AttributeError:
        return None
    return found if isinstance(found, (nn.ModuleList, nn.ModuleDict)) and len(found) else None


def find_blocks(model: nn.Module, blocks: str | None = None) -> str:
    """The dotted path of the model's block list."""
    if blocks is not None:
        if _container(model, blocks) is None:
            raise ConfigError("blocks", f"{type(model).__name__} has no non-empty ModuleList or ModuleDict "
                              f"at {blocks!r}", "name the attribute that holds the transformer blocks")
        return blocks
    for path in BLOCK_PATHS:
        if _container(model, path) is not None:
            return path
    # The list of same-class modules holding the most parameters; one of a single module only where
    # no longer list exists (a model built with one block, as calibration builds it: GPT-NeoX's, OPT's).
    best, best_key = None, (False, 0)
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) \
                and len({type(m) for m in module.children()}) == 1:
            key = (len(module) > 1, sum(p.numel() for p in module.parameters()))
            if key > best_key:
                best, best_key = name, key
    if best is None:
        raise ConfigError("model", f"no transformer blocks found in {type(model).__name__} (no list of "
                          "same-class modules)", "pass blocks='attribute.path' naming the ModuleList of blocks")
    return best


class ModelParts:
    """The user's model read as: before (first stage), blocks, after (last stage)."""

    def __init__(self, model: nn.Module, blocks: str | None = None):
        self.model = model
        self.path = find_blocks(model, blocks)
        container = model.get_submodule(self.path)
        self.blocks: list[nn.Module] = list(container.children())
        kinds = {block_kind(b) for b in self.blocks}
        if len(kinds) > 1:
            raise ConfigError("blocks", f"{self.path} mixes block types ({', '.join(k.name for k in kinds)})",
                              "name a list of one block type")
        self.kind = kinds.pop()
        _plan_decides_recompute(self.blocks)
        self.rotary: nn.Module | None = None
        self.repeated_block = 0
        """The first block of the model's repeated kind, which calibration measures (a mixture's first
        expert block, after its dense ones)."""
        self.one_stage: list[str] = []
        self.tp_plan: dict[str, str] | None = None
        """A Hugging Face model's TP plan for its blocks (module path in a block -> style), where memx
        splits them by it."""
        self.router_loss: RouterLoss | None = None
        """A Hugging Face mixture's load-balancing loss, where its config asks for it."""
        lm = hf_causal_lm(model, container)
        self.hf = lm is not None
        """A Hugging Face causal LM: blocks take positions, masks and rotary tables by attention type."""
        if lm is not None:
            self._hf_parts(*lm, container)
        elif self.kind in HF_KINDS:
            raise ConfigError("model", f"the {self.kind.name} blocks at {self.path} are not the layers of a "
                              "*ForCausalLM's decoder", "pass the Hugging Face *ForCausalLM (or a module holding it)")
        else:
            self.before, self.after = _around(model, self.path)
        self.tied = _shared_parameters(self.before, self.after)
        """Parameters the first and the last stage both hold (tied embeddings): one object when
        one stage holds both, else two copies whose gradients the runtime sums every step."""

    def _hf_parts(self, lm: nn.Module, prefix: str, container: nn.Module) -> None:
        """A Hugging Face causal LM (the model itself, or a module inside a wrapper such as a
        LightningModule): before the blocks, its decoder's own forward up to them (embeddings,
        learned positions, scaling and dropout as the model does them, and each block's arguments);
        after them, the final norm (and projection) and the LM head (with the modules the LM
        registers between its decoder and its head: ModernBERT's head transform); the rotary table
        every block uses."""
        decoder = next(m for m in lm.modules() if any(child is container for child in m.children()))
        decoder_prefix = prefix + next(n + "." for n, m in lm.named_modules() if m is decoder)
        blocks_name = next(n for n, m in decoder.named_children() if m is container)
        finals = [n for n in HF_FINAL_MODULES if getattr(decoder, n, None) is not None]
        children = list(lm.named_children())
        first = next(i for i, (_, m) in enumerate(children) if any(d is decoder for d in m.modules())) + 1
        last = next(i for i, (_, m) in enumerate(children) if m is lm.get_output_embeddings())
        self.before = [(decoder_prefix.rstrip("."), HFEmbedding(decoder, blocks_name, len(self.blocks), finals))]
        self.after = [(decoder_prefix + n, getattr(decoder, n)) for n in finals] + \
            [(prefix + n, m) for n, m in children[first:last + 1]]
        transform = LogitTransform.of(lm)
        self.after += [(prefix + "memx_logit_transform", transform)] if transform is not None else []
        self.rotary = getattr(decoder, "rotary_emb", None)
        self.config = lm.config
        self.tp_plan = block_tp_plan(lm.config, blocks_name, self.blocks)
        self.layer_types = layer_types(lm.config, len(self.blocks))
        """Each block's attention (full, sliding-window, chunked): the mask and rotary table it takes."""
        self.one_stage = [why for why, present in (
            ("per-layer inputs made from the token ids", getattr(lm.config, "hidden_size_per_layer_input", 0)),
            ("layers reusing earlier layers' keys and values", getattr(lm.config, "num_kv_shared_layers", 0)))
            if present]
        """Why its blocks run only on one stage holding them all (Gemma 4's E models): none for most."""
        self.router_loss = RouterLoss.of(lm, self.blocks)
        if self.kind is HF_OWN_ATTENTION_KIND:
            recompute_own_attention(lm.config, self.blocks)
        elif self.kind in HF_KINDS:
            use_memx_sdpa(lm.config, self.blocks)

    @property
    def tensor_parallel(self) -> bool:
        """memx splits its blocks by TP: memx's LLaMA's, a Hugging Face model's by its plan."""
        return self.kind is MEMX_KIND or self.tp_plan is not None

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def takes_mask(self) -> bool:
        """Its stages take the batch's padding mask: blocks that need one, or a load-balancing loss
        that counts the tokens the mask keeps."""
        return self.kind.padding_mask or self.router_loss is not None

    def tied_names(self, stage: nn.Module) -> list[str]:
        """The names in ``stage`` of the tied parameters it holds while another stage holds them
        too (none when it holds both ends), in :attr:`tied` order on every stage."""
        names = {id(p): n for n, p in stage.named_parameters()}
        if not (stage.before and stage.after):
            return [names[id(p)] for p in self.tied if id(p) in names]
        return []

    def stage(self, layer_offset: int, num_layers: int, *, first: bool, last: bool,
              recompute: str | list[str], selective_policy: str = "attention") -> "StageModule":
        if self.one_stage and num_layers < self.num_layers:
            raise ConfigError("plan", f"{type(self.model).__name__} has {' and '.join(self.one_stage)}, which "
                              "memx's runtime trains on one pipeline stage holding every block",
                              "plan with --pp 1")
        return StageModule(self, layer_offset, num_layers, first=first, last=last, recompute=recompute,
                           selective_policy=selective_policy)

    def block_probe(self, recompute: str, selective_policy: str = "attention") -> "StageModule":
        """A copy of the first block of the repeated kind (own weights) run as a middle stage: [b, s,
        hidden] in and out, at ``recompute`` under ``selective_policy``. What calibration measures
        (profiling/kernel.py's block_factory)."""
        probe, index = copy.copy(self), self.repeated_block
        probe.blocks, probe.before, probe.after = [copy.deepcopy(self.blocks[index])], [], []
        if self.hf:
            probe.layer_types = self.layer_types[index:index + 1]
        probe.router_loss = None  # [b, s, hidden] out, as calibration times it
        return StageModule(probe, 0, 1, first=False, last=False, recompute=recompute,
                           selective_policy=selective_policy)

    @torch.no_grad()
    def verify(self, example: torch.Tensor | None = None, atol: float = 1e-5) -> None:
        """The whole model against before -> blocks -> after on ``example`` (default: 1 x 8 token
        ids when the first part is an embedding; nothing to check otherwise), in eval mode (dropout
        would differ between the two runs); a Hugging Face model's also cut after its first block,
        where the second stage's blocks take the arguments memx rebuilds (:class:`BlockInputs`)."""
        if example is None:
            first = next((m for _, part in self.before for m in part.modules() if isinstance(m, nn.Embedding)), None)
            if first is None or first.weight.device.type == "meta":
                return
            example = torch.randint(0, first.num_embeddings, (1, 8), device=first.weight.device)
        training = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            expected = self.model(example)
            expected = getattr(expected, "logits", expected)
            expected = expected[0] if isinstance(expected, (tuple, list)) else expected
            got = self.stage(0, self.num_layers, first=True, last=True, recompute="none")(example)
            split = self._split_after_first_block(example) if got.shape == expected.shape else None
        finally:
            for module, mode in training.items():
                module.training = mode
        if got.shape != expected.shape or not torch.allclose(got, expected, atol=atol, rtol=0):
            raise ConfigError("model", f"running {type(self.model).__name__}'s parts in order (before the blocks: "
                              f"{[n for n, _ in self.before]}, after: {[n for n, _ in self.after]}) does not "
                              "reproduce its forward", "give memx a model whose forward is embedding -> blocks "
                              "-> head, or name the blocks with blocks='path'")
        if split is not None and not torch.allclose(split, expected, atol=atol, rtol=0):
            raise ConfigError("model", f"{type(self.model).__name__}'s blocks on a stage after the first do not "
                              "reproduce its forward with the arguments memx gives them", "plan with --pp 1")

    def _split_after_first_block(self, example: torch.Tensor) -> torch.Tensor | None:
        """The model run as two stages, its first block and the rest (a Hugging Face model that more
        than one stage may hold); None for any other."""
        if not self.hf or self.one_stage or self.num_layers < 2:
            return None
        first = self.stage(0, 1, first=True, last=False, recompute="none")
        rest = self.stage(1, self.num_layers - 1, first=False, last=True, recompute="none")
        try:
            return rest(first(example))
        except (TypeError, KeyError, AttributeError) as exc:  # a block argument memx does not rebuild
            raise ConfigError("model", f"{type(self.model).__name__}'s blocks on a stage after the first cannot "
                              f"take the arguments memx gives them ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})", "plan with --pp 1") from None

    def apply_tensor_parallel(self, stage: nn.Module, tp_mesh) -> None:
        if tp_mesh.size() == 1:
            return
        if not self.tensor_parallel:
            raise ConfigError("tp", f"memx has no tensor-parallel plan for {self.kind.name} blocks",
                              "use a plan with tp=1 (memx-run --plan, or re-plan), or a model whose family "
                              "memx splits by TP (docs/bring-your-own-model.md)")
        if self.kind is MEMX_KIND:
            apply_tensor_parallel(stage, tp_mesh)
        else:
            split_blocks(list(stage.blocks.values()), tp_mesh, self.tp_plan)


def _around(model: nn.Module, path: str) -> tuple[list, list]:
    """Modules registered before and after the path's step in every module along the path."""
    before, after_levels = [], []
    node, prefix = model, ""
    for step in path.split("."):
        names = [n for n, _ in node.named_children()]
        i = names.index(step)
        before += [(prefix + n, getattr(node, n)) for n in names[:i]]
        after_levels.append([(prefix + n, getattr(node, n)) for n in names[i + 1:]])
        node, prefix = getattr(node, step), prefix + step + "."
    return before, [part for level in reversed(after_levels) for part in level]


class StageModule(nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of a ModelParts, with the parts before
    them on the first stage and after them on the last; ``recompute`` as in the plan, its
    "selective" under ``selective_policy`` (the plan's: "attention", or "op", torchtitan's
    op-level policy, which needs no knowledge of the block and applies to any)."""

    def __init__(self, parts: ModelParts, layer_offset: int, num_layers: int, *, first: bool, last: bool,
                 recompute: str | list[str], selective_policy: str = "attention"):
        super().__init__()
        self.kind = parts.kind
        self.before = nn.ModuleDict({_key(n): m for n, m in parts.before}) if first else nn.ModuleDict()
        self.blocks = nn.ModuleDict({str(layer_offset + i): parts.blocks[layer_offset + i]
                                     for i in range(num_layers)})
        self.after = nn.ModuleDict({_key(n): m for n, m in parts.after}) if last else nn.ModuleDict()
        self.rotary = parts.rotary
        self.router_loss, self.last = parts.router_loss, last
        self.routers = self.router_loss.routers_of(self.blocks.values()) if self.router_loss else []
        self.hf = parts.hf
        # A Hugging Face model's blocks take what its forward passes them: recorded on the first stage
        # (HFEmbedding), rebuilt by attention type on a later one.
        self.block_inputs = None
        if self.hf and not first:
            for i, block in self.blocks.items():
                block._memx_attention_type = parts.layer_types[int(i)]
            self.block_inputs = BlockInputs(parts.config, self.rotary,
                                            set(parts.layer_types[layer_offset:layer_offset + num_layers]),
                                            parts.blocks[layer_offset])
        # The "block" policy's selective level is the whole block (as the plan priced it: full).
        self.levels = ["full" if level == "selective" and selective_policy == "block" else level
                       for level in per_layer(recompute, num_layers)]
        self.op_level = selective_policy == "op"
        if "selective" in self.levels and not self.op_level and not self.kind.knows_attention \
                and self.kind.name not in _WARNED:
            _WARNED.add(self.kind.name)  # once per process and block type
            log.warning("memx: selective recompute on %s blocks recomputes the whole block (memx cannot "
                        "reach their attention core); the plan's prediction assumed less", self.kind.name)
        for block, level in zip(self.blocks.values(), self.levels):
            if self.kind is MEMX_KIND:
                block.recompute, block.selective_policy = level, selective_policy
            elif self.kind in HF_KINDS:
                hf_selective(block, level == "selective" and not self.op_level)

    def forward(self, x: torch.Tensor, router_sums: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None):
        """``attention_mask``: [batch, seq], 0 at padding (:attr:`ModelParts.takes_mask`). In training,
        a model with a load-balancing loss (:class:`RouterLoss`) takes the previous stage's
        ``router_sums`` and returns (hidden state, sums), its last stage (logits, the loss's term)."""
        h, recorded = x, None
        for module in self.before.values():
            if isinstance(module, HFEmbedding):
                h, recorded = module(h, attention_mask, len(self.blocks))
            else:
                h = module(h)
        calls = self._block_calls(h, attention_mask, recorded)
        carries = self.router_loss is not None and self.training and torch.is_grad_enabled()  # not verify()'s
        with self.router_loss.recording(self.routers) if carries else nullcontext() as logits:
            for call, block, level in zip(calls, self.blocks.values(), self.levels):
                if self.kind is MEMX_KIND:  # its blocks recompute as their level and policy say
                    h = call(block, h)
                elif level == "selective" and self.op_level:
                    h = op_level_checkpoint(call, block, h)
                elif level == "full" or (level == "selective" and not self.kind.knows_attention):
                    h = checkpoint(call, block, h, use_reentrant=False)
                else:
                    h = call(block, h)
        for module in self.after.values():
            h = module(h)
        if not carries:
            return h
        sums = self.router_loss.add(router_sums, logits, attention_mask, h.device)
        return (h, self.router_loss.loss(sums, attention_mask, h.shape[0] * h.shape[1])) if self.last else (h, sums)

    def _block_calls(self, h: torch.Tensor, attention_mask: torch.Tensor | None,
                     recorded: list[tuple[tuple, dict]] | None) -> list[Callable]:
        """Each block's call (block, hidden state) -> hidden state: with the arguments the model's
        own forward gave it (``recorded``, the first stage), or rebuilt for its attention type."""
        if recorded is not None:
            return [lambda block, x, args=args, kwargs=kwargs: _first(block(x, *args, **kwargs))
                    for args, kwargs in recorded]
        if self.hf:  # causal, masked by each block's attention type as the model's own forward masks it
            by_type = self.block_inputs(h, attention_mask)
            return [lambda block, x: _first(block(x, **by_type[block._memx_attention_type]))] * len(self.blocks)
        return [lambda block, x: _first(block(x))] * len(self.blocks)


def _plan_decides_recompute(blocks: list[nn.Module]) -> None:
    """Turn off the model's own activation checkpointing (Transformers' ``gradient_checkpointing``
    on each layer, set by ``gradient_checkpointing_enable``): the plan recomputes stage by stage,
    and predicted each stage's memory and time so."""
    if any(getattr(block, "gradient_checkpointing", False) for block in blocks):
        for block in blocks:
            block.gradient_checkpointing = False
        log.warning("memx: the model's gradient checkpointing is off; the plan recomputes each stage as it "
                    "says (its recompute levels)")


def _shared_parameters(before: list, after: list) -> list[nn.Parameter]:
    """Parameters of the first stage's parts that the last stage's parts hold too."""
    first = {id(p) for _, module in before for p in module.parameters()}
    return [p for _, module in after for p in module.parameters() if id(p) in first]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _key(name: str) -> str:
    return name.replace(".", "__")  # ModuleDict keys cannot hold dots
