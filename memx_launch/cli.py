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
from memx_launch.specs.training import TrainingSpec
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


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON (atomically)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")


def _training(args, model, defaults: TrainingSpec | None = None) -> TrainingSpec:
    base = defaults or TrainingSpec(seq_len=model.seq_len)
    def pick(name):
        value = getattr(args, name, None)
        return getattr(base, name) if value is None else value

    return TrainingSpec(global_batch_size=pick("global_batch_size"), seq_len=pick("seq_len"),
                        dtype=pick("dtype"), optimizer=pick("optimizer"),
                        distributed_optimizer=pick("distributed_optimizer"), fully_sharded=pick("fully_sharded"))


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


def _csv(text: str | None, cast=str, flag: str = "") -> list | None:
    if text is None:
        return None
    try:
        return [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(flag, f"expected a comma-separated list, got {text!r}", "e.g. 8,24") from None


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
    p.add_argument("--profile-db", "--profile_db", metavar="FILE",
                   help="use the learned predictor fitted on this profile database")
    p.add_argument("--memory-headroom", "--memory_headroom", type=float, default=0.0, metavar="F",
                   help="share of every device's memory a plan must leave free (default 0; memx-run keeps "
                        "the memory monitor's 0.10)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
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
    if not 0 <= args.memory_headroom < 1:
        raise ConfigError("--memory-headroom", f"must be in [0, 1), got {args.memory_headroom}", "e.g. 0.1")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError("--plot", f"{args.plot} is not a .png path", "e.g. --plot pareto.png")
    _check_new_file(args.json, "--json", args.force)
    _check_new_file(args.plot, "--plot", args.force)
    model = get_model(args.model)
    cluster = ClusterSpec.from_yaml(args.cluster)
    training = _training(args, model)
    weights = parse_weights(args.weights) if args.weights else None
    cost_model = _cost_model(args, model, cluster, training)

    space = SearchSpace(memory_headroom=args.memory_headroom)
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
                                   "iteration time, and Phi, for a given layout or a plan file.")
    _add_target_args(p, required=False)
    p.add_argument("--plan", metavar="FILE", help="a plan JSON (from memx plan --json) instead of layout flags")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--micro-batch-size", "--micro_batch_size", type=int)
    p.add_argument("--recompute", help="none|selective|full, or one level per stage: full,none")
    p.add_argument("--layers-per-stage", "--layers_per_stage", help="uneven split, e.g. 8,24")
    p.add_argument("--stage-devices", "--stage_devices", help="device type of each stage, e.g. a100-80gb,t4-16gb")
    p.add_argument("--schedule", choices=("1f1b", "interleaved"))
    p.add_argument("--virtual-stages", "--virtual_stages", type=int)
    p.add_argument("--weights", metavar="wT,wM,wV", help="Phi weights (default: the heterogeneous profile)")
    _add_output_args(p)
    p.set_defaults(handler=run_estimate)


def run_estimate(args) -> int:
    from memx_launch.planning import report
    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.planning.objective import parse_weights

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
        model = handed.model_spec
        training = TrainingSpec(global_batch_size=handed.global_batch_size, seq_len=handed.seq_len,
                                **handed.training)
        o = handed.objective
        references = tuple(o.terms[k] for k in ("T_ref", "M_ref", "V_ref")) if "T_ref" in o.terms else None
        plan = evaluate_layout(model, cluster, training, tp=handed.tp, pp=handed.pp, dp=handed.dp,
                               micro_batch_size=handed.micro_batch_size,
                               layers_per_stage=[s.num_layers for s in handed.stages],
                               recompute=[s.recompute for s in handed.stages],
                               stage_devices=[s.device_type for s in handed.stages],
                               schedule=handed.schedule, virtual_stages=handed.virtual_stages,
                               weights=weights or o.weights, references=references)
        plan.objective.profile = o.profile if weights is None else "custom"
    else:
        missing = [f"--{f.replace('_', '-')}" for f in ("model", "tp", "pp", "dp", "micro_batch_size")
                   if getattr(args, f) is None]
        if missing:
            raise ConfigError(missing[0], "missing", "give --model, --tp, --pp, --dp and --micro-batch-size, "
                              "or --plan FILE")
        model = get_model(args.model)
        training = _training(args, model)
        for flag in ("tp", "pp", "dp", "micro_batch_size"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')}", f"must be at least 1, got {getattr(args, flag)}")
        plan = evaluate_layout(model, cluster, training, tp=args.tp, pp=args.pp, dp=args.dp,
                               micro_batch_size=args.micro_batch_size,
                               layers_per_stage=_csv(args.layers_per_stage, int, "--layers-per-stage"),
                               recompute=args.recompute, stage_devices=_csv(args.stage_devices),
                               schedule=args.schedule or "1f1b",
                               virtual_stages=1 if args.virtual_stages is None else args.virtual_stages,
                               weights=weights)
    print(report.estimate_report(plan, cluster))
    if args.json:
        plan.save(args.json, overwrite=args.force)
        print(f"estimate written to {args.json}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- memx export


def add_export_command(sub) -> None:
    p = sub.add_parser("export", help="a plan as Megatron-LM arguments, torchrun lines and MEMX_* variables")
    p.add_argument("--plan", required=True, metavar="FILE", help="plan JSON from memx plan --json")
    p.add_argument("--cluster", help="cluster YAML; needed for the per-node torchrun lines")
    p.add_argument("--script", default="train.py", help="training script for the torchrun lines")
    p.add_argument("--master-addr", "--master_addr", default="localhost")
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
                print(f"{cmd.command_line()}" + (f"  # {cmd.notes[0]}" if cmd.notes else ""))
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
    p.add_argument("--seq-lens", "--seq_lens", metavar="S1,S2,...", help="default: the model's, its half and quarter")
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
    seq_lens = _csv(args.seq_lens, int, "--seq-lens")
    for s in seq_lens or ():
        if not 1 <= s <= 2**20:
            raise ConfigError("--seq-lens", f"{s} is not a sequence length", "e.g. --seq-lens 1024,2048")
    space = default_space(model, max_micro_batch=args.max_micro_batch, seq_lens=seq_lens)
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


COMMANDS = [add_plan_command, add_estimate_command, add_export_command, add_profile_command,
            add_evaluate_command]


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
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    with warnings.catch_warnings():  # one line each, like the errors
        warnings.showwarning = lambda message, *_, **__: print(f"memx: warning: {message}", file=sys.stderr)
        return _run(args)


def _run(args) -> int:
    try:
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
