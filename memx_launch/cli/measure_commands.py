"""``memx profile``, ``memx profile import``, ``memx evaluate``, ``memx cluster detect`` and
``memx cluster fit``: measurements on this machine, measurements from elsewhere, their accuracy,
and a cluster file fitted to them (torch only inside the commands).
"""

from __future__ import annotations

import statistics

from memx_launch.errors import ConfigError
from memx_launch.files import write_json_atomic, write_text_atomic
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.inputs import int_flag
from memx_launch.specs.catalog import get_model
from memx_launch.cli.common import BLOCK_OPTIONS, Parser, add_block_option_args, add_target_args, check_new_file
from memx_launch.specs.checks import list_of


def add_profile_command(sub) -> None:
    p = sub.add_parser("profile", help="measure transformer blocks on this machine's device (minimal set)",
                       description="Ablation, then a three-point design over the high-impact parameters; "
                                   "appends the measurements to a profile database (JSON lines).")
    p.add_argument("--model", help="catalog name or a Hugging Face config.json (required)")
    p.add_argument("--out", default="profile.jsonl", help="profile database to append to (default profile.jsonl)")
    p.add_argument("--budget", type=int_flag, metavar="N",
                   help="at most N measurements, ablation included; below the ablation's size, a few-sample "
                        "profile for a device type added to an already profiled fleet (the default micro-batch, "
                        "then its extremes)")
    p.add_argument("--refine-budget", "--refine_budget", type=int_flag, metavar="N",
                   help="at most N extra measurements around non-linear lines (default: a third of the design)")
    p.add_argument("--cluster", help="cluster YAML: take this device's type (and emulation) from it")
    p.add_argument("--device-type", "--device_type", help="which of the cluster's device types this machine is")
    p.add_argument("--device", help="torch device to measure on (default: cuda when present, else cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--max-micro-batch", "--max_micro_batch", type=int_flag, default=8, metavar="B")
    p.add_argument("--seq-lens", "--seq_lens", type=list_of(int), metavar="S1,S2,...", help="default: the model's, its half and quarter")
    p.add_argument("--num-blocks", "--num_blocks", type=int_flag, default=2, help="blocks per measurement (default 2)")
    p.add_argument("--repeats", type=int_flag, default=5, help="timed repeats per configuration (median; default 5)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_profile)
    add_profile_import_command(p.add_subparsers(dest="profile_command", parser_class=Parser,
                                                metavar="{import}"))


def add_profile_import_command(sub) -> None:
    from memx_launch.profiling.profile_import import FORMATS

    p = sub.add_parser("import", help="append per-layer tables measured elsewhere to a profile database",
                       description="Formats: table (memx's CSV/JSONL schema), sailor (Sailor's profile.json), "
                                   "aceso (Aceso's layer-time CSV); see docs/profiler.md. The device type's "
                                   "descriptors and TP links come from --cluster.")
    p.add_argument("table", help="the file to import")
    p.add_argument("--format", required=True, choices=FORMATS, help="the table's format")
    p.add_argument("--model", required=True, help="the model the table measured (catalog name or config.json)")
    p.add_argument("--cluster", required=True, help="cluster YAML describing the device type that measured it")
    p.add_argument("--device-type", "--device_type", help="which of the cluster's device types measured it "
                   "(default: the cluster's only one)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="precision the table measured (required unless every row says; sailor and aceso: fp32)")
    p.add_argument("--seq-len", "--seq_len", type=int, help="tokens per sequence the table measured "
                   "(default: the model's; table rows may say)")
    p.add_argument("--tf32", action="store_true", help="the table's fp32 matmuls ran as TF32")
    add_block_option_args(p)  # how the table's blocks ran: their learned ratios are taken against it
    p.add_argument("--out", default="profile.jsonl", help="profile database to append to (default profile.jsonl)")
    p.set_defaults(handler=run_profile_import)


def run_profile_import(args) -> int:
    from memx_launch.planning.tp_links import tp_link
    from memx_launch.profiling.profile_import import import_profile
    from memx_launch.profiling.profiledb import ProfileDB

    model = get_model(args.model)
    cluster = ClusterSpec.from_yaml(args.cluster)
    device_type = _cluster_device_type(cluster, args.device_type)
    ProfileDB(args.out).check_appendable("--out")
    if args.seq_len is not None and not 1 <= args.seq_len <= 2**20:
        raise ConfigError("--seq-len", f"{args.seq_len} is not a sequence length", "e.g. --seq-len 2048")
    records = import_profile(args.table, args.format, model, device_type, dtype=args.dtype, seq_len=args.seq_len,
                             tp_link=lambda tp: tp_link(cluster, device_type.name, tp),
                             run_options={**({"tf32": True} if args.tf32 else {}),
                                          **{name: getattr(args, name) for name in BLOCK_OPTIONS
                                             if getattr(args, name) is not None}})
    ProfileDB(args.out).append(records)
    oom = sum(not r.feasible for r in records)
    print(f"appended {len(records)} measurements of {model.name} on {device_type.name} ({args.format}: "
          f"{args.table}{f'; {oom} out of memory' if oom else ''}) to {args.out}")
    return 0


def _cluster_device_type(cluster: ClusterSpec, name: str | None):
    """The cluster's device type ``name`` (--device-type), or its only one."""
    names = [d.name for d in cluster.device_types]
    name = name or (names[0] if len(names) == 1 else None)
    if name not in names:
        raise ConfigError("--device-type", f"{name!r} is not a device type of {cluster.name}" if name
                          else f"{cluster.name} has {len(names)} device types",
                          f"pass --device-type with one of {', '.join(names)}")
    return cluster.device_type(name)


def run_profile(args) -> int:
    from memx_launch.profiling.interpolation import augment_measurements
    from memx_launch.planning.tp_links import tp_link
    from memx_launch.profiling.profiledb import ProfileDB
    from memx_launch.profiling.space import default_space
    from memx_launch.profiling.kernel import detect_device_type, measuring_device, profile_model

    if not args.model:
        raise ConfigError("--model", "is required", "e.g. memx profile --model llama2-7b")
    model = get_model(args.model)
    ProfileDB(args.out).check_appendable("--out")  # before measuring, not after
    device = measuring_device(args.device)
    slowdown, link = None, None  # a slowdown: the cluster file emulates this type
    if args.cluster:
        cluster = ClusterSpec.from_yaml(args.cluster)
        device_type = _cluster_device_type(cluster, args.device_type)
        name = device_type.name
        slowdown = cluster.emulation.slowdown_of(name) if cluster.emulation else None
        link = tp_link(cluster, name)
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
    emulated = f" (emulated: timed under the emulated device, slowdown x{slowdown:g})" if slowdown is not None else ""
    print(f"profiling {model.name} on {device_type.name} ({device}, {dtype}){emulated}; "
          f"space: " + ", ".join(f"{k}={list(v)}" for k, v in space.values.items()))
    result = profile_model(model, device_type, space, device=device, budget=args.budget, dtype=dtype,
                           num_blocks=args.num_blocks, repeats=args.repeats, emulation_slowdown=slowdown,
                           tp_link=link, refine_budget=args.refine_budget, show_progress=not args.quiet)
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


def add_evaluate_command(sub) -> None:
    p = sub.add_parser("evaluate", help="accuracy of predictions against measurements",
                       description="MAPE, error shares, max error, Spearman, Kendall and top-k hits for time, "
                                   "memory, Phi and the bytes sent between communication domains (format: "
                                   "docs/profiler.md).")
    p.add_argument("--measurements", required=True, metavar="PATH",
                   help="CSV or JSON of predicted vs measured, memx estimate --cases output (.jsonl) of rows "
                        "with measured_time_s, or memx-run's metrics: a run directory, its metrics.jsonl, or a "
                        "directory of run directories (a row per plan generation)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    p.set_defaults(handler=run_evaluate)


def run_evaluate(args) -> int:
    from memx_launch.profiling.metrics import evaluate, format_report, load_measurements

    check_new_file(args.json, "--json", args.force)
    report = evaluate(load_measurements(args.measurements))
    print(format_report(report))
    if args.json:
        write_json_atomic(args.json, report, overwrite=args.force, flag="--json")
    return 0


def add_cluster_command(sub) -> None:
    p = sub.add_parser("cluster", help="the cluster this machine belongs to")
    commands = p.add_subparsers(dest="cluster_command", required=True, parser_class=Parser)
    f = commands.add_parser(
        "fit", help="fit a cluster YAML to measured runs: each device type's efficiency and memory overhead",
        description="Each device type's matmul efficiency from measured iteration times and its memory overhead "
                    "from measured peaks, over the rows of a memx estimate --cases file that carry "
                    "measured_time_s and/or measured_peak_memory_gib (docs/estimate.md).")
    f.add_argument("--cases", required=True, metavar="FILE", help="CSV or JSONL of measured layouts, one per row")
    add_target_args(f, required=False)
    f.add_argument("--out", required=True, metavar="FILE", help="the fitted cluster YAML to write")
    f.add_argument("--force", action="store_true", help="overwrite --out")
    f.set_defaults(handler=run_cluster_fit)
    d = commands.add_parser(
        "detect", help="detect devices, hosts and links (a short torchrun job) and write a cluster YAML",
        description="Run on every node with the same --nnodes/--master-addr; node rank 0 measures across nodes.")
    d.add_argument("--out", default="cluster.yaml", help="cluster YAML to write (default cluster.yaml)")
    d.add_argument("--force", action="store_true", help="overwrite --out")
    d.add_argument("--nproc-per-node", help="processes on this node (default: one per GPU, 1 without GPUs)")
    d.add_argument("--nnodes", default="1")
    d.add_argument("--node-rank", type=int_flag, default=0)
    d.add_argument("--master-addr", help="node rank 0's address (needed with --nnodes > 1)")
    d.add_argument("--master-port", type=int_flag, default=29500)
    d.set_defaults(handler=lambda args: __import__("memx_launch.runtime.detection", fromlist=["x"]).run_detect(args))


def run_cluster_fit(args) -> int:
    from memx_launch.planning.cases import FLAG_DEFAULTS
    from memx_launch.planning.run_fit import fit_cluster

    if not args.cluster:
        raise ConfigError("--cluster", "missing", "give the cluster YAML the measured runs ran on")
    check_new_file(args.out, "--out", args.force)
    fit = fit_cluster(args.cases, args.cluster, {k: getattr(args, k, None) for k in FLAG_DEFAULTS})
    print(f"{'device type':<16} {'time rows':>9}  {'efficiency':<16} {'memory rows':>11}  overhead GiB")
    for t in fit.types:
        efficiency = f"{t.efficiency_before:.3f} -> {t.efficiency:.3f}" if t.time_rows else "-"
        overhead = f"{t.overhead_before_gib:.2f} -> {t.overhead_gib:.2f}" if t.memory_rows else "-"
        print(f"{t.device_type:<16} {t.time_rows:>9}  {efficiency:<16} {t.memory_rows:>11}  {overhead}")
    print(fit.errors())
    if fit.furthest_rows:
        print(fit.furthest())
    write_text_atomic(args.out, fit.yaml_text(args.cases), overwrite=args.force, flag="--out")
    print(f"fitted cluster written to {args.out}")
    return 0
