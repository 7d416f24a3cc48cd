"""The user's training pieces on one rank's share of the model: ``prepare`` and what it needs.

    job = memx_launch.prepare(model, optimizer, data=loader, lr_scheduler=lambda opt: ..., max_grad_norm=1.0)
    for batch in job.data:                             # this DP replica's rows of each global batch
        stats = job.step(batch)                        # all micro-batches, clipping, optimizer, scheduler

``batch``: a dict (``input_ids``, ``attention_mask``, ``labels``) or an ``(inputs, targets)`` pair
(runtime/batches.py); ``data``: a DataLoader or any iterable of global batches (``job.data`` is
this replica's share; without ``data``, ``job.local_batch(global_batch)`` takes it).

``job`` is a :class:`~memx_launch.runtime.training.Runtime`: under memx-run it watches memory,
re-plans, checkpoints and resumes, whatever the model.

The optimizer may be a function of the parameters (called on this rank's parameters) or an
optimizer built on the whole model: memx builds one of the same class over this rank's parameters
with each group's settings (its state, if it has stepped already, is not carried). The LR
scheduler is a function of the optimizer (it must be built on the optimizer memx makes).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable

from torch import nn

from memx_launch.errors import ConfigError
from memx_launch.runtime.precision import TORCH_DTYPES
from memx_launch.specs.hf_family_keys import LLAMA_FAMILY_TYPES
from memx_launch.specs.inputs import load_json
from memx_launch.specs.precision import param_dtype
from memx_launch.specs.training import TrainingSpec

log = logging.getLogger("memx")
# A frozen share this far from the plan's moves its memory: gradients and optimizer states of
# 2% of the parameters are about 1.5% of a mixed-precision Adam run's model states.
FROZEN_SHARE_TOLERANCE = 0.02


def prepare(model: nn.Module, optimizer=None, *, data=None, loss_fn: Callable | None = None,
            lr_scheduler: Callable | None = None, max_grad_norm: float | None = None,
            blocks: str | None = None, plan=None, **kwargs):
    """This rank's Runtime for ``model`` under the job's plan (MEMX_PLAN, as memx-run sets it) or
    ``plan``. Build the model the same way on every rank (same seed, or the same pretrained weights)
    and on the CPU (or a meta device you fill later): each rank moves only its stage to its device.
    ``data``: a DataLoader (or iterable) of global batches; ``job.data`` yields this DP replica's
    rows of each. ``blocks``: the dotted path of the transformer blocks when memx does not find them."""
    from memx_launch.runtime.batches import ReplicaBatches
    from memx_launch.runtime.training import build, from_env

    options = dict(model=model, optimizer=optimizer, loss_fn=loss_fn, lr_scheduler=lr_scheduler,
                   max_grad_norm=max_grad_norm, blocks=blocks, **kwargs)
    job = build(plan, int(os.environ.get("RANK", "0")), **options) if plan is not None else from_env(**options)
    job.data = None if data is None else ReplicaBatches(data, job, seed=kwargs.get("seed", 0))
    if job.comm.rank == 0:
        check_frozen_share(model, job.plan.training.get("frozen_fraction", 0.0))
        check_param_dtype(model, param_dtype(TrainingSpec(**job.plan.training)))
    return job


def check_param_dtype(model: nn.Module, planned: str) -> None:
    """Say where the model's parameters are not in the dtype the plan priced (fp32 master weights,
    or 16-bit ones: its weights', gradients' and optimizer states' memory is off by up to 2x)."""
    names = {dtype: name for name, dtype in TORCH_DTYPES.items()}
    found = sorted({names.get(p.dtype, str(p.dtype)) for p in model.parameters() if p.is_floating_point()})
    if found and found != [planned]:
        log.warning("memx: the model's parameters are %s but the plan priced %s: memx-run --param-dtype %s plans "
                    "for them", ", ".join(found), planned, found[0])


def frozen_share(model: nn.Module) -> float:
    """The share of the model's parameters that are frozen (requires_grad off: fine-tuning)."""
    sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
    return sum(n for n, trains in sizes if not trains) / max(sum(n for n, _ in sizes), 1)


def check_frozen_share(model: nn.Module, planned: float) -> None:
    """Say where the model's frozen share is not the one the plan priced: its memory and its
    backward's time are off by their gradients, optimizer states and weight-gradient GEMMs."""
    frozen = frozen_share(model)
    if abs(frozen - planned) > FROZEN_SHARE_TOLERANCE:
        log.warning("memx: %.1f%% of the model's parameters are frozen but the plan priced %.1f%%: "
                    "memx-run --frozen-fraction %.3f plans for them", 100 * frozen, 100 * planned, frozen)


def user_block_parts(environ=os.environ):
    """The model whose first block calibration measures (models/adapters.py's ModelParts: its
    ``block_probe``, split by TP with its ``apply_tensor_parallel`` where its kind has a plan), or
    None: memx's LLaMA block of the shape. memx-run --model-builder FILE:FUNCTION
    (MEMX_MODEL_BUILDER): FUNCTION(model, seed) from the script file builds the model. Without it,
    a Hugging Face config.json that memx's LLaMA cannot stand in for (a GELU MLP: GPT-2, OPT, Phi;
    a mixture of experts: Mixtral, Qwen-MoE; LayerNorm: StableLM; Gemma's and Qwen3's norms; fused
    q, k, v or gate, up linears outside the Llama family: Phi-3) gives the model built from the
    config by transformers, with one block."""
    import importlib.util
    import sys

    from memx_launch.models.adapters import ModelParts

    if not environ.get("MEMX_MODEL_BUILDER"):
        return _hf_block_parts(environ.get("MEMX_MODEL", ""))
    path, function, model_arg = json.loads(environ["MEMX_MODEL_BUILDER"])
    sys.path.insert(0, os.path.dirname(path))  # the script's own imports, as when it runs
    spec = importlib.util.spec_from_file_location("memx_model_builder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: the script's training does not start
    if not callable(getattr(module, function, None)):
        raise ConfigError("--model-builder", f"{path} has no function {function}", "name a function(model, seed)")
    try:
        model = getattr(module, function)(model_arg, 0)
    except Exception as exc:  # the script's code on the user's --model: one line, as for any bad input
        raise ConfigError("--model-builder", f"{function}({model_arg!r}, 0) in {path} raised "
                          f"{type(exc).__name__}: {exc}", f"pass the --model {function} builds, or run "
                          f"{function} alone to see where it fails") from exc
    return _verified(ModelParts(model))


def _hf_block_parts(model_arg: str):
    from memx_launch.models.adapters import ModelParts
    from memx_launch.planning.extra_blocks import first_repeated_block
    from memx_launch.specs.catalog import get_model

    folder = model_arg if os.path.isdir(model_arg) else os.path.dirname(model_arg)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    spec = get_model(model_arg)
    # What memx's own LLaMA block does not build, and which changes what a block keeps or takes
    # (Gemma 2's soft-capped attention keeps its scores): the model's own block is measured instead.
    missing = [what for what, present in (("experts", spec.num_experts),
                                          ("a GELU MLP", not spec.gated_mlp),
                                          ("LayerNorm", spec.layer_norm),
                                          ("norms after attention and MLP", spec.post_norms),
                                          ("query and key norms", spec.qk_norm),
                                          ("a value norm", spec.value_norm),
                                          ("per-layer inputs", spec.per_layer_input_size),
                                          ("a soft-capped attention", spec.attention_softcapping)) if present]
    if not missing and load_json(os.path.join(folder, "config.json"), "--model").get("model_type") \
            in LLAMA_FAMILY_TYPES:  # memx's LLaMA's linears
        return None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        if not missing:
            return None
        raise ConfigError("--model", f"{model_arg} has {missing[0]}, which memx's own LLaMA block cannot measure "
                          "in its place", "pip install -e '.[hf]' so that memx measures the model's own block, "
                          "or pass --model-builder FILE:FUNCTION") from None
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # a refusal, never a prompt
    except ValueError as exc:  # custom code (auto_map), or a model type transformers does not know
        why = str(exc).splitlines()[0].strip()
        if not missing:  # memx's LLaMA stands in, as for any block of LLaMA's parts
            log.info("memx: %s not built by transformers (%s): memx's LLaMA block of its shape is calibrated",
                     folder, why)
            return None
        raise ConfigError("--model", f"transformers cannot build {model_arg} ({why}), and memx's own LLaMA "
                          f"block cannot stand in for a block with {missing[0]}",
                          "pass --model-builder FILE:FUNCTION to build it") from None
    repeated = first_repeated_block(spec)
    _blocks_up_to(config, repeated + 1)
    if not missing and not _fuses_its_linears(config, spec, AutoModelForCausalLM):
        return None
    parts = ModelParts(AutoModelForCausalLM.from_config(config))
    parts.repeated_block = repeated
    return _verified(parts)


def _blocks_up_to(config, blocks: int) -> None:
    """``config`` cut to its first ``blocks`` blocks, the last of them the one calibration measures:
    its per-layer attention types with them, and no layer reusing another's keys and values
    (Gemma 4's config checks both against the layer count)."""
    config.num_hidden_layers = blocks
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:blocks]
    if getattr(config, "num_kv_shared_layers", 0):
        config.num_kv_shared_layers = 0


def _fuses_its_linears(config, spec, auto_model) -> bool:
    """Whether a block of LLaMA's parts outside the Llama family fuses its linears (Phi-3's
    qkv_proj and gate_up_proj), which memx's LLaMA does not: read off the block ``auto_model``
    builds from ``config`` on the meta device (no memory)."""
    import torch

    from memx_launch.models.adapters import ModelParts
    from memx_launch.models.block_reading import read_block

    with torch.device("meta"):
        block = ModelParts(auto_model.from_config(config)).blocks[0]
    return any(read_block(block, spec).get(k) for k in ("fused_qkv", "fused_gate_up"))


def _verified(parts):
    """A forward memx cannot read stops the job here, before calibrating."""
    if not parts.kind.knows_attention:
        parts.verify()
    return parts
