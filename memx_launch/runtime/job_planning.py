"""What memx-run's searches plan with, the workers' in the job and ``--dry-run``'s alike: the
user's block as it runs and the search space the job takes, so that a dry run prints the plan the
job would search for (with the analytical model where the job has its calibration)."""

from __future__ import annotations

import json

from memx_launch.planning.search_space import SearchSpace
from memx_launch.runtime.worker_env import search_restrictions
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def planning_env(args, resolved) -> dict[str, str]:
    """The MEMX_* variables memx-run's searches read, from memx-run's ``args`` and what it
    ``resolved`` of them."""
    env = {"MEMX_MODEL": resolved["model_arg"], "MEMX_SEARCH_RESTRICTIONS": json.dumps(resolved["restrictions"]),
           "MEMX_NO_REPLAN": str(int(args.no_replan))}
    if resolved["builder"] is not None:
        env["MEMX_MODEL_BUILDER"] = json.dumps(resolved["builder"])
    return env


def job_search_space(env) -> SearchSpace:
    """memx-run's restrictions (``--tp``, ``--pp``, ...), ``G >= PP`` (torch's Schedule1F1B refuses
    fewer micro-batches than stages), and the free memory the monitor asks for unless re-planning
    is off: a plan without it would re-plan at its first samples."""
    from memx_launch.runtime.monitor import MonitorConfig  # torch: not at memx-run's start

    headroom = 0.0 if env.get("MEMX_NO_REPLAN") == "1" else MonitorConfig.from_env(env).min_headroom
    return SearchSpace(memory_headroom=headroom, fewer_microbatches_than_stages=False, **search_restrictions(env))


def block_training(env, model: ModelSpec, training: TrainingSpec):
    """``(parts, training, own)``: the model whose block calibration measures
    (:func:`~memx_launch.runtime.prepare.user_block_parts`: ``--model-builder``, or a config only
    transformers builds; None for memx's LLaMA block), ``training`` as that block runs (its fused
    linears and norms, :mod:`~memx_launch.models.block_reading`) and the options that changed."""
    from memx_launch.models.block_reading import own_block_training
    from memx_launch.runtime.prepare import user_block_parts

    parts = user_block_parts(env)
    if parts is None:
        return None, training, {}
    training, own = own_block_training(training, parts.blocks[parts.repeated_block], model)
    return parts, training, own
