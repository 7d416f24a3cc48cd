"""This rank's optimizer, LR scheduler and gradient clipping over its share of the model."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import nn

from memx_launch.errors import ConfigError


def parameter_names(chunks: list[nn.Module]) -> dict[str, nn.Parameter]:
    """``{chunk index}.{name}``: the rank's parameters under names that wrapping does not change
    (DDP adds ``module.``; FSDP2 and TP keep the names)."""
    return {f"{i}.{name.removeprefix('module.')}": p for i, chunk in enumerate(chunks)
            for name, p in chunk.named_parameters()}


def local_optimizer(optimizer, params_by_name: dict[str, nn.Parameter], original_names: dict[int, str],
                    lr: float) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters. ``original_names``: id of the user's parameter
    object -> its name in ``params_by_name`` (taken before wrapping replaced the objects)."""
    params = list(params_by_name.values())
    if optimizer is None:
        return torch.optim.AdamW(params, lr=lr)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ConfigError("optimizer", f"{type(optimizer).__name__} is neither an optimizer nor a function",
                              "pass torch.optim.AdamW(model.parameters(), ...) or lambda params: ...")
        return optimizer(params)
    groups = []
    for group in optimizer.param_groups:
        mine = [params_by_name[original_names[id(p)]] for p in group["params"] if id(p) in original_names]
        if mine:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
    if not groups:
        raise ConfigError("optimizer", "holds none of this rank's parameters",
                          "build the optimizer on the model you pass to prepare")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def local_scheduler(lr_scheduler, optimizer: torch.optim.Optimizer):
    if lr_scheduler is None:
        return None
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) or not callable(lr_scheduler):
        raise ConfigError("lr_scheduler", "memx builds the optimizer of each rank, so a scheduler built on "
                          "yours would step the wrong one", "pass a function: lr_scheduler=lambda opt: "
                          "torch.optim.lr_scheduler.LambdaLR(opt, ...)")
    return lr_scheduler(optimizer)


def clip_grad_norm(chunks: list[nn.Module], max_norm: float, sum_over_stages: Callable[[torch.Tensor], None],
                   counted_elsewhere: list[nn.Parameter] = ()) -> float:
    """Clip by the norm of the whole model's gradient: each stage's norm (over its TP and DP
    shards, which DTensor reduces) combined across the stages by ``sum_over_stages`` (in place).
    ``counted_elsewhere``: this stage's copies of parameters another stage counts (tied
    embeddings), clipped but not counted twice. Returns the norm before clipping."""
    grads = [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    skip = {id(p.grad) for p in counted_elsewhere}
    by_mesh: dict[int, list] = {}  # DTensor gradients (TP, FSDP2) reduce over their own mesh
    for g in (g for g in grads if id(g) not in skip):
        by_mesh.setdefault(id(g.device_mesh) if hasattr(g, "device_mesh") else 0, []).append(g)
    squared = torch.zeros(1, device=grads[0].device if grads else None)
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group)
        squared += (norm.full_tensor() if mesh else norm).detach().float() ** 2
    sum_over_stages(squared)
    total = math.sqrt(squared.item())
    scale = max_norm / (total + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return total
