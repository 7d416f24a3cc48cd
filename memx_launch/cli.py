"""The ``memx`` command: ``plan``, ``estimate``, ``export``, ``profile`` and ``evaluate``.

One ``add_<name>_command(subparsers)`` and one ``run_<name>(args) -> int`` per subcommand;
adding one means writing that pair and listing the first in ``COMMANDS``. Every
:class:`~memx_launch.errors.MemxError` becomes one ``memx: error: ...`` line on stderr and
its exit code (2, or 3 when nothing fits). Nothing here imports torch at module level:
planning and estimating run on any machine; only ``profile`` loads it.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import threading
import warnings

from memx_launch.errors import ConfigError, MemxError, NoFeasiblePlanError
from memx_launch.planning.plan import Plan
from memx_launch.files import check_output_path, write_json_atomic
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.config_file import add_config_args, config_yaml, parse_with_config
from memx_launch.specs.training import SETUPS, TrainingSpec
from memx_launch.specs.model import get_model


class _Parser(argparse.ArgumentParser):
    """argparse with the same one-line error format as every other memx error."""

    def error(self, message):
        self.exit(2, f"memx: error: {message} (see '{self.prog} --help')\n")


# --------------------------------------------------------------------------- shared helpers


def _add_target_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="catalog name (e.g. llama2-7b) or a Hugging Face config.json")
    p.add_argument("--cluster", required=required, help="cluster YAML file (see examples/clusters/)")
    p.add_argument("--global-batch-size", "--global_batch_size", type=int, help="sequences per iteration")
    p.add_argument("--seq-len", "--seq_len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="training precision (default bf16)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), help="optimizer (default adam)")
    p.add_argument("--distributed-optimizer", "--distributed_optimizer", action="store_true", default=None,
                   help="shard optimizer state over data-parallel ranks (Megatron distributed optimizer, ZeRO-1)")
    p.add_argument("--fully-sharded", "--fully_sharded", action="store_true", default=None,
                   help="shard weights, gradients and optimizer state over data-parallel ranks (FSDP, ZeRO-3)")
    p.add_argument("--setup", choices=tuple(SETUPS),
                   help="the training framework's memory setup (docs/setups.md); explicit flags win")
    p.add_argument("--sequence-parallel", "--sequence_parallel", action=argparse.BooleanOptionalAction,
                   default=None, help="Megatron sequence parallelism (default: on for --setup megatron)")
    p.add_argument("--flash-attention", "--flash_attention", action=argparse.BooleanOptionalAction,
                   default=None, help="fused attention, no s x s scores kept (default on)")
    p.add_argument("--grad-dtype", "--grad_dtype", choices=("fp32", "bf16", "fp16"),
                   help="gradient precision (default fp32; bf16/fp16 = the training dtype)")
    p.add_argument("--loss-dtype", "--loss_dtype", choices=("fp32", "bf16", "fp16"),
                   help="precision of the logits for the loss (default fp32)")
    p.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="hidden dropout on: its masks are kept for the backward (default off)")
    p.add_argument("--attention-dropout", "--attention_dropout", action=argparse.BooleanOptionalAction,
                   default=None, help="dropout on the attention probabilities (default off)")
    p.add_argument("--fused-norm", "--fused_norm", action=argparse.BooleanOptionalAction, default=None,
                   help="fused RMSNorm/LayerNorm kernel (default on)")
    p.add_argument("--vocab-parallel-loss", "--vocab_parallel_loss", action=argparse.BooleanOptionalAction,
                   default=None, help="Megatron's vocab-parallel cross entropy; off: logits gathered over TP "
                   "(default on)")
    p.add_argument("--overlap-grad-reduce", "--overlap_grad_reduce", action=argparse.BooleanOptionalAction,
                   default=None, help="DP gradient reduction overlapped with the last backward (default off)")
    for flag, text in (("fused-softmax", "without flash attention: fused softmax, in-place backward (default on)"),
                       ("keep-stage-outputs", "pipeline buffers keep stage outputs and the previous logits"),
                       ("sp-keeps-gathered-input", "sequence parallel linears keep their all-gathered input")):
        p.add_argument(f"--{flag}", f"--{flag.replace('-', '_')}", action=argparse.BooleanOptionalAction,
                       default=None, help=text if "default" in text else text + " (default off; --setup scaling: on)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON (atomically)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")


def _training(args, model, defaults: TrainingSpec | None = None) -> TrainingSpec:
    base = defaults or TrainingSpec(seq_len=model.seq_len)
    def pick(name):
        value = getattr(args, name, None)
        return getattr(base, name) if value is None else value

    return TrainingSpec(global_batch_size=pick("global_batch_size"), seq_len=pick("seq_len"),
                        dtype=pick("dtype"), optimizer=pick("optimizer"), setup=pick("setup"),
                        **{name: getattr(args, name, None) for name in _SETUP_FLAGS})


# Flags that override one field of a --setup preset (None: the preset or the default decides).
_SETUP_FLAGS = ("distributed_optimizer", "fully_sharded", "sequence_parallel", "flash_attention",
                "grad_dtype", "loss_dtype", "dropout", "attention_dropout", "fused_norm", "vocab_parallel_loss",
                "overlap_grad_reduce", "fused_softmax", "keep_stage_outputs", "sp_keeps_gathered_input")


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile-db", "--profile_db", metavar="FILE",
                   help="use the learned predictor fitted on this profile database")
    p.add_argument("--memory-headroom", "--memory_headroom", type=float, default=0.0, metavar="F",
                   help="share of every device's memory a plan must leave free (default 0; memx-run keeps "
                        "the memory monitor's 0.10)")


def _check_headroom(args) -> None:
    if not 0 <= args.memory_headroom < 1:
        raise ConfigError("--memory-headroom", f"must be in [0, 1), got {args.memory_headroom}", "e.g. 0.1")


def _check_new_file(path: str | None, flag: str, force: bool) -> None:
    """Refuse before any work is done, not after a long search."""
    if path is not None:
        check_output_path(path, flag, force)


def _check_finite(value: float | None, flag: str) -> None:
    if value is not None and not math.isfinite(value):
        raise ConfigError(flag, f"must be a finite number, got {value}", "give a plain number")


def _cost_model(args, model, cluster, training):
    if not getattr(args, "profile_db", None):
        return None
    if not os.path.exists(args.profile_db):
        raise ConfigError("--profile-db", f"{args.profile_db} does not exist", "run memx profile first")
    from memx_launch.profiling.predictor import load_cost_model

    return load_cost_model(args.profile_db, model, cluster, training)


def _progress(args):
    if args.quiet:
        return None
    from memx_launch.planning.search import progress_to_stderr

    return progress_to_stderr


def _list_of(cast):
    """argparse type of a comma list (its error is the usual one line)."""
    def parse(text: str) -> list:
        try:
            return [cast(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    parse.__name__ = "comma list"
    return parse


# --------------------------------------------------------------------------- memx plan


def add_plan_command(sub) -> None:
    p = sub.add_parser("plan", help="search the best parallel layout for a model on a cluster",
                       description="Search TP x PP x DP layouts, uneven layer splits, per-stage recompute and "
                                   "schedules; rank them by the memory-aware objective Phi.")
    _add_target_args(p)
    p.add_argument("--objective", choices=("default", "safety", "throughput"),
                   help="weight profile for Phi (default: chosen from the cluster and the memory margin)")
    p.add_argument("--weights", metavar="wT,wM,wV", help="explicit Phi weights, overriding --objective")
    p.add_argument("--top", type=int, default=5, metavar="K", help="how many ranked plans to show (default 5)")
    _add_output_args(p)
    p.add_argument("--plot", metavar="PATH.png", help="write the time vs memory-variance Pareto plot")
    p.add_argument("--compare", action="store_true",
                   help="also show what compute-proportional, memory-proportional and time-only planners pick")
    p.add_argument("--search-budget-s", "--search_budget_s", type=float, metavar="S",
                   help="stop the search after S seconds and report the best found")
    for flag, kind, what in (("--tp", int, "TP degrees"), ("--pp", int, "pipeline degrees"),
                             ("--micro-batch-sizes", int, "micro-batch sizes (default 1,2,4,8)"),
                             ("--schedules", str, "schedules: 1f1b,interleaved"),
                             ("--recompute-levels", str, "recompute levels: none,selective,full")):
        p.add_argument(flag, type=_list_of(kind), metavar="A,B", help=f"search only these {what}")
    _add_cost_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_config_args(p)
    p.set_defaults(handler=run_plan)


def run_plan(args) -> int:
    from memx_launch.planning import report
    from memx_launch.planning.search import SearchSpace, search
    from memx_launch.planning.baselines import compare_baselines
    from memx_launch.planning.objective import parse_weights

    if not 1 <= args.top <= 10_000:
        raise ConfigError("--top", f"must be between 1 and 10000, got {args.top}", "e.g. --top 5")
    _check_finite(args.search_budget_s, "--search-budget-s")
    _check_finite(args.memory_headroom, "--memory-headroom")
    if args.search_budget_s is not None and args.search_budget_s <= 0:
        raise ConfigError("--search-budget-s", f"must be positive, got {args.search_budget_s}", "e.g. 30")
    _check_headroom(args)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError("--plot", f"{args.plot} is not a .png path", "e.g. --plot pareto.png")
    _check_new_file(args.json, "--json", args.force)
    _check_new_file(args.plot, "--plot", args.force)
    model = get_model(args.model)
    cluster = ClusterSpec.from_yaml(args.cluster)
    training = _training(args, model)
    weights = parse_weights(args.weights) if args.weights else None
    cost_model = _cost_model(args, model, cluster, training)

    restricted = {field: tuple(getattr(args, flag)) for flag, field in (
        ("tp", "tp_degrees"), ("pp", "pipeline_degrees"), ("micro_batch_sizes", "micro_batch_sizes"),
        ("schedules", "schedules"), ("recompute_levels", "recompute_levels")) if getattr(args, flag) is not None}
    space = SearchSpace(memory_headroom=args.memory_headroom, **restricted)
    result = search(model, cluster, training, cost_model=cost_model, space=space, objective=args.objective,
                    weights=weights, time_budget_s=args.search_budget_s, top_k=args.top, progress=_progress(args))
    print(report.plan_report(result, cluster))
    print(report.search_stats_line(result.stats), file=sys.stderr)
    if args.compare:
        baselines = compare_baselines(model, cluster, training, cost_model=cost_model, space=space,
                                      objective=args.objective, weights=weights, memx=result)
        print("\ncompared in the same cost model:")
        print(report.compare_table(baselines))
    if args.json:
        result.best.save(args.json, overwrite=args.force)
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.plot:
        report.pareto_plot(result, args.plot, overwrite=args.force, emulated=cluster.is_emulated)
        print(f"Pareto plot written to {args.plot}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- memx estimate


_LAYOUT_FLAGS = ("tp", "pp", "dp", "micro_batch_size", "recompute", "layers_per_stage", "stage_devices",
                 "schedule", "virtual_stages", "model", "global_batch_size", "seq_len")


def add_estimate_command(sub) -> None:
    p = sub.add_parser("estimate", help="predict memory and time of a layout you already have",
                       description="Will it fit? Predicted memory per stage against capacity, stage and "
                                   "iteration time, and Phi, for a given layout or a plan file (exit code 3 when "
                                   "a stage does not fit), or for every row of a --cases file.")
    _add_target_args(p, required=False)
    p.add_argument("--plan", metavar="FILE", help="a plan JSON (from memx plan --json) instead of layout flags")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--micro-batch-size", "--micro_batch_size", type=int)
    p.add_argument("--recompute", help="none|selective|full, or one level per stage: full,none; full:K "
                   "recomputes a stage's first K layers (Megatron's block method)")
    p.add_argument("--layers-per-stage", "--layers_per_stage", type=_list_of(int),
                   help="layers per stage, kept as given, e.g. 8,24 (default: even, remainder first)")
    p.add_argument("--stage-devices", "--stage_devices", type=_list_of(str), help="device type per stage, e.g. a,b")
    p.add_argument("--schedule", choices=("1f1b", "interleaved"))
    p.add_argument("--virtual-stages", "--virtual_stages", type=int)
    p.add_argument("--weights", metavar="wT,wM,wV", help="Phi weights (default: the heterogeneous profile)")
    _add_cost_args(p)
    p.add_argument("--cases", metavar="FILE", help="CSV or JSONL, one layout per row (columns: docs/estimate.md); "
                   "--model, --cluster and the training flags fill empty cells")
    p.add_argument("--out", metavar="FILE", help="with --cases: the JSON lines, one per row (default stdout)")
    _add_output_args(p)
    p.set_defaults(handler=run_estimate)


def run_estimate(args) -> int:
    from memx_launch.planning import report
    from memx_launch.planning.estimate import evaluate_layout, evaluate_plan, plan_training, stage_short_gib
    from memx_launch.planning.objective import parse_weights

    _check_headroom(args)
    if args.cases:
        return _run_cases(args)
    _check_new_file(args.json, "--json", args.force)
    if not args.cluster:
        raise ConfigError("--cluster", "missing", "pass the cluster YAML the layout runs on")
    cluster = ClusterSpec.from_yaml(args.cluster)
    weights = parse_weights(args.weights) if args.weights else None
    if args.plan:
        given = [f"--{f.replace('_', '-')}" for f in _LAYOUT_FLAGS if getattr(args, f) is not None]
        if given:
            raise ConfigError(given[0], "cannot be combined with --plan", "the plan file fixes the layout")
        handed = Plan.load(args.plan)
        model, training, split_note = handed.model_spec, plan_training(handed), ""
        plan = evaluate_plan(handed, cluster, training, weights=weights, memory_headroom=args.memory_headroom,
                             cost_model=_cost_model(args, model, cluster, training))
    else:
        missing = [f"--{f.replace('_', '-')}" for f in ("model", "tp", "pp", "dp", "micro_batch_size")
                   if getattr(args, f) is None]
        if missing:
            raise ConfigError(missing[0], "missing", "give --model, --tp, --pp, --dp and --micro-batch-size, "
                              "or --plan FILE")
        model = get_model(args.model)
        training = _training(args, model)
        split_note = "" if args.layers_per_stage else "no --layers-per-stage: even split, remainder on the first stages"
        plan = evaluate_layout(model, cluster, training, tp=args.tp, pp=args.pp, dp=args.dp,
                               micro_batch_size=args.micro_batch_size,
                               layers_per_stage=args.layers_per_stage,
                               recompute=args.recompute, stage_devices=args.stage_devices,
                               schedule=args.schedule or "1f1b", virtual_stages=1 if args.virtual_stages is None else args.virtual_stages,
                              
                               weights=weights, cost_model=_cost_model(args, model, cluster, training),
                               memory_headroom=args.memory_headroom)
    print(report.estimate_report(plan, cluster, args.memory_headroom, split_note))
    if args.json:
        plan.save(args.json, overwrite=args.force)
        print(f"estimate written to {args.json}", file=sys.stderr)
    return NoFeasiblePlanError.exit_code if any(stage_short_gib(plan, args.memory_headroom)) else 0


def _run_cases(args) -> int:
    """``--cases``: one JSON line per row; a bad row is that row's ``error``, never the file's."""
    from memx_launch.planning.cases import FLAG_DEFAULTS, run_cases
    from memx_launch.planning.objective import parse_weights

    given = [f"--{f.replace('_', '-')}" for f in (*_LAYOUT_FLAGS, "plan", "json")
             if f not in FLAG_DEFAULTS and getattr(args, f) is not None]
    if given:
        raise ConfigError(given[0], "cannot be combined with --cases", "give it as a column of the cases file")
    _check_new_file(args.out, "--out", args.force)
    if args.profile_db and not os.path.exists(args.profile_db):
        raise ConfigError("--profile-db", f"{args.profile_db} does not exist", "run memx profile first")
    print(run_cases(args.cases, args.out, overwrite=args.force, defaults={k: getattr(args, k) for k in FLAG_DEFAULTS},
                    memory_headroom=args.memory_headroom, weights=parse_weights(args.weights) if args.weights else None,
                    cost_model_for=(lambda m, c, t: _cost_model(args, m, c, t)) if args.profile_db else None),
          file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- memx export


def add_export_command(sub) -> None:
    p = sub.add_parser("export", help="a plan as Megatron-LM arguments, torchrun lines and MEMX_* variables")
    p.add_argument("--plan", required=True, metavar="FILE", help="plan JSON from memx plan --json")
    p.add_argument("--cluster", help="cluster YAML; needed for the per-node torchrun lines")
    p.add_argument("--script", default="train.py", help="training script for the torchrun lines")
    p.add_argument("--master-addr", "--master_addr",
                   help="rendezvous address (default: the cluster file's master_addr or first node's host)")
    p.add_argument("--master-port", "--master_port", type=int, default=29500)
    p.set_defaults(handler=run_export)


def run_export(args) -> int:
    from memx_launch.planning import exporters

    if not 1 <= args.master_port <= 65535:
        raise ConfigError("--master-port", f"{args.master_port} is not a TCP port", "e.g. --master-port 29500")
    plan = Plan.load(args.plan)
    megatron = exporters.megatron_args(plan)
    print("# Megatron-LM arguments")
    print(megatron.command_line())
    for note in megatron.notes:
        print(f"# note: {note}")
    print("\n# environment for the training script")
    print("\n".join(exporters.env_lines(exporters.plan_env(plan, os.path.abspath(args.plan)))))
    if args.cluster:
        cluster = ClusterSpec.from_yaml(args.cluster)
        for title, for_megatron in (("memx's runtime (the plan's rank order)", False),
                                    ("Megatron-LM (stages on consecutive ranks)", True)):
            print(f"\n# torchrun for {title}, one line per node")
            for cmd in exporters.torchrun_commands(plan, cluster, args.script, master_addr=args.master_addr,
                                                   master_port=args.master_port, for_megatron=for_megatron):
                print(f"{cmd.command_line()}" + "".join(f"  # {note}" for note in cmd.notes))
    return 0


# --------------------------------------------------------------------------- memx profile


def add_profile_command(sub) -> None:
    p = sub.add_parser("profile", help="measure transformer blocks on this machine's device (minimal set)",
                       description="Ablation, then a three-point design over the high-impact parameters; "
                                   "appends the measurements to a profile database (JSON lines).")
    p.add_argument("--model", required=True, help="catalog name or a Hugging Face config.json")
    p.add_argument("--out", default="profile.jsonl", help="profile database to append to (default profile.jsonl)")
    p.add_argument("--budget", type=int, metavar="N",
                   help="at most N measurements, ablation included; below the ablation's size, a few-sample "
                        "profile for a device type added to an already profiled fleet (the default micro-batch, "
                        "then its extremes)")
    p.add_argument("--refine-budget", "--refine_budget", type=int, metavar="N",
                   help="at most N extra measurements around non-linear lines (default: a third of the design)")
    p.add_argument("--cluster", help="cluster YAML: take this device's type (and emulation) from it")
    p.add_argument("--device-type", "--device_type", help="which of the cluster's device types this machine is")
    p.add_argument("--device", help="torch device to measure on (default: cuda when present, else cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--max-micro-batch", "--max_micro_batch", type=int, default=8, metavar="B")
    p.add_argument("--seq-lens", "--seq_lens", type=_list_of(int), metavar="S1,S2,...", help="default: the model's, its half and quarter")
    p.add_argument("--num-blocks", "--num_blocks", type=int, default=2, help="blocks per measurement (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration (median; default 5)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_profile)


def run_profile(args) -> int:
    from memx_launch.profiling.interpolation import augment_measurements
    from memx_launch.planning.costmodel import tp_link_gbps
    from memx_launch.profiling.profiledb import ProfileDB
    from memx_launch.profiling.space import default_space
    from memx_launch.profiling.kernel import detect_device_type, measuring_device, profile_model

    model = get_model(args.model)
    ProfileDB(args.out).check_appendable("--out")  # before measuring, not after
    device = measuring_device(args.device)
    slowdown, link = 1.0, None
    if args.cluster:
        cluster = ClusterSpec.from_yaml(args.cluster)
        names = [d.name for d in cluster.device_types]
        name = args.device_type or (names[0] if len(names) == 1 else None)
        if name not in names:
            raise ConfigError("--device-type", f"{args.device_type!r} is not a device type of {cluster.name}"
                              if args.device_type else f"{cluster.name} has {len(names)} device types",
                              f"pass --device-type with one of {', '.join(names)}")
        device_type = cluster.device_type(name)
        slowdown = cluster.emulation.slowdown_of(name) if cluster.emulation else 1.0
        link = tp_link_gbps(cluster, name)
    else:
        device_type = detect_device_type(device, args.device_type)
    for flag, value, lo, hi in (("--budget", args.budget, 1, 10_000), ("--num-blocks", args.num_blocks, 1, 64),
                                ("--repeats", args.repeats, 1, 1000), ("--max-micro-batch", args.max_micro_batch, 1, 4096),
                                ("--refine-budget", args.refine_budget, 0, 10_000)):
        if value is not None and not lo <= value <= hi:
            raise ConfigError(flag, f"must be an integer in [{lo}, {hi}], got {value}")
    dtype = args.dtype or ("fp32" if device.startswith("cpu") else "bf16")
    for s in args.seq_lens or ():
        if not 1 <= s <= 2**20:
            raise ConfigError("--seq-lens", f"{s} is not a sequence length", "e.g. --seq-lens 1024,2048")
    space = default_space(model, max_micro_batch=args.max_micro_batch, seq_lens=args.seq_lens)
    emulated = " (emulated: measured time x {:g})".format(slowdown) if slowdown != 1.0 else ""
    print(f"profiling {model.name} on {device_type.name} ({device}, {dtype}){emulated}; "
          f"space: " + ", ".join(f"{k}={list(v)}" for k, v in space.values.items()))
    result = profile_model(model, device_type, space, device=device, budget=args.budget, dtype=dtype,
                           num_blocks=args.num_blocks, repeats=args.repeats, emulation_slowdown=slowdown,
                           tp_link_gbps=link, refine_budget=args.refine_budget, show_progress=not args.quiet)
    print(result.summary())
    infeasible = sum(not m.feasible for m in result.measurements)
    if infeasible:
        print(f"{infeasible} configuration(s) ran out of memory (kept as infeasible points)")
    slack = [m.peak_reserved_bytes / m.peak_memory_bytes for m in result.measurements
             if m.feasible and m.peak_reserved_bytes and m.peak_memory_bytes]
    if slack:
        print(f"caching allocator: reserved peak {statistics.median(slack):.2f}x the allocated peak (median over "
              f"{len(slack)} configurations); the plan's memory headroom must cover it")
    print(augment_measurements(result.measurements, space.values).summary())
    ProfileDB(args.out).append_or_keep(result.measurements)
    print(f"appended {len(result.measurements)} measurements to {args.out}")
    return 0


# --------------------------------------------------------------------------- memx evaluate


def add_evaluate_command(sub) -> None:
    p = sub.add_parser("evaluate", help="accuracy of predictions against measurements",
                       description="MAPE, error shares, max error, Spearman, Kendall and top-k hits for time, "
                                   "memory and Phi (format: docs/profiler.md).")
    p.add_argument("--measurements", required=True, metavar="FILE", help="CSV or JSON of predicted vs measured")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    p.set_defaults(handler=run_evaluate)


def run_evaluate(args) -> int:
    from memx_launch.profiling.metrics import evaluate, format_report, load_measurements

    _check_new_file(args.json, "--json", args.force)
    report = evaluate(load_measurements(args.measurements))
    print(format_report(report))
    if args.json:
        write_json_atomic(args.json, report, overwrite=args.force)
    return 0


def add_cluster_command(sub) -> None:
    p = sub.add_parser("cluster", help="the cluster this machine belongs to")
    d = p.add_subparsers(dest="cluster_command", required=True, parser_class=_Parser).add_parser(
        "detect", help="detect devices, hosts and links (a short torchrun job) and write a cluster YAML",
        description="Run on every node with the same --nnodes/--master-addr; node rank 0 measures across nodes.")
    d.add_argument("--out", default="cluster.yaml", help="cluster YAML to write (default cluster.yaml)")
    d.add_argument("--force", action="store_true", help="overwrite --out")
    d.add_argument("--nproc-per-node", help="processes on this node (default: one per GPU, 1 without GPUs)")
    d.add_argument("--nnodes", default="1")
    d.add_argument("--node-rank", type=int, default=0)
    d.add_argument("--master-addr", help="node rank 0's address (needed with --nnodes > 1)")
    d.add_argument("--master-port", type=int, default=29500)
    d.set_defaults(handler=lambda args: __import__("memx_launch.runtime.detection", fromlist=["x"]).run_detect(args))


COMMANDS = [add_plan_command, add_estimate_command, add_export_command, add_profile_command,
            add_evaluate_command, add_cluster_command]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memx", description="Memory-aware parallelism planning for heterogeneous GPU clusters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(
        c.__name__[len("add_"):-len("_command")] for c in COMMANDS) + "}", parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds: temporary files are removed on the way out


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    with warnings.catch_warnings():  # one line each, like the errors
        warnings.showwarning = lambda message, *_, **__: print(f"memx: warning: {message}", file=sys.stderr)
        return _run(build_parser(), argv)


def _run(parser, argv) -> int:
    try:
        args = parse_with_config(parser, argv)
        if getattr(args, "print_config", False):
            print(config_yaml(parser, args), end="")
            return 0
        return args.handler(args)
    except KeyboardInterrupt:
        print("memx: interrupted; no output file was written", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if exc.code == 128 + signal.SIGTERM:
            print("memx: terminated; no output file was written", file=sys.stderr)
        raise
    except NoFeasiblePlanError as exc:
        print(f"memx: error: {exc}", file=sys.stderr)
        if exc.closest:
            print("closest candidates (GiB short per device):", file=sys.stderr)
            for text in exc.closest:
                print(f"  {text}", file=sys.stderr)
        return exc.exit_code
    except MemxError as exc:
        print(f"memx: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
