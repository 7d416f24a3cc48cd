"""Checkpoints that load under any plan: torch.distributed.checkpoint (DCP) keyed by layer names.

LlamaStage names its blocks by global layer index (``layers.{i}.…``), and the optimizer state is
flattened to the same names (``state.layers.{i}.….exp_avg``), so a checkpoint written under one
stage split, TP or DP degree loads under another: each rank asks DCP for the names it holds now.
Besides model and optimizer: the data position (a small JSON dict every rank passes alike) and
each rank's RNG states (keyed by global rank; a rank that did not exist keeps its own).

Layout on disk: ``{dir}/step-{step:08d}/`` (DCP files plus memx.json) and ``{dir}/latest.json``;
a step is written to a temporary folder and renamed after every rank finished, so a crash
mid-save leaves the previous checkpoint as the latest. All ranks must see the same folder.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from memx_launch.errors import ConfigError
from memx_launch.files import write_json_atomic

LATEST = "latest.json"
META = "memx.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# The container below adds "parts.{i}." to every name; i depends on the split, so it is dropped.
_PART_PREFIX = re.compile(r"(^|\.)parts\.\d+\.")


class _Parts(torch.nn.Module):
    """One module over a rank's model chunks: DCP's state-dict helpers take one model."""

    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)


def _global_names(parts: list[torch.nn.Module], optimizer) -> tuple[dict, dict]:
    """Model and optimizer state under names that do not depend on the split."""
    model_state, optim_state = get_state_dict(_Parts(parts), optimizer, options=_OPTIONS)
    strip = lambda d: {_PART_PREFIX.sub(r"\1", k, count=1): v for k, v in d.items()}  # noqa: E731
    return strip(model_state), strip(optim_state)


@dataclass
class Resumed:
    step: int
    """The last completed step: training continues with step + 1."""
    data_state: dict
    path: str


def _rng_state(rank: int) -> dict[str, torch.Tensor]:
    out = {f"rng.rank{rank}.torch": torch.get_rng_state(),
           f"rng.rank{rank}.numpy": torch.from_numpy(np.frombuffer(
               json.dumps(_numpy_state()).encode(), dtype=np.uint8).copy()),
           f"rng.rank{rank}.python": torch.from_numpy(np.frombuffer(
               json.dumps(_python_state()).encode(), dtype=np.uint8).copy())}
    if torch.cuda.is_available():
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def _numpy_state() -> list:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def _python_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rank: int, state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state[f"rng.rank{rank}.torch"])
    name, keys, pos, has_gauss, gauss = json.loads(bytes(state[f"rng.rank{rank}.numpy"].numpy()).decode())
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss = json.loads(bytes(state[f"rng.rank{rank}.python"].numpy()).decode())
    random.setstate((version, tuple(internal), gauss))
    if f"rng.rank{rank}.cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[f"rng.rank{rank}.cuda"])


def save_checkpoint(directory: str, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                    step: int, data_state: dict | None = None, plan=None, keep: int | None = None) -> str:
    """Every rank calls this after ``step``; returns the checkpoint's folder. ``keep``: delete all
    but the newest ``keep`` step folders once this one is complete."""
    rank = dist.get_rank()
    final = os.path.join(directory, f"step-{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_state, optim_state = _global_names(model_parts, optimizer)
    state = {"model": model_state, "optimizer": optim_state, **_rng_state(rank)}
    dcp.save(state, checkpoint_id=tmp)
    if rank == 0:
        write_json_atomic(os.path.join(tmp, META), {"step": step, "data_state": data_state or {},
                                                    "world_size": dist.get_world_size(),
                                                    "plan": plan.to_dict() if plan is not None else None})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_json_atomic(os.path.join(directory, LATEST), {"step": step, "path": os.path.basename(final)},
                          overwrite=True)
        if keep is not None:
            done = sorted(d for d in os.listdir(directory) if re.fullmatch(r"step-\d{8}", d))
            for old in done[:-keep]:
                shutil.rmtree(os.path.join(directory, old))
    dist.barrier()
    return final


def latest_checkpoint(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return os.path.join(directory, json.load(f)["path"])
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"{directory}/{LATEST}", "corrupt", "delete it to resume from no checkpoint, or "
                          "point it at a complete step-* folder") from None


def load_checkpoint(directory: str, model_parts: list[torch.nn.Module],
                    optimizer: torch.optim.Optimizer) -> Resumed | None:
    """Load the latest checkpoint in ``directory`` into this rank's parts under the current plan;
    None when there is none. Every rank calls this."""
    path = latest_checkpoint(directory)
    if path is None:
        return None
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    rank = dist.get_rank()
    container = _Parts(model_parts)
    model_state, optim_state = get_state_dict(container, optimizer, options=_OPTIONS)
    local_name = {_PART_PREFIX.sub(r"\1", k, count=1): k for k in [*model_state, *optim_state]}
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # Placeholders of the stored sizes: the numpy and python states are JSON of varying length.
    rng = {k: torch.empty(stored[k].size, dtype=torch.uint8) for k in _rng_state(rank) if k in stored}
    state = {"model": {g: model_state[k] for g, k in local_name.items() if k in model_state},
             "optimizer": {g: optim_state[k] for g, k in local_name.items() if k in optim_state}, **rng}
    dcp.load(state, checkpoint_id=path)  # tensors in place; plain values (lr, betas) replaced
    set_state_dict(container, optimizer, model_state_dict={local_name[g]: v for g, v in state["model"].items()},
                   optim_state_dict={local_name[g]: v for g, v in state["optimizer"].items()}, options=_OPTIONS)
    if len(rng) == len(_rng_state(rank)):
        _set_rng_state(rank, state)
    return Resumed(int(meta["step"]), dict(meta["data_state"]), path)
