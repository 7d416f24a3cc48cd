"""Per-layer tables measured elsewhere, as ProfileDB records (``memx profile import``).

Three formats (docs/profiler.md, "Importing profiles"):

- ``table``: memx's own schema, a CSV with a header or JSON lines, one configuration of one
  transformer block per row (:data:`TABLE_COLUMNS`): what any harness (nsys, torch.profiler,
  a framework's timers) can write.
- ``sailor``: Sailor's ``profile.json`` (github.com/eth-easl/sailor): ``profile[mbs][tp][unit] =
  [forward_s, backward_s, optimizer_s]``, unit 0 the embedding, 1..L the blocks, the last the
  final norm, output layer and loss.
- ``aceso``: Aceso's layer-time CSV as Sailor keeps it (``mbs,tp,algo,fwd,bwd,fwd+bwd``, one
  block); the rows of ``algo`` 0 (the default kernels).

Neither peer format says which device, model, precision or sequence length it measured: the
caller names them (the device type's descriptors and TP link come from a cluster file), so a
record rebuilds its analytical estimate as one memx measured would. No torch import.
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import asdict, replace

from memx_launch.errors import ConfigError
from memx_launch.planning.costmodel import causal_attention_flops, layer_forward_flops
from memx_launch.planning.peaks import matmul_peak_tflops, runs_as_tf32
from memx_launch.planning.plan import RECOMPUTE_LEVELS
from memx_launch.planning.tp_links import record_fields
from memx_launch.profiling.profiledb import Measurement
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.inputs import parse_json, read_text
from memx_launch.specs.model import MAX_DIMENSION, ModelSpec
from memx_launch.specs.training import DTYPE_BYTES, TrainingSpec

FORMATS = ("table", "sailor", "aceso")

TABLE_COLUMNS = {
    "tp": "tensor-parallel degree the block ran at (required)",
    "micro_batch_size": "sequences per micro-batch (required)",
    "seq_len": "tokens per sequence (default --seq-len, else the model's)",
    "time_s": "forward + backward seconds of one block (or forward_s and backward_s; "
              "required unless feasible is false)",
    "forward_s": "forward seconds of one block (with backward_s, in place of time_s)",
    "backward_s": "backward seconds of one block",
    "recompute": "none, selective or full (default none)",
    "dtype": "bf16, fp16 or fp32 (default --dtype)",
    "num_blocks": "blocks the memory was measured over (default 1)",
    "feasible": "false: the configuration ran out of memory (default true)",
    "peak_memory_bytes": "peak bytes allocated above the resting state over forward + backward (optional)",
    "peak_reserved_bytes": "the caching allocator's peak reserve over the same step (optional)",
    "embedding_time_s": "forward + backward of the embedding at this configuration (optional)",
    "head_time_s": "forward + backward of final norm, output layer and loss (optional)",
    "host_time_s": "seconds the host took to issue the block's forward + backward (optional)",
}
_ACESO_DEFAULT_KERNELS = "0"


def import_profile(path: str, fmt: str, model: ModelSpec, device: DeviceType, *, dtype: str | None,
                   seq_len: int | None = None, tp_link=lambda tp: None,
                   run_options: dict | None = None) -> list[Measurement]:
    """Records of the table at ``path`` in format ``fmt``, measured on ``device`` for ``model``.
    ``tp_link(tp)`` gives the link of a record's TP group (tp_links.tp_link); ``run_options`` the TrainingSpec
    options the blocks ran with (e.g. ``{"tf32": True}``). A bad cell is a one-line error naming
    its row and column."""
    if fmt not in FORMATS:
        raise ConfigError("--format", f"unknown format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
    seq = seq_len or model.seq_len
    rows = table_rows(path, fmt)
    software = {"imported": f"{fmt}:{os.path.basename(path)}"}
    out = []
    for where, row in rows:
        row_dtype = row.get("dtype") or dtype
        if row_dtype is None:
            raise ConfigError(f"{where}: dtype", "the table does not say the precision it measured",
                              "pass --dtype (Sailor's and Aceso's profiles are fp32)")
        record = replace(_record(where, row, model, device, row_dtype, seq, tp_link, software, f"import:{fmt}"),
                         run_options=dict(run_options or {}))
        _check_not_faster_than_the_peak(where, record, device)
        out.append(record)
    return out


def matmul_floor_seconds(record: Measurement, device: DeviceType, training: TrainingSpec | None = None) -> float:
    """The least forward + backward seconds ``record``'s block can take on ``device``: its matmul
    FLOPs (a recomputed forward included) at the peak of the precision it ran in (``training``;
    default the record's dtype and run options). Unfused attention multiplies the whole s x s
    square: no causal half skipped."""
    training = training or TrainingSpec(dtype=record.dtype, **record.run_options)
    forwards = 4.0 if record.recompute == "full" else 3.0  # forward, the backward's two, a recomputed one
    shape = (record.shape_spec(), record.micro_batch_size, record.seq_len, record.tp)
    unfused = not (training.flash_attention and device.flash_attention)
    flops = forwards * float(layer_forward_flops(*shape) + (causal_attention_flops(*shape) if unfused else 0.0))
    return flops / (matmul_peak_tflops(device, training) * 1e12)


def _check_not_faster_than_the_peak(where: str, record: Measurement, device: DeviceType) -> None:
    """A block timed faster than :func:`matmul_floor_seconds` was not run as the import says:
    typically fp32 matmuls run as TF32 (NGC containers and some frameworks turn it on), or a
    16-bit table imported as fp32."""
    if record.time_s is None:
        return
    training = TrainingSpec(dtype=record.dtype, **record.run_options)
    floor_s = matmul_floor_seconds(record, device, training)
    if record.time_s < floor_s:
        fix = "check --dtype and the device type's peak in --cluster"
        if training.dtype == "fp32" and not training.tf32:
            fix = f"pass --tf32 if its fp32 matmuls ran as TF32; else {fix}"
        raise ConfigError(f"{where}: time_s", f"{record.time_s * 1e3:.3g} ms is faster than the block's matmuls "
                          f"allow at {device.name}'s {record.dtype}"
                          f"{' (TF32)' if runs_as_tf32(device, training) else ''} peak of "
                          f"{matmul_peak_tflops(device, training):g} TFLOPS (at least {floor_s * 1e3:.3g} ms)", fix)


def table_rows(path: str, fmt: str) -> list[tuple[str, dict]]:
    """(where, the row's cells) of each measurement of the table at ``path`` in format ``fmt``, as
    the import reads them (Sailor's and Aceso's blocks as ``forward_s`` and ``backward_s``)."""
    text = read_text(path, "--table", fix="pass the profile table to import")
    rows = {"table": _table_rows, "sailor": _sailor_rows, "aceso": _aceso_rows}[fmt](text, path)
    if not rows:
        raise ConfigError(path, "holds no measurement", f"check that it is a {fmt} table")
    return rows


def _record(where, row, model, device, dtype, seq, tp_link, software, source) -> Measurement:
    tp = _integer(row, "tp", where)
    feasible = _boolean(row.get("feasible", True), f"{where}: feasible")
    time_s = _seconds(row, "time_s", where)
    if time_s is None and (row.get("forward_s") not in (None, "") or row.get("backward_s") not in (None, "")):
        forward, backward = _seconds(row, "forward_s", where), _seconds(row, "backward_s", where)
        if forward is None or backward is None:
            raise ConfigError(f"{where}: forward_s, backward_s", "only one of the two is given",
                              "give both, or time_s (forward + backward)")
        time_s = forward + backward
    if feasible and not time_s:
        raise ConfigError(f"{where}: time_s", "a feasible row needs a positive time",
                          "give time_s (or forward_s and backward_s), or feasible=false for an OOM")
    recompute = str(row.get("recompute") or "none")
    if recompute not in RECOMPUTE_LEVELS:
        raise ConfigError(f"{where}: recompute", f"unknown level {recompute!r}", f"use one of {', '.join(RECOMPUTE_LEVELS)}")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"{where}: dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
    seq_len = _integer(row, "seq_len", where) if row.get("seq_len") not in (None, "") else seq
    return Measurement(
        device_type=device.name, device={k: v for k, v in asdict(device).items() if k != "name"},
        model=model.name, model_signature=model.signature(), block_shape={**model.to_dict(), "seq_len": seq_len},
        tp=tp, micro_batch_size=_integer(row, "micro_batch_size", where), seq_len=seq_len, recompute=recompute,
        dtype=dtype, num_blocks=_integer(row, "num_blocks", where) if row.get("num_blocks") not in (None, "") else 1,
        feasible=feasible, time_s=time_s if feasible else None,
        peak_memory_bytes=_seconds(row, "peak_memory_bytes", where) if feasible else None,
        peak_reserved_bytes=_seconds(row, "peak_reserved_bytes", where) if feasible else None,
        embedding_time_s=_seconds(row, "embedding_time_s", where),
        head_time_s=_seconds(row, "head_time_s", where), host_time_s=_seconds(row, "host_time_s", where),
        **record_fields(tp_link(tp) if tp > 1 else None, tp), software=software, source=source)


def _integer(row: dict, column: str, where: str) -> int:
    value = row.get(column)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (1 <= number <= MAX_DIMENSION and number == int(number)):  # NaN fails the range
        raise ConfigError(f"{where}: {column}", f"{value!r} is not a positive integer", "e.g. 2")
    return int(number)


def _seconds(row: dict, column: str, where: str) -> float | None:
    """A non-negative number, or None when the cell is absent or empty."""
    value = row.get(column)
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ConfigError(f"{where}: {column}", f"{value!r} is not a non-negative number", "e.g. 0.0125")
    return number


def _boolean(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", ""):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ConfigError(where, f"{value!r} is not true or false", "write true or false")


def _table_rows(text: str, path: str) -> list[tuple[str, dict]]:
    """memx's schema: a CSV with a header, or JSON lines (by the file's extension)."""
    if os.path.splitext(path)[1].lower() in (".jsonl", ".ndjson", ".json"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                row = parse_json(line, f"line {n}", path, "one JSON object per line")
                if not isinstance(row, dict):
                    raise ConfigError(f"{path} line {n}", "not a JSON object", 'write {"tp": 1, ...} per line')
                rows.append((f"{path} line {n}", row))
    else:
        reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
        rows = [(f"{path} row {n}", {k.strip(): v.strip() if isinstance(v, str) else v for k, v in row.items()
                                     if k is not None}) for n, row in enumerate(reader, 1)]
    for where, row in rows:
        unknown = sorted(set(row) - set(TABLE_COLUMNS))
        if unknown:
            raise ConfigError(f"{where}: {', '.join(unknown)}", "unknown column" + "s" * (len(unknown) > 1),
                              f"use the columns of docs/profiler.md: {', '.join(TABLE_COLUMNS)}")
    return rows


def _sailor_rows(text: str, path: str) -> list[tuple[str, dict]]:
    """One row per (micro-batch, TP) of Sailor's profile: unit 1's forward and backward, the
    embedding (unit 0) and the head (the last unit)."""
    profile = parse_json(text, "profile", path, "a Sailor profile.json")
    if not isinstance(profile, dict):
        raise ConfigError(path, "is not a Sailor profile (a JSON object by micro-batch)", "pass a profile.json")
    rows = []
    for mbs, by_tp in profile.items():
        for tp, units in (by_tp.items() if isinstance(by_tp, dict) else ()):
            where = f"{path} [{mbs}][{tp}]"
            try:
                last = str(max(int(k) for k in units))
                embedding, head = (sum(float(x) for x in units[u][:2]) for u in ("0", last))
                forward, backward = (float(x) for x in units["1"][:2])
            except (KeyError, TypeError, ValueError, AttributeError):
                raise ConfigError(where, "is not a list of [forward_s, backward_s, optimizer_s] per layer unit "
                                  "0 (embedding), 1 (a block), ... (head)", "pass a Sailor profile.json") from None
            rows.append((where, {"tp": tp, "micro_batch_size": mbs, "forward_s": forward, "backward_s": backward,
                                 "embedding_time_s": embedding, "head_time_s": head}))
    return rows


def _aceso_rows(text: str, path: str) -> list[tuple[str, dict]]:
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
    missing = sorted({"mbs", "tp", "algo", "fwd", "bwd"} - set(reader.fieldnames or ()))
    if missing:
        raise ConfigError(f"{path}: {', '.join(missing)}", "missing column" + "s" * (len(missing) > 1),
                          "pass an Aceso layer-time CSV (mbs,tp,algo,fwd,bwd,fwd+bwd)")
    return [(f"{path} row {n}", {"tp": row["tp"], "micro_batch_size": row["mbs"], "forward_s": row["fwd"],
                                 "backward_s": row["bwd"]})
            for n, row in enumerate(reader, 1) if row["algo"].strip() == _ACESO_DEFAULT_KERNELS]

