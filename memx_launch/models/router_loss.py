"""A Hugging Face mixture's load-balancing loss across pipeline stages.

With ``output_router_logits`` a Transformers mixture (Mixtral, Qwen2-MoE, Qwen3-MoE) adds
``router_aux_loss_coef`` times Switch Transformer's loss to its language-model loss
(``load_balancing_loss_func``): over every router of the model and every token, the share of the
top-k choices each expert got times its mean routing probability, summed over the experts, times
their number. Both factors are sums over routers and tokens, so each stage adds its own routers'
to the running sums it received and sends them on beside the hidden state (one [2, experts] fp32
tensor: the choices, then the probabilities); the last stage forms the loss and adds it to the
micro-batch's, and the probabilities' gradient goes back through the pipeline to every stage's
routers. Per micro-batch, as gradient accumulation over the model's own forward computes it.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager

import torch
from torch import nn

from memx_launch.errors import ConfigError


class RouterLoss:
    """The routers of a model whose loss includes their load-balancing term, and that term's
    arithmetic; None from :meth:`of` for any other model."""

    def __init__(self, router_class: type, index: int, num_routers: int, num_experts: int, top_k: int, coef: float):
        self.router_class, self.index = router_class, index
        self.num_routers = num_routers
        """The model's routers, every stage's: the sums' denominator counts each of their tokens."""
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef

    @classmethod
    def of(cls, lm: nn.Module, blocks: list[nn.Module]) -> "RouterLoss | None":
        """``lm``: a Hugging Face causal LM; its router modules are those whose output Transformers
        records as ``router_logits`` (the logits at ``index`` of their output)."""
        recorder = getattr(lm, "_can_record_outputs", None) or {}
        router_class = getattr(recorder.get("router_logits"), "target_class", None)
        if not getattr(lm.config, "output_router_logits", False) or router_class is None:
            return None
        _check_same_loss(lm)
        coef = getattr(lm, "router_aux_loss_coef", lm.config.router_aux_loss_coef)  # what its forward reads
        return cls(router_class, recorder["router_logits"].index, len(_routers(blocks, router_class)),
                   lm.num_experts, lm.num_experts_per_tok, float(coef))

    def routers_of(self, blocks) -> list[nn.Module]:
        """The router modules of ``blocks``, in order."""
        return _routers(blocks, self.router_class)

    @contextmanager
    def recording(self, routers: list[nn.Module]):
        """The logits of ``routers`` (:meth:`routers_of` a stage's blocks) in a forward inside it,
        in call order (a list). A recompute in the backward runs outside it and records nothing."""
        logits: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _in, out: logits.append(out[self.index])) for m in routers]
        try:
            yield logits
        finally:
            for hook in hooks:
                hook.remove()

    def add(self, sums: torch.Tensor | None, logits: list[torch.Tensor], attention_mask: torch.Tensor | None,
            device: torch.device) -> torch.Tensor:
        """``sums`` (None on the first stage: zeros) plus these routers' top-k choices and routing
        probabilities per expert, over the tokens the mask keeps (Transformers' arithmetic)."""
        out = torch.zeros(2, self.num_experts, device=device) if sums is None else sums.float()
        flat_mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        for layer in logits:
            probs = torch.softmax(layer, dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
            weights = torch.ones_like(chosen, dtype=torch.float32) if flat_mask is None \
                else flat_mask.repeat_interleave(self.top_k)
            counts = torch.zeros(self.num_experts, device=device).scatter_add_(0, chosen, weights)
            kept = probs.float() if flat_mask is None else probs.float() * flat_mask.unsqueeze(-1)
            out = out + torch.stack([counts, kept.sum(dim=0)])
        return out

    def loss(self, sums: torch.Tensor, attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """The coefficient times the load-balancing loss of the micro-batch whose sums these are
        (``tokens``: its batch x sequence)."""
        rows = self.num_routers * (tokens if attention_mask is None else attention_mask.float().sum())
        return self.coef * self.num_experts * torch.sum(sums[0] / rows * (sums[1] / rows))


def _routers(blocks, router_class: type) -> list[nn.Module]:
    return [m for block in blocks for m in block.modules() if isinstance(m, router_class)]


def _check_same_loss(lm: nn.Module) -> None:
    """The model's ``load_balancing_loss_func`` must be Mixtral's, the arithmetic memx carries (most
    Transformers mixtures share its code: Qwen2/3-MoE, OLMoE, GPT-OSS, ...); another is refused."""
    from transformers.models.mixtral import modeling_mixtral

    own = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    reference = modeling_mixtral.load_balancing_loss_func
    if own is not reference and (own is None or inspect.getsource(own) != inspect.getsource(reference)):
        raise ConfigError("model", f"{type(lm).__name__}'s load-balancing loss is not the one memx carries across "
                          "pipeline stages (Mixtral's)", "set output_router_logits to false in its config: the "
                          "loss is then the language model's alone")
