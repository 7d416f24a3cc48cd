"""Types and ranges of a plan's fields as read from a file or a peer, checked before anything
uses them (plan.Plan.from_dict; its ``validate`` then checks how they fit together)."""

from __future__ import annotations

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_name, require_number, require_type
from memx_launch.specs.model import MAX_DIMENSION


MAX_WORLD_SIZE = 2**20
CROSSING_KINDS = ("pipeline", "data_parallel", "tied_embeddings")


def check_plan_types(data: dict, source: str) -> None:
    """Types and ranges of a plan read from a file or a peer, before anything uses it."""
    fix = "pass a plan written by memx plan --json"
    for key in ("tp", "pp", "cp", "dp", "micro_batch_size", "global_batch_size", "seq_len", "virtual_stages"):
        if key in data and not (key == "tp" and data[key] is None and data.get("stage_tp") is not None):
            require_number(data[key], f"{source}.{key}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True, fix=fix)
    for name in ("tp", "dp"):
        degrees = data.get(f"stage_{name}")
        if degrees is not None:
            if not isinstance(degrees, list) or not degrees:
                raise ConfigError(f"{source}.stage_{name}", f"must be a list of {name.upper()} degrees, one per stage", fix)
            for d in degrees:
                require_number(d, f"{source}.stage_{name}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True, fix=fix)
    stage_tp, stage_dp = data.get("stage_tp"), data.get("stage_dp")
    if all(k in data for k in ("tp", "pp", "dp")):
        tps = stage_tp if stage_tp is not None else [data["tp"]] * data["pp"]
        dps = stage_dp if stage_dp is not None else [data["dp"]] * len(tps)
        if sum(t * d for t, d in zip(tps, dps)) * data.get("cp", 1) > MAX_WORLD_SIZE:
            raise ConfigError(f"{source}.world_size", f"tp*pp*cp*dp over the limit of {MAX_WORLD_SIZE} ranks", fix)
    for key in ("model", "cluster", "schedule"):
        if key in data:
            require_type(data[key], str, f"{source}.{key}", fix)
            require_name(data[key], f"{source}.{key}")
    for key in ("predicted_iteration_time_s", "predicted_peak_memory_fraction", "predicted_memory_variance"):
        if key in data:
            require_number(data[key], f"{source}.{key}", lo=0, fix=fix)
    if "emulated" in data:
        require_type(data["emulated"], bool, f"{source}.emulated", fix)
    for key in ("training", "objective", "model_spec"):
        if key in data:
            require_type(data[key], dict, f"{source}.{key}", fix)
    if "objective" in data:
        o = data["objective"]
        require_number(o.get("phi"), f"{source}.objective.phi", fix=fix)
        require_type(o.get("profile"), str, f"{source}.objective.profile", fix)
        weights = o.get("weights")
        if not isinstance(weights, list) or len(weights) != 3:
            raise ConfigError(f"{source}.objective.weights", "must be a list of three numbers", fix)
        for w in weights:
            require_number(w, f"{source}.objective.weights", lo=0, fix=fix)
        require_type(o.get("terms", {}), dict, f"{source}.objective.terms", fix)
        for k, v in o.get("terms", {}).items():
            require_number(v, f"{source}.objective.terms.{k}", fix=fix)
    crossings = data.get("crossings", [])
    require_type(crossings, list, f"{source}.crossings", fix)
    for i, c in enumerate(crossings):
        where = f"{source}.crossings[{i}]"
        require_type(c, dict, where, fix)
        if c.get("kind") not in CROSSING_KINDS:
            raise ConfigError(f"{where}.kind", f"expected one of {', '.join(CROSSING_KINDS)}, got {c.get('kind')!r}", fix)
        for key in ("bytes_per_step", "seconds_per_step"):
            require_number(c.get(key), f"{where}.{key}", lo=0, fix=fix)
        if c.get("senders") is not None:
            require_number(c["senders"], f"{where}.senders", lo=1, hi=MAX_WORLD_SIZE, integer=True, fix=fix)
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"{source}.stages", "must be a non-empty list of stages", fix)
    for i, stage in enumerate(stages):
        where = f"{source}.stages[{i}]"
        require_type(stage, dict, where, fix)
        require_type(stage.get("device_type"), str, f"{where}.device_type", fix)
        require_name(stage["device_type"], f"{where}.device_type")
        require_number(stage.get("num_layers"), f"{where}.num_layers", lo=0, hi=MAX_DIMENSION,
                       integer=True, fix=fix)
        if not isinstance(stage.get("ranks"), list) or not stage["ranks"]:
            raise ConfigError(f"{where}.ranks", "must be a non-empty list of ranks", fix)
        for r in stage["ranks"]:
            require_number(r, f"{where}.ranks", lo=0, hi=MAX_WORLD_SIZE, integer=True, fix=fix)
        if "send_parts" in stage:
            require_number(stage["send_parts"], f"{where}.send_parts", lo=1, hi=MAX_DIMENSION, integer=True, fix=fix)
        for key in ("predicted_peak_memory_gib", "predicted_stage_time_s", "memory_capacity_gib"):
            if key in stage:
                require_number(stage[key], f"{where}.{key}", lo=0, fix=fix)
        parts = stage.get("memory_parts_gib")
        if parts is not None:
            require_type(parts, dict, f"{where}.memory_parts_gib", fix)
            for name, gib in parts.items():
                require_number(gib, f"{where}.memory_parts_gib.{name}", lo=0, fix=fix)
