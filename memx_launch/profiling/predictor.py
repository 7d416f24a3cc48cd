"""Learned per-block costs: one two-output XGBoost model over the analytical model's residual.

The model predicts log(measured / analytical) for the time and the memory of one transformer
block, so physics carries the trend (linear in micro-batch, 1/TP, s^2 attention) and the trees
learn only what the formulas miss (kernel efficiency at small shapes, launch overheads,
allocator slack). Outside the sampled range a tree is flat, and a flat ratio over a physical
model still extrapolates sensibly.

What belongs to one device type is its level, taken from its own samples (``Offsets``: per
TP degree of each model, since each TP degree is its own communication path). A type with
:data:`MIN_OWN_RECORDS` measured samples or more also gets trees of its own, fitted (and tuned)
on its samples alone: its predictions then depend on nothing the profile holds of other types,
so adding types to a profile never moves them. The fleet's trees, fitted on every sample, serve
the types with fewer samples and the unprofiled ones: they see the device only through the
physics features computed from its descriptors (analytical time, communication share), so the
shape they learn is shared and a type with a handful of samples gets it too; raw descriptor
columns let the trees carve one shape per type, which five samples of a new type cannot support.

Hyper-parameters are tuned by a small Gaussian-process Bayesian optimisation with k-fold
cross-validation. The model is saved as XGBoost UBJ/JSON plus a JSON sidecar holding the
format version, the signature of its training data and the model file's sha256 (checked before
XGBoost reads the file); nothing is ever pickled.
No torch import here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from memx_launch.planning.costmodel import NONE, AnalyticalCostModel, LayerCost
from memx_launch.errors import ConfigError
from memx_launch.files import atomic_output, write_json_atomic
from memx_launch.profiling.calibrated_parts import (measured_efficiency, measured_overhead_gib, part_levels,
                                                    one_descriptor_set, part_terms, with_type_fields)
from memx_launch.profiling.interpolation import monotone_in_micro_batch
from memx_launch.profiling.profiledb import Measurement
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.inputs import load_json, read_bytes
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.profiling.features import FEATURE_NAMES, Offsets, physics_features, training_rows
from memx_launch.profiling.tree_tuning import train_trees, tune_hyperparameters


PREDICTOR_FORMAT = 8
"""5: per-type trees in files of their own, each with its sha256 in the sidecar; 6: emulated
samples are learned against the estimate of the CPU they ran on (their vendor's GPU before);
7: the comm_share feature counts a block's TP all-reduces as the cost model does (separate gate
and up linears, parallel blocks, op-level recompute); 8: a type's base takes the host time per
layer its records measured."""
MIN_OWN_RECORDS = 8
"""Measured feasible samples from which a device type gets trees of its own (a three-point
design over micro-batch and TP holds 9; the new-type design's 5 lean on the fleet)."""
MAX_MODEL_BYTES = 64 * 2**20
"""A predictor of a few thousand records is well under 1 MB."""


@dataclass
class Predictor:
    """A fitted two-output booster plus what it was trained on."""

    booster: object
    """The fleet's trees: types without trees of their own."""
    meta: dict
    own_boosters: dict = field(default_factory=dict)
    """{device type: its own trees} (:data:`MIN_OWN_RECORDS`)."""

    @property
    def offsets(self) -> Offsets:
        return Offsets(**self.meta["offsets"])

    def predict_log_ratios(self, X: np.ndarray, device_types, models) -> np.ndarray:
        """[n, 2] predicted log(measured / analytical) for time and memory."""
        if X.shape[0] == 0:
            return np.zeros((0, 2))
        margin = self.offsets.margin(X, device_types, models)
        out = np.asarray(self.booster.inplace_predict(X, base_margin=margin), dtype=np.float64).reshape(-1, 2)
        device_types = np.asarray(device_types)
        for name, booster in self.own_boosters.items():
            rows = device_types == name
            if rows.any():
                out[rows] = np.asarray(booster.inplace_predict(X[rows], base_margin=margin[rows]),
                                       dtype=np.float64).reshape(-1, 2)
        return out

    def save(self, path: str) -> None:
        """``path`` ends in .ubj or .json (XGBoost's own formats); each type's own trees go to
        ``path`` with ``.typeN`` before the extension; the sidecar is ``path + '.meta.json'``
        and holds every model file's sha256."""
        if not path.endswith((".ubj", ".json")):
            raise ConfigError("--predictor", f"{path} must end in .ubj or .json", "e.g. predictor.ubj")
        self.meta["model_sha256"] = _save_booster(self.booster, path)
        own = {}
        for i, (name, booster) in enumerate(sorted(self.own_boosters.items())):
            own_path = own_model_path(path, i)
            own[name] = {**self.meta.get("own_models", {}).get(name, {}), "file": os.path.basename(own_path),
                         "sha256": _save_booster(booster, own_path)}
        self.meta["own_models"] = own
        write_json_atomic(sidecar_path(path), self.meta, overwrite=True)

    @classmethod
    def load(cls, path: str) -> "Predictor":
        fix = "re-train it from its profile (memx plan --profile-db FILE)"
        meta = load_json(sidecar_path(path), "--predictor", fix="load a predictor saved by memx (model file plus "
                         "its .meta.json)")
        version = meta.get("format_version") if isinstance(meta, dict) else None
        if version != PREDICTOR_FORMAT:
            raise ConfigError("--predictor", f"{path} has format version {version!r}, this memx reads "
                              f"{PREDICTOR_FORMAT}", fix)
        if tuple(meta.get("feature_names", ())) != FEATURE_NAMES:
            raise ConfigError("--predictor", f"{path} was trained on other features", fix)
        booster = _load_booster(path, meta.get("model_sha256"), fix)
        own = {name: _load_booster(os.path.join(os.path.dirname(path), os.path.basename(str(entry.get("file")))),
                                   entry.get("sha256"), fix)
               for name, entry in meta.get("own_models", {}).items()}
        return cls(booster, meta, own)


def _save_booster(booster, path: str) -> str:
    """Write ``booster`` atomically to ``path``; returns the file's sha256."""
    with atomic_output(path, "--predictor", overwrite=True, suffix=os.path.splitext(path)[1]) as tmp:
        booster.save_model(tmp)
        with open(tmp, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()


def _load_booster(path: str, sha256: str | None, fix: str):
    import xgboost as xgb

    # XGBoost's loader crashes the process (SIGSEGV) on some damaged files: only the bytes the
    # sidecar's hash vouches for reach it, read once so that they cannot change in between
    data = read_bytes(path, "--predictor", MAX_MODEL_BYTES, fix)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ConfigError("--predictor", f"{path} does not match the sha256 in its .meta.json (damaged)", fix)
    booster = xgb.Booster()
    try:
        booster.load_model(bytearray(data))
    except xgb.core.XGBoostError as exc:
        raise ConfigError("--predictor", f"cannot load {path} ({str(exc).splitlines()[0]})", fix) from None
    return booster


def sidecar_path(path: str) -> str:
    return path + ".meta.json"


def own_model_path(path: str, index: int) -> str:
    """Where the ``index``-th type's own trees are saved beside the fleet's ``path``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.type{index}{ext}"


def training_signature(records: list[Measurement]) -> dict:
    """What a predictor was fitted on: models, device types, software, and a content hash."""
    digest = hashlib.sha256("".join(sorted(r.to_json() for r in records)).encode()).hexdigest()[:16]
    return {
        "models": sorted({f"{r.model}:{r.model_signature}" for r in records}),
        "device_types": sorted({r.device_type for r in records}),
        "software": sorted({json.dumps(r.software, sort_keys=True) for r in records}),
        "records": len(records),
        "records_sha256": digest,
    }


def fit_predictor(records: list[Measurement], *, augmented: list[Measurement] = (), trials: int = 10,
                  seed: int = 0) -> Predictor:
    """Fit the two-output model on measured (plus augmented) records, tuning by CV."""
    signature = training_signature(records)
    # Physics before learning: no time falls as the micro-batch grows (measured and interpolated alike).
    monotone, capped = monotone_in_micro_batch(list(records) + list(augmented))
    # One analytical base per device type: what the learned model predicts on.
    consistent, descriptors = one_descriptor_set(monotone)
    records, augmented = consistent[:len(records)], consistent[len(records):]
    ts = training_rows(records + augmented)
    if len(ts.X) < 4:
        raise ConfigError("profile", f"only {len(ts.X)} feasible measurements",
                          "profile at least 4 configurations (memx profile --budget)")
    params, cv_error, history = tune_hyperparameters(ts, trials=trials, seed=seed)
    offsets = Offsets.fit(ts)
    booster = train_trees(ts, offsets, params, seed)
    own_boosters, own_models = {}, {}
    # A profile of one type: the fleet's trees are that type's own, fitted the same way.
    for name in sorted(own_model_types(records)) if len(set(ts.device_types)) > 1 else ():
        # Tuned and trained on the type's rows alone, so no other type's samples reach them
        # (its offsets, fitted on its own rows, are those of the fleet's margin).
        own = ts.subset(ts.device_types == name)
        own_params, own_error, _ = tune_hyperparameters(own, trials=trials, seed=seed)
        own_boosters[name] = train_trees(own, Offsets.fit(own), own_params, seed)
        own_models[name] = {"rows": int(len(own.X)), "hyperparameters": own_params, "cv_error": own_error}
    gain = booster.get_score(importance_type="gain")
    total = sum(gain.values()) or 1.0
    importance = {FEATURE_NAMES[int(k[1:])]: v / total for k, v in gain.items()}
    meta = {
        "format_version": PREDICTOR_FORMAT,
        "feature_names": list(FEATURE_NAMES),
        "targets": ["log(measured_time / analytical_time)", "log(measured_memory / analytical_memory)"],
        "training": signature,
        "rows": {"measured": len(records), "augmented": len(augmented), "used": int(len(ts.X)),
                 "with_memory": int(ts.has_memory.sum()), "times_capped": capped},
        "offsets": asdict(offsets),
        "part_levels": part_levels(records),
        "memory_overhead_gib": measured_overhead_gib(records),
        "efficiency": measured_efficiency(records),
        "device_descriptors": descriptors,
        "hyperparameters": params,
        "cv_error": cv_error,
        "own_models": own_models,
        "tuning_history": history,
        "feature_importance": dict(sorted(importance.items(), key=lambda kv: -kv[1])),
    }
    return Predictor(booster, meta, own_boosters)


def own_model_types(records: list[Measurement]) -> set[str]:
    """Device types with :data:`MIN_OWN_RECORDS` measured feasible samples or more."""
    counts: dict[str, int] = {}
    for r in records:
        if r.feasible and r.time_s:
            counts[r.device_type] = counts.get(r.device_type, 0) + 1
    return {name for name, n in counts.items() if n >= MIN_OWN_RECORDS}


class LearnedCostModel:
    """The analytical model scaled by learned ratios; a drop-in ``LayerCostModel``."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, predictor: Predictor,
                 measured_bridges: dict | None = None):
        # The ratios scale the analytical model of the profiled types as they were profiled,
        # not as the cluster file declares them, their measured host time included: a
        # --host-ms-per-layer speaks for the types the profile did not measure.
        profiled = predictor.meta.get("device_descriptors", {})
        base = with_type_fields(cluster, profiled)
        if training.host_ms_per_layer:
            base = with_type_fields(base, {d.name: {"host_ms_per_layer": training.host_ms_per_layer}
                                           for d in base.device_types if d.name not in profiled})
        self.analytical = AnalyticalCostModel(model, base, replace(training, host_ms_per_layer=None))
        # Profiles time the repeated block; the kinds beside it (a mixture's dense blocks) are timed at its ratios.
        self.other_kinds = [KindAtLearnedRatios(kind, self) for kind in self.analytical.other_kinds]
        self.model, self.cluster, self.training = model, cluster, training
        self.device_names = self.analytical.device_names
        self.device_types = self.analytical.device_types
        self.predictor = predictor
        self._model_signature = model.signature()
        known = set(predictor.meta["training"]["device_types"])
        unseen = [d for d in self.device_names if d not in known]
        if unseen:
            warnings.warn(f"no measurement of device type(s) {', '.join(unseen)}: their costs come from "
                          "the analytical model, scaled by the shape learned on the other types at their median "
                          "level", stacklevel=2)
        # Embedding and head: fixed cost + scaled analytical time where the profile timed them.
        levels = predictor.meta.get("part_levels", {})
        self._embedding_terms, self._head_terms = (part_terms(levels, part, self.device_names, self._model_signature)
                                                   for part in ("embedding", "head"))
        # A type's measured overhead replaces the vendor default, never a value the cluster file gives.
        measured = predictor.meta.get("memory_overhead_gib", {})
        self.measured_overhead_bytes = {d.name: measured[d.name] * 2**30 for d in self.device_types
                                        if d.memory_overhead_gib is None and d.name in measured}
        # Fitted (latency_s, gbps) per pair of domains: the planner's bridge where measured.
        self.measured_bridges = dict(measured_bridges or {})
        # Compute-share baselines: the profiled types at the efficiency their blocks sustained.
        self.calibrated_cluster = with_type_fields(
            base, {name: {"efficiency": e} for name, e in predictor.meta.get("efficiency", {}).items()})

    def for_training(self, training: TrainingSpec) -> "LearnedCostModel":
        """The same predictor over the analytical model of ``training`` (a layout that runs fully
        sharded, planning/layout_training.py); the types it has not measured were warned of once."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return LearnedCostModel(self.model, self.cluster, training, self.predictor, self.measured_bridges)

    def _learned(self, device, tp, mbs, seq, recompute):
        """(analytical costs, learned (time, memory) ratios, the queries' shape)."""
        shape = np.broadcast(*(np.asarray(a) for a in (device, tp, mbs, seq, recompute))).shape
        X, base = physics_features(self.analytical, device, tp, mbs, seq, recompute)
        names = np.asarray(self.device_names)[np.broadcast_to(np.asarray(device, dtype=np.int64), shape).reshape(-1)]
        ratio = np.exp(self.predictor.predict_log_ratios(X, names, np.full(len(names), self._model_signature)))
        return base, ratio, shape

    def layer_costs(self, device, tp, mbs, seq, recompute) -> LayerCost:
        base, ratio, shape = self._learned(device, tp, mbs, seq, recompute)
        return LayerCost(time_s=(base.time_s * ratio[:, 0]).reshape(shape),
                         activation_bytes=(base.activation_bytes * ratio[:, 1]).reshape(shape),
                         working_bytes=(base.working_bytes * ratio[:, 1]).reshape(shape))

    def attention_seconds(self, device, tp, mbs, seq) -> tuple[np.ndarray, np.ndarray]:
        """The analytical attention kernel's seconds, scaled as the block's time is learned to be."""
        ratio, shape = self._learned(device, tp, mbs, seq, NONE)[1:]
        return tuple(ratio[:, 0].reshape(shape) * t for t in self.analytical.attention_seconds(device, tp, mbs, seq))

    def embedding_time(self, device, tp, mbs, seq) -> np.ndarray:
        scale, fixed = (t[np.asarray(device)] for t in self._embedding_terms)
        return fixed + scale * self.analytical.embedding_time(device, tp, mbs, seq)

    def head_time(self, device, tp, mbs, seq) -> np.ndarray:
        scale, fixed = (t[np.asarray(device)] for t in self._head_terms)
        return fixed + scale * self.analytical.head_time(device, tp, mbs, seq)


class KindAtLearnedRatios:
    """A kind of layer priced beside the repeated one, which profiles do not time (a mixture's dense
    blocks, measured where memx-run calibrates its first expert block): its analytical time scaled
    by the time ratio learned for the repeated block at the same point, so that what the profile
    measured of the device (its efficiency, its overheads) carries over while the shape stays the
    kind's; its memory is its own count."""

    def __init__(self, kind: AnalyticalCostModel, learned: LearnedCostModel):
        self.kind, self.learned = kind, learned

    def layer_costs(self, device, tp, mbs, seq, recompute) -> LayerCost:
        ratio, shape = self.learned._learned(device, tp, mbs, seq, recompute)[1:]
        base = self.kind.layer_costs(device, tp, mbs, seq, recompute)
        return replace(base, time_s=np.asarray(base.time_s) * ratio[:, 0].reshape(shape))

    def attention_seconds(self, device, tp, mbs, seq) -> tuple[np.ndarray, np.ndarray]:
        ratio, shape = self.learned._learned(device, tp, mbs, seq, NONE)[1:]
        return tuple(ratio[:, 0].reshape(shape) * t for t in self.kind.attention_seconds(device, tp, mbs, seq))


class FittedProfile:
    """A profile DB's records and the one predictor fitted on all of them (its offsets and trees
    tell models apart by their shape signature), so that the models of one file share one fit
    and one cache file instead of refitting over each other; read once, fitted at first use.
    A saved predictor next to the profile is reused when its sidecar's training signature
    matches the records; otherwise (new records, other version) it is re-fitted and saved."""

    def __init__(self, profile_db_path: str, *, trials: int = 10):
        from memx_launch.profiling.profiledb import ProfileDB

        self.db, self.trials = ProfileDB(profile_db_path), trials
        self.records = self.db.read()

    @functools.cached_property
    def predictor(self) -> Predictor:
        from memx_launch.profiling.interpolation import augment_measurements

        path, records = os.path.splitext(self.db.path)[0] + ".predictor.ubj", self.records
        if os.path.exists(path):
            try:
                predictor = Predictor.load(path)
                if predictor.meta.get("training") == training_signature(records):
                    return predictor
            except Exception as exc:  # noqa: BLE001 (a cache: whatever is wrong with it, fit again)
                print(f"memx: warning: the cached predictor is not used ({exc}); fitting it again", file=sys.stderr)
        predictor = fit_predictor(records, augmented=augment_measurements(records).points, trials=self.trials)
        # A cache of the fit, next to the profile when memx may write there; said either way.
        try:
            predictor.save(path)
            print(f"memx: fitted the predictor on {len(records)} records of {self.db.path}; cached as {path} "
                  "(refitted when the profile changes)", file=sys.stderr)
        except (ConfigError, OSError) as exc:
            print(f"memx: fitted the predictor on {len(records)} records; not cached ({exc})", file=sys.stderr)
        return predictor

    def cost_model(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec):
        """The planner's cost model of ``model`` on this profile (``memx estimate --cases`` asks one
        per setup of one profile). Bridge measurements of the cluster's backend replace its bridge
        defaults per pair of domains."""
        from memx_launch.profiling.prediction_cache import CachedCostModel
        from memx_launch.profiling.profiledb import fitted_bridges

        self.db.for_model(model, self.records)  # a profile without this model is a one-line error, not a fit
        bridges = fitted_bridges(self.db.bridge_measurements(), cluster.bridge.backend) if cluster.crosses_domains else {}
        return CachedCostModel(LearnedCostModel(model, cluster, training, self.predictor, bridges))


def load_cost_model(profile_db_path: str, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                    *, trials: int = 10):
    """The planner's cost model from a profile: :meth:`FittedProfile.cost_model`."""
    return FittedProfile(profile_db_path, trials=trials).cost_model(model, cluster, training)
