"""The user's training pieces on one rank's share of the model: ``prepare`` and what it needs.

    job = memx_launch.prepare(model, optimizer, loss_fn=loss, lr_scheduler=lambda opt: ..., max_grad_norm=1.0)
    for inputs, targets in loader:                     # this DP replica's rows (job.local_batch)
        stats = job.step(inputs, targets)              # all micro-batches, clipping, optimizer, scheduler

``job`` is a :class:`~memx_launch.runtime.training.Runtime`: under memx-run it watches memory,
re-plans, checkpoints and resumes, whatever the model.

The optimizer may be a function of the parameters (called on this rank's parameters) or an
optimizer built on the whole model: memx builds one of the same class over this rank's parameters
with each group's settings (its state, if it has stepped already, is not carried). The LR
scheduler is a function of the optimizer (it must be built on the optimizer memx makes).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from memx_launch.errors import ConfigError


def prepare(model: nn.Module, optimizer=None, *, loss_fn: Callable | None = None,
            lr_scheduler: Callable | None = None, max_grad_norm: float | None = None,
            blocks: str | None = None, plan=None, **kwargs):
    """This rank's Runtime for ``model`` under the job's plan (MEMX_PLAN, as memx-run sets it) or
    ``plan``. Build the model the same way on every rank (same seed, or the same pretrained weights)
    and on the CPU (or a meta device you fill later): each rank moves only its stage to its device.
    ``blocks``: the dotted path of the transformer blocks when memx does not find them."""
    from memx_launch.runtime.training import build, from_env

    options = dict(model=model, optimizer=optimizer, loss_fn=loss_fn, lr_scheduler=lr_scheduler,
                   max_grad_norm=max_grad_norm, blocks=blocks, **kwargs)
    if plan is not None:
        return build(plan, int(os.environ.get("RANK", "0")), **options)
    return from_env(**options)


def user_block_factory(environ=os.environ):
    """memx-run --model-builder FILE:FUNCTION (MEMX_MODEL_BUILDER): FUNCTION(model, seed) from the
    script file builds the model, and calibration measures copies of its first block. None without it."""
    import importlib.util
    import json
    import sys

    from memx_launch.models.adapters import ModelParts

    if not environ.get("MEMX_MODEL_BUILDER"):
        return None
    path, function, model_arg = json.loads(environ["MEMX_MODEL_BUILDER"])
    sys.path.insert(0, os.path.dirname(path))  # the script's own imports, as when it runs
    spec = importlib.util.spec_from_file_location("memx_model_builder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: the script's training does not start
    if not callable(getattr(module, function, None)):
        raise ConfigError("--model-builder", f"{path} has no function {function}", "name a function(model, seed)")
    return ModelParts(getattr(module, function)(model_arg, 0)).block_probe


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


def clip_grad_norm(chunks: list[nn.Module], max_norm: float, pp_group) -> float:
    """Clip by the norm of the whole model's gradient: each stage's norm (over its TP and DP
    shards, which DTensor reduces) combined across the pipeline. Returns the norm before clipping."""
    grads = [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]
    by_mesh: dict[int, list] = {}  # DTensor gradients (TP, FSDP2) reduce over their own mesh
    for g in grads:
        by_mesh.setdefault(id(g.device_mesh) if hasattr(g, "device_mesh") else 0, []).append(g)
    squared = torch.zeros(1, device=grads[0].device if grads else None)
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group)
        squared += (norm.full_tensor() if mesh else norm).detach().float() ** 2
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)
    total = math.sqrt(squared.item())
    scale = max_norm / (total + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return total
