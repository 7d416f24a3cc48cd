"""Many layouts at once (``memx estimate --cases FILE``): one row of a CSV or JSON-lines file per
layout, one JSON object out per row, in one process.

Each row is scored as :func:`~memx_launch.planning.estimate.evaluate_layout` scores it for
``memx estimate`` with flags; parsed models and clusters, cost models, cost tables and Phi's reference
medians (only with ``phi``: they need a search) are cached across rows, so a file of thousands
of layouts of one model on one cluster costs one reference search, or none without Phi. A bad
row gives that row an ``error`` and never stops the others.

Columns (an empty cell or a missing key is the default): the layout columns below, ``id``
(echoed back), and any field of :class:`~memx_launch.specs.training.TrainingSpec` by its name,
so training fields added there work here without more code. No torch import.
"""

from __future__ import annotations

import csv
import io
import dataclasses
import json
import math
import os
import typing
from typing import Callable, Iterator

from memx_launch.errors import ConfigError, MemxError
from memx_launch.files import write_text_atomic
from memx_launch.planning import costmodel as cm
from memx_launch.planning.estimate import LayoutScorer, layout_objective, short_gib
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.search import default_references
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.inputs import parse_json, parse_number, read_text
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

LAYOUT_COLUMNS = ("model", "cluster", "tp", "pp", "cp", "dp", "micro_batch_size", "layers_per_stage", "stage_devices",
                  "stage_tp", "stage_dp", "recompute", "schedule", "virtual_stages")
# Echoed back as given: a row's name, and what a real run of the layout measured (``memx cluster
# fit`` fits a cluster file to them; beside the prediction they are what ``memx evaluate`` compares).
ECHO_COLUMNS = ("id", "measured_time_s", "measured_peak_memory_gib")
# Columns that override a field of the row's model (ModelSpec).
MODEL_COLUMNS = ("parallel_blocks", "lm_head")
# memx estimate flags that fill empty cells (paths relative to the working directory): the model,
# the cluster, the model's overrides and every training flag (a TrainingSpec field by its name).
FLAG_DEFAULTS = ("model", "cluster", *MODEL_COLUMNS, *(f.name for f in dataclasses.fields(TrainingSpec)))
_LIST_SEPARATORS = ("/", "|", ",")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def read_cases(path: str) -> Iterator[tuple[int, dict | ConfigError]]:
    """(row number from 1, the row's values or why the row cannot be read) for every row.
    ``.csv``: a header line, then one layout per line; ``.jsonl``/``.ndjson``/``.json``: one
    JSON object per line (blank lines skipped)."""
    kind = os.path.splitext(path)[1].lower()
    if kind not in (".csv", ".jsonl", ".ndjson", ".json"):
        raise ConfigError("--cases", f"{path} is neither .csv nor .jsonl", "name the file by its format")
    # the guarded reader: a FIFO, a device or a huge file is refused before any row is read
    text = read_text(path, "--cases", fix="pass a .csv or .jsonl file of layouts")
    text = text.removeprefix("\ufeff")  # a spreadsheet's byte-order mark is no column
    if kind == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if reader.fieldnames is None:
            raise ConfigError("--cases", f"{path} is empty", "write a header line, then one layout per row")
        for n, row in enumerate(reader, 1):
            if None in row:
                yield n, ConfigError(f"row {n}", f"{len(row[None])} more cells than the header has columns",
                                     "quote cells that hold commas")
            else:
                yield n, {k.strip(): v for k, v in row.items() if k is not None}
        return
    n = 0
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        n += 1
        try:
            row = parse_json(line, f"line {line_no}", "this line", "one JSON object per line")
        except ConfigError as exc:
            yield n, exc
            continue
        yield n, row if isinstance(row, dict) else ConfigError(
            f"line {line_no}", "not a JSON object", 'write {"column": value, ...} per line')

def run_cases(path: str, out: str | None = None, overwrite: bool = False, **runner_args) -> str:
    """Estimate every row of ``path`` with a :class:`CaseRunner` (``runner_args``; its base folder
    is the file's): JSON lines to ``out`` (written atomically once all rows are done) or to stdout
    as they come. Returns a one-line summary: how many rows fit, do not fit, or failed."""
    runner = CaseRunner(os.path.dirname(os.path.abspath(path)), **runner_args)
    lines, counts = [], {"fit": 0, "do not fit": 0, "error": 0}
    for n, row in read_cases(path):
        result = {"row": n, **runner.estimate(row)}
        counts["error" if "error" in result else "fit" if result["fits"] else "do not fit"] += 1
        line = json.dumps(result, allow_nan=False)
        if out:
            lines.append(line + "\n")
        else:
            print(line)
    if out:
        write_text_atomic(out, "".join(lines), overwrite=overwrite, flag="--out")
    return (f"{sum(counts.values())} rows: " + ", ".join(f"{v} {k}" for k, v in counts.items())
            + (f"; written to {out}" if out else ""))


class CaseRunner:
    """Estimates rows one after the other, caching everything rows share.

    ``defaults`` fill absent cells (``memx estimate --model/--cluster/...``); relative paths in
    ``model`` and ``cluster`` cells are relative to ``base_dir`` (the cases file's folder).
    ``cost_model_for(model, cluster, training)`` gives the learned cost model (``--profile-db``);
    None: the analytical model. ``phi``: also score Phi, against the medians of one default
    search per model, cluster and training (``--phi``); without it no search runs. ``cluster``:
    every row's cluster, whatever its cell names (``memx cluster fit`` scores its candidates so).
    """

    def __init__(self, base_dir: str = ".", defaults: dict | None = None, memory_headroom: float = 0.0,
                 weights: tuple[float, float, float] | None = None,
                 cost_model_for: Callable | None = None, phi: bool = False, cluster: ClusterSpec | None = None):
        self.base_dir = base_dir
        # Defaults come from the command line: their paths are relative to the working directory.
        self.defaults = {k: os.path.abspath(v) if k in ("model", "cluster") and os.path.exists(v) else v
                         for k, v in (defaults or {}).items() if v is not None}
        self.memory_headroom = memory_headroom
        self.weights = weights
        self.cost_model_for = cost_model_for
        self.phi = phi
        self.cluster = cluster
        self._cluster_paths: dict[str, str] = {}
        self._training_types = typing.get_type_hints(TrainingSpec)
        self._training_fields = {f.name for f in dataclasses.fields(TrainingSpec)}
        self._models, self._clusters, self._trainings, self._scorers, self._references = {}, {}, {}, {}, {}
        self._layouts: dict[int, dict] = {}  # parsed layouts by cluster, shared by its setups' scorers

    def estimate(self, row: dict | ConfigError) -> dict:
        """The row's estimate, or ``{"error": one line}``; never raises for a bad row."""
        out = {c: row[c] for c in ECHO_COLUMNS if not _absent(row.get(c))} if isinstance(row, dict) else {}
        try:
            if isinstance(row, ConfigError):
                raise row
            return {**out, **self._estimate(row)}
        except ConfigError as exc:  # flag names become the column names a row uses
            field = "/".join(f.removeprefix("--").replace("-", "_") for f in exc.field.split("/")) \
                if exc.field.startswith("--") else exc.field
            return {**out, "error": str(ConfigError(field, exc.problem, exc.fix))}
        except MemxError as exc:
            return {**out, "error": str(exc)}
        except Exception as exc:  # a bug, said as such, must not stop the other rows either
            return {**out, "error": f"internal error: {type(exc).__name__}: {exc}"}

    def score(self, row: dict) -> tuple[GroupResult, LayoutScorer]:
        """The row's layout scored (one policy row), and the scorer of its model, cluster and
        training; a bad row raises its :class:`~memx_launch.errors.ConfigError`."""
        values = {**self.defaults, **{k: v for k, v in row.items() if not _absent(v)}}
        # Every column memx cannot express, named at once: a row asking for several features
        # should not be fixed and re-run one column at a time.
        unknown = [c for c in values if c not in LAYOUT_COLUMNS and c not in ECHO_COLUMNS and c not in MODEL_COLUMNS
                   and c not in self._training_fields]
        if unknown:
            raise ConfigError(", ".join(unknown), "unknown column" + "s" * (len(unknown) > 1),
                              "use the columns listed in docs/estimate.md")
        training_kwargs = {c: _convert(c, v, self._training_types[c]) for c, v in values.items()
                           if c in self._training_fields}
        for column in ("model",) if self.cluster else ("model", "cluster"):
            if column not in values:
                raise ConfigError(column, "missing", f"give a {column} column or --{column}")
        model = self._model(str(values["model"]), tuple((c, _convert(c, values[c], bool))
                                                         for c in MODEL_COLUMNS if c in values))
        cluster = self.cluster if self.cluster is not None else self._cluster(str(values["cluster"]))
        training_key = (model.seq_len, *sorted(training_kwargs.items()))
        if training_key not in self._trainings:  # a spec per distinct setup, not per row
            self._trainings[training_key] = TrainingSpec(**{"seq_len": model.seq_len, **training_kwargs})
        training = self._trainings[training_key]

        stage_devices = _list(values, "stage_devices", str)
        layers = _list(values, "layers_per_stage", int)
        recompute = _list(values, "recompute", str)
        stage_tp = _list(values, "stage_tp", int)
        stage_dp = _list(values, "stage_dp", int)
        given_pp = [len(x) for x in (layers, stage_devices, stage_tp, stage_dp) if x is not None]
        pp = _int(values, "pp", given_pp[0] if given_pp else 1)
        tp = _int(values, "tp", 1) if stage_tp is None or "tp" in values else None
        cp = _int(values, "cp", 1)
        dp = (_int(values, "dp", max(1, cluster.world_size // ((sum(stage_tp) if stage_tp else tp * pp) * cp)))
              if stage_dp is None or "dp" in values else None)
        schedule = str(values.get("schedule", "1f1b"))
        v = _int(values, "virtual_stages", 1)
        if schedule == "interleaved" and "virtual_stages" not in values:
            raise ConfigError("virtual_stages", "missing for the interleaved schedule", "e.g. 2")

        key = (id(model), id(cluster), training)  # models and clusters are cached: ids are stable
        if key not in self._scorers:
            cost_model = self.cost_model_for(model, cluster, training) if self.cost_model_for else None
            self._scorers[key] = LayoutScorer(model, cluster, training, cost_model, self.memory_headroom,
                                              self._layouts.setdefault(id(cluster), {}))
        scorer = self._scorers[key]
        result, _ = scorer.score(tp=tp, stage_tp=stage_tp, pp=pp, dp=dp, cp=cp, stage_dp=stage_dp,
                                 micro_batch_size=_int(values, "micro_batch_size", 1), layers_per_stage=layers,
                                 recompute=recompute, stage_devices=stage_devices, schedule=schedule,
                                 virtual_stages=v)
        return result, scorer

    def _estimate(self, row: dict) -> dict:
        result, scorer = self.score(row)
        training = scorer.training
        # Read off the scored arrays as to_plan would write them: no plan object per row.
        peaks = [round(float(x) / cm.GIB, 6) for x in result.memory[0]]
        short = short_gib(peaks, [float(x) / cm.GIB for x in result.capacity[0]], self.memory_headroom)
        out = {"fits": not any(short), "stage_peak_memory_gib": peaks, "peak_memory_gib": max(peaks),
               "short_gib": [round(x, 6) for x in short], "iteration_time_s": _number(float(result.T[0])),
               "layers_per_stage": [int(n) for n in result.layers[0]],
               "split": "even" if _absent(row.get("layers_per_stage")) else "given",
               "num_microbatches": training.global_batch_size // (result.layout.dp * result.mbs)}
        if self.phi:
            if scorer not in self._references:
                self._references[scorer] = default_references(scorer.model, scorer.cluster, training,
                                                              scorer.cost_model)
            out["phi"] = _number(layout_objective(result, self._references[scorer], self.weights).phi)
        return out

    def _model(self, value: str, overrides: tuple = ()):
        """The row's model, with its MODEL_COLUMNS overrides; cached, so that its id keys the scorers."""
        if (value, overrides) not in self._models:
            if value not in self._models:
                path = os.path.join(self.base_dir, value)
                try:
                    self._models[value] = get_model(path if os.path.exists(path) else value)
                except ConfigError as exc:
                    raise ConfigError("model", exc.problem, exc.fix) from None
            self._models[value, overrides] = dataclasses.replace(self._models[value], **dict(overrides))
        return self._models[value, overrides]

    def _cluster(self, value: str) -> ClusterSpec:
        if value not in self._cluster_paths:
            self._cluster_paths[value] = os.path.normpath(os.path.join(self.base_dir, value))
        path = self._cluster_paths[value]
        if path not in self._clusters:  # one parse per file, however the rows spell its path
            try:
                self._clusters[path] = ClusterSpec.from_yaml(path)
            except ConfigError as exc:
                raise ConfigError("cluster", exc.problem, exc.fix) from None
        return self._clusters[path]


def _absent(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _convert(column: str, value, kind):
    """A cell to the type of its TrainingSpec field (``int``, ``float``, ``bool``, ``str``;
    ``X | None`` as X)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    kind = args[0] if len(args) == 1 else kind
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in _TRUE + _FALSE:
            return str(value).strip().lower() in _TRUE
        raise ConfigError(column, f"expected true or false, got {value!r}")
    if kind is int:
        return _as_int(column, value)
    if kind is float:
        if isinstance(value, str):  # float() takes '１.５' and spends seconds on 5,000 digits
            return parse_number(value.strip(), float, column, "write the number in ASCII digits")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(column, f"expected a number, got {value!r}") from None
    return value.strip() if isinstance(value, str) else value


def _as_int(column: str, value) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(column, f"expected an integer, got {value!r}")
    if isinstance(value, str):  # int() takes '１' and '٣' and spends seconds on 5,000 digits
        return parse_number(value.strip(), int, column, "write the number in ASCII digits")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(column, f"expected an integer, got {value!r}") from None


def _int(values: dict, column: str, default: int) -> int:
    if column not in values:
        return default
    number = _as_int(column, values[column])
    if number < 1:
        raise ConfigError(column, f"must be at least 1, got {number}")
    return number


def _list(values: dict, column: str, cast) -> list | None:
    """``8/8/8/8``, ``a|b`` or ``full,none`` (or a JSON list); None when absent."""
    if column not in values:
        return None
    value = values[column]
    if not isinstance(value, list):
        text = str(value)
        sep = next((s for s in _LIST_SEPARATORS if s in text), None)
        value = text.split(sep) if sep else [text]
    return [_as_int(column, x) if cast is int else str(x).strip() for x in value]


def _number(x: float) -> float | None:
    """JSON has no NaN: an undefined value (Phi without reference plans) is null."""
    return None if math.isnan(x) else x

