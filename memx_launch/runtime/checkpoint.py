"""Checkpoints that load under any plan, and load without unpickling anything.

LlamaStage names its blocks by global layer index (``layers.{i}.…``), and the optimizer state is
flattened to the same names (``state.layers.{i}.….exp_avg``, torch's get_state_dict), so a
checkpoint written under one stage split, TP or DP degree loads under another: each rank reads
the names it holds now, and of each tensor the box it holds (a DTensor shard) from the stored
pieces that overlap it. Besides model and optimizer: the data position (a small JSON dict every
rank passes alike) and each rank's RNG states (keyed by global rank; a rank that did not exist
keeps its own).

Layout on disk: ``{dir}/step-{step:08d}/`` holding ``rank{r:05d}.safetensors`` (the pieces rank r
wrote: each distinct piece once, by the lowest rank holding it) and ``memx.json`` (step, data
position, plan, plain optimizer values such as lr and betas, and where each piece is), plus
``{dir}/latest.json``. A step is written to a temporary folder and renamed after every rank
finished, so a crash mid-save leaves the previous checkpoint as the latest. All ranks must see
the same folder.

What is trusted: nothing in the folder is executed. safetensors files are a JSON header plus raw
bytes, memx.json is JSON read through a schema (names, shapes and file names checked), and every
path is confined to the checkpoint directory (latest.json names a ``step-NNNNNNNN`` folder in it;
links out of it are refused). torch.distributed.checkpoint is not used: its reader unpickles
``.metadata`` and non-tensor values.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from memx_launch.errors import ConfigError
from memx_launch.files import write_json_atomic
from memx_launch.runtime.messages import all_gather_json
from memx_launch.specs.inputs import load_json

LATEST = "latest.json"
META = "memx.json"
FORMAT = 2
STEP_DIR = re.compile(r"step-\d{8}")
RANK_FILE = re.compile(r"rank\d{5}\.safetensors")
META_BASE_BYTES = 4 * 2**20
META_BYTES_PER_RANK = 64 * 2**10
"""memx.json's cap: a rank's RNG states are ~14 KB of JSON and its piece table a few KB per
hundred tensors; parsing takes ~50x the file's size in memory (a 28 MB file took 1.3 GB)."""
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# The container below adds "parts.{i}." to every name; i depends on the split, so it is dropped.
_PART_PREFIX = re.compile(r"(^|\.)parts\.\d+\.")


class _Parts(torch.nn.Module):
    """One module over a rank's model chunks: the state-dict helpers take one model."""

    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)


def _global_names(container: _Parts, optimizer) -> tuple[dict, dict, dict]:
    """Model and optimizer state under names that do not depend on the split, and each global
    name's local key."""
    model_state, optim_state = get_state_dict(container, optimizer, options=_OPTIONS)
    local_name = {_PART_PREFIX.sub(r"\1", k, count=1): k for k in [*model_state, *optim_state]}
    back = {v: k for k, v in local_name.items()}
    return ({back[k]: v for k, v in model_state.items()}, {back[k]: v for k, v in optim_state.items()},
            local_name)


@dataclass
class Resumed:
    step: int
    """The last completed step: training continues with step + 1."""
    data_state: dict
    path: str


# --------------------------------------------------------------------------- pieces of tensors


def _piece(value: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """(local tensor, global shape, global offset of the local box) of a tensor or DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), list(value.shape), list(offset)
    return value, list(value.shape), [0] * value.dim()


def _key(name: str, offset: list[int]) -> str:
    return f"{name}@{','.join(map(str, offset))}"


def _rng_state(rank: int) -> dict:
    out = {f"rng.rank{rank}.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def _rng_values(rank: int) -> dict:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, pgauss = random.getstate()
    return {f"rng.rank{rank}.numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            f"rng.rank{rank}.python": [version, list(internal), pgauss]}


def _set_rng_values(rank: int, values: dict) -> None:
    name, keys, pos, has_gauss, gauss = values[f"rng.rank{rank}.numpy"]
    np.random.set_state((str(name), np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(gauss)))
    version, internal, gauss = values[f"rng.rank{rank}.python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))


def _same_kind(current, stored) -> bool:
    """Whether a stored optimizer value can stand where ``current`` (its JSON form) is: a finite
    number for a number, a bool for a bool, a list as long with elements alike, else equal types."""
    if isinstance(current, bool) or current is None or isinstance(current, str):
        return type(stored) is type(current)
    if isinstance(current, (int, float)):
        return isinstance(stored, (int, float)) and not isinstance(stored, bool) and math.isfinite(stored)
    if isinstance(current, list):
        return isinstance(stored, list) and len(stored) == len(current) and all(map(_same_kind, current, stored))
    return False


def _plain(value):
    """A non-tensor optimizer value (lr, betas, flags) as JSON."""
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, (bool, int, float, str, list)):
        return value
    raise ConfigError("checkpoint", f"cannot store a {type(value).__name__} optimizer value",
                      "use an optimizer whose hyper-parameters are numbers")


# --------------------------------------------------------------------------- saving


def _remove(path: str) -> None:
    """Delete a step folder; a link planted in its place is removed, never followed."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _write_failure(rank: int, exc: OSError | ConfigError) -> str:
    # write_json_atomic reports its failed write as its own ConfigError line
    return f"rank {rank} could not write it ({exc.problem if isinstance(exc, ConfigError) else exc.strerror or exc})"


def _agree(failures: list, directory: str, step: int, tmp: str) -> None:
    """Raise, on every rank, the first write failure any rank had (a full disk, a quota), once
    rank 0 removed the half-written folder: otherwise the failed rank dies alone while the others
    wait at the next collective. ``failures``: every rank's, gathered (None where it wrote)."""
    failures = [f for f in failures if f]
    if not failures:
        return
    if dist.get_rank() == 0:
        _remove(tmp)
    latest = latest_checkpoint(directory)
    kept = f"{os.path.basename(latest)} is intact" if latest else "no earlier checkpoint exists"
    raise ConfigError("checkpoint", f"step {step} was not saved under {directory}: {failures[0]}; {kept}",
                      "free space on that disk (or give --run-dir on one with room) and resume the run")


def save_checkpoint(directory: str, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                    step: int, data_state: dict | None = None, plan=None, keep: int | None = None) -> str:
    """Every rank calls this after ``step``; returns the checkpoint's folder. ``keep``: delete all
    but the newest ``keep`` step folders once this one is complete. A write that fails on any
    rank raises the same ConfigError on every rank and leaves the earlier checkpoints as they were."""
    rank = dist.get_rank()
    final = os.path.join(directory, f"step-{step:08d}")
    tmp = final + ".tmp"
    failure = None
    if rank == 0:  # also the half-written folders of saves killed earlier (kill -9)
        try:
            for stale in os.listdir(directory) if os.path.isdir(directory) else []:
                if re.fullmatch(r"step-\d{8}\.tmp", stale):
                    _remove(os.path.join(directory, stale))
            os.makedirs(tmp)
        except OSError as exc:
            failure = _write_failure(rank, exc)
    model_state, optim_state, _ = _global_names(_Parts(model_parts), optimizer)
    tensors, values = {}, {}
    for prefix, state in (("model", model_state), ("optimizer", optim_state)):
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{name}"] = _piece(value)
            else:
                values[f"{prefix}.{name}"] = _plain(value)
    tensors.update({k: _piece(v) for k, v in _rng_state(rank).items()})
    values.update(_rng_values(rank))
    mine = [[name, offset, list(local.shape), global_shape]
            for name, (local, global_shape, offset) in tensors.items() if local.numel()]
    # Also the barrier that makes tmp exist for every rank (or tells them rank 0 could not make it).
    everyone = all_gather_json({"pieces": mine, "values": values, "failure": failure})
    _agree([sent["failure"] for sent in everyone], directory, step, tmp)
    # Each distinct piece once: written by the lowest rank that holds it (DP replicas hold copies).
    writer: dict[tuple, tuple[int, list]] = {}
    for r, sent in enumerate(everyone):
        for name, offset, shape, global_shape in sent["pieces"]:
            writer.setdefault((name, tuple(offset), tuple(shape)), (r, global_shape))
    try:
        save_file({_key(name, offset): tensors[name][0].detach().to("cpu", copy=True).contiguous()
                   for name, offset, shape, _ in mine if writer[(name, tuple(offset), tuple(shape))][0] == rank},
                  os.path.join(tmp, f"rank{rank:05d}.safetensors"))
    except OSError as exc:
        failure = _write_failure(rank, exc)
    _agree(all_gather_json(failure), directory, step, tmp)
    if rank == 0:
        try:
            _complete(directory, final, tmp, step, data_state, plan, everyone, writer, keep)
        except (OSError, ConfigError) as exc:
            failure = _write_failure(rank, exc)
    _agree(all_gather_json(failure), directory, step, tmp)
    return final


def _complete(directory, final, tmp, step, data_state, plan, everyone, writer, keep) -> None:
    """Rank 0, once every rank wrote its pieces: the index, then the folder and latest.json."""
    index: dict[str, dict] = {}
    for (name, offset, shape), (r, global_shape) in writer.items():
        entry = index.setdefault(name, {"shape": global_shape, "pieces": []})
        entry["pieces"].append({"file": f"rank{r:05d}.safetensors", "key": _key(name, list(offset)),
                                "offset": list(offset), "shape": list(shape)})
    write_json_atomic(os.path.join(tmp, META), {
        "format": FORMAT, "step": step, "data_state": data_state or {}, "world_size": dist.get_world_size(),
        "plan": plan.to_dict() if plan is not None else None,
        "values": {k: v for sent in everyone for k, v in sent["values"].items()}, "tensors": index})
    _remove(final)
    os.replace(tmp, final)
    write_json_atomic(os.path.join(directory, LATEST), {"step": step, "path": os.path.basename(final)},
                      overwrite=True)
    if keep is not None:
        done = sorted(d for d in os.listdir(directory) if STEP_DIR.fullmatch(d))
        for old in done[:-keep]:
            _remove(os.path.join(directory, old))


# --------------------------------------------------------------------------- loading


def _confined(directory: str, name: str, what: str) -> str:
    """``directory/name`` when it resolves inside ``directory``."""
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(path) != root:
        raise ConfigError(what, f"{name!r} leads outside {directory}", "checkpoints are read from the run "
                          "directory only; delete the tampered entry")
    return path


def latest_checkpoint(directory: str) -> str | None:
    where = f"{directory}/{LATEST}"
    if not os.path.lexists(os.path.join(directory, LATEST)):
        return None
    fix = "delete it to resume from no checkpoint, or point it at a complete step-* folder"
    data = load_json(os.path.join(directory, LATEST), where, 4096, fix)  # regular files only: a FIFO never blocks
    if not isinstance(data, dict) or not isinstance(data.get("path"), str) or not STEP_DIR.fullmatch(data["path"]):
        raise ConfigError(where, "corrupt or not a step-NNNNNNNN folder of this directory", fix)
    path = _confined(directory, data["path"], where)
    if not os.path.isdir(path):
        raise ConfigError(where, f"{data['path']} is missing", "delete latest.json to start from no checkpoint")
    return path


def meta_cap(path: str) -> int:
    """The most bytes memx.json of the checkpoint folder ``path`` may hold: by the job's ranks or
    the folder's rank files, whichever are more."""
    files = sum(1 for name in os.listdir(path) if RANK_FILE.fullmatch(name))
    ranks = max(files, dist.get_world_size() if dist.is_initialized() else 1)
    return META_BASE_BYTES + META_BYTES_PER_RANK * ranks


def _read_meta(path: str) -> dict:
    where = f"{path}/{META}"
    meta = load_json(_confined(path, META, where), "checkpoint", meta_cap(path), fix="delete this checkpoint folder")
    ok = (isinstance(meta, dict) and meta.get("format") == FORMAT and isinstance(meta.get("step"), int)
          and meta["step"] >= 0 and isinstance(meta.get("data_state"), dict) and isinstance(meta.get("values"), dict)
          and isinstance(meta.get("tensors"), dict))
    if not ok:
        raise ConfigError(where, f"not a memx checkpoint of format {FORMAT}", "delete this checkpoint folder")
    for name, entry in meta["tensors"].items():
        _check_entry(name, entry, where)
    return meta


def _ints(x, n=None) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x) \
        and (n is None or len(x) == n)


def _check_entry(name: str, entry, where: str) -> None:
    ok = isinstance(entry, dict) and _ints(entry.get("shape")) and isinstance(entry.get("pieces"), list)
    if ok:
        shape = entry["shape"]
        for p in entry["pieces"]:
            ok = ok and isinstance(p, dict) and isinstance(p.get("file"), str) and RANK_FILE.fullmatch(p["file"]) \
                and isinstance(p.get("key"), str) and _ints(p.get("offset"), len(shape)) \
                and _ints(p.get("shape"), len(shape)) \
                and all(o + s <= g for o, s, g in zip(p["offset"], p["shape"], shape))
    if not ok:
        raise ConfigError(f"{where}.tensors.{name}", "malformed piece table", "delete this checkpoint folder")


class _Reader:
    """Reads boxes of stored tensors, opening each rank file once."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta, self.files = path, meta, {}

    def _file(self, name: str):
        if name not in self.files:
            self.files[name] = safe_open(_confined(self.path, name, f"{self.path}/{name}"), framework="pt")
        return self.files[name]

    def fill(self, name: str, target: torch.Tensor, shape: list[int], offset: list[int]) -> None:
        """Copy the stored ``name`` into ``target``, the box at ``offset`` of a tensor of ``shape``."""
        entry = self.meta["tensors"].get(name)
        if entry is None or entry["shape"] != shape:
            raise ConfigError("checkpoint", f"{name} is missing or has another shape in {self.path}",
                              "resume with the model the checkpoint was written for")
        covered = 0
        for p in entry["pieces"]:
            lo = [max(a, b) for a, b in zip(offset, p["offset"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, target.shape, p["offset"], p["shape"])]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            try:
                stored = self._file(p["file"])
                piece = stored.get_slice(p["key"])[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, p["offset"]))] \
                    if target.dim() else stored.get_tensor(p["key"])
            except Exception as exc:  # safetensors raises its own errors for bad files and keys
                raise ConfigError(f"{self.path}/{p['file']}", f"cannot read {p['key']} ({exc})",
                                  "delete this checkpoint folder") from None
            box = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset))
            if tuple(piece.shape) != tuple(target[box].shape):
                raise ConfigError(f"{self.path}/{p['file']}", f"{p['key']} has shape {list(piece.shape)}",
                                  "delete this checkpoint folder")
            target[box].copy_(piece)
            covered += piece.numel()
        if covered != target.numel():
            raise ConfigError("checkpoint", f"{name}: the stored pieces cover {covered} of {target.numel()} "
                              f"elements this rank needs", "delete this checkpoint folder")


def load_checkpoint(directory: str, model_parts: list[torch.nn.Module],
                    optimizer: torch.optim.Optimizer) -> Resumed | None:
    """Load the latest checkpoint in ``directory`` into this rank's parts under the current plan;
    None when there is none. Every rank calls this."""
    path = latest_checkpoint(directory)
    if path is None:
        return None
    meta = _read_meta(path)
    rank = dist.get_rank()
    reader = _Reader(path, meta)
    container = _Parts(model_parts)
    model_state, optim_state, local_name = _global_names(container, optimizer)
    with torch.no_grad():
        for prefix, state in (("model", model_state), ("optimizer", optim_state)):
            for name, value in state.items():
                stored = f"{prefix}.{name}"
                if isinstance(value, torch.Tensor):
                    local, shape, offset = _piece(value)
                    if local.numel():
                        reader.fill(stored, local, shape, offset)
                elif stored in meta["values"]:
                    got = meta["values"][stored]
                    if not _same_kind(_plain(value), got):
                        raise ConfigError(f"{path}/{META}: {stored}", f"{str(got)[:40]!r} is not what the optimizer "
                                          f"holds there ({type(value).__name__})", "delete this checkpoint folder")
                    state[name] = tuple(got) if isinstance(value, tuple) and isinstance(got, list) else got
    set_state_dict(container, optimizer, model_state_dict={local_name[g]: v for g, v in model_state.items()},
                   optim_state_dict={local_name[g]: v for g, v in optim_state.items()}, options=_OPTIONS)
    rng = _rng_state(rank)
    if all(k in meta["tensors"] for k in rng) and all(k in meta["values"] for k in _rng_values(rank)):
        for name, current in rng.items():
            reader.fill(name, current, list(current.shape), [0] * current.dim())
        try:
            torch.set_rng_state(rng[f"rng.rank{rank}.torch"])
            if f"rng.rank{rank}.cuda" in rng:
                torch.cuda.set_rng_state(rng[f"rng.rank{rank}.cuda"])
            _set_rng_values(rank, meta["values"])
        except (TypeError, ValueError, OverflowError, RuntimeError):
            raise ConfigError(f"{path}/{META}", f"rng of rank {rank} is malformed", "delete this checkpoint "
                              "folder") from None
    return Resumed(meta["step"], dict(meta["data_state"]), path)
