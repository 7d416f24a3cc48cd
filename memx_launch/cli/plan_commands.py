"""``memx plan``, ``memx estimate`` and ``memx export``: the cost model and the search, no torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from memx_launch.files import check_distinct_outputs
from memx_launch.errors import ConfigError, NoFeasiblePlanError
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.config_file import add_config_args
from memx_launch.specs.inputs import float_flag, int_flag
from memx_launch.cli.common import add_cost_args, add_output_args, add_target_args, check_finite, check_headroom, check_new_file, cost_model_from_args, model_from_args, profile_cost_models, progress_from_args, training_from_args
from memx_launch.specs.checks import list_of


def add_plan_command(sub) -> None:
    from memx_launch.planning.objective import add_slowdown_arg
    from memx_launch.planning.context_parallel import MIN_TOKENS_PER_RANK
    from memx_launch.planning.search_space import add_restriction_args

    p = sub.add_parser("plan", help="search the best parallel layout for a model on a cluster",
                       description="Search TP x PP x DP layouts (x CP on long sequences), uneven layer splits, per-stage recompute and "
                                   "schedules; rank them by the memory-aware objective Phi.")
    add_target_args(p)
    p.add_argument("--objective", choices=("default", "safety", "throughput"),
                   help="weight profile for Phi (default: chosen from the cluster and the memory margin); "
                        "a profile given here ranks without the --max-slowdown bound unless that is given too")
    p.add_argument("--weights", metavar="wT,wM,wV", help="explicit Phi weights, overriding --objective "
                   "(no --max-slowdown bound unless given too)")
    add_slowdown_arg(p)
    p.add_argument("--top", type=int_flag, default=5, metavar="K", help="how many ranked plans to show (default 5)")
    add_output_args(p)
    p.add_argument("--plot", metavar="PATH.png", help="write the time vs memory-variance Pareto plot")
    p.add_argument("--compare", action="store_true",
                   help="also show what compute-proportional, memory-proportional and time-only planners pick")
    p.add_argument("--search-budget-s", "--search_budget_s", type=float_flag, metavar="S",
                   help="stop the search after S seconds and report the best found")
    add_restriction_args(p)
    p.add_argument("--cp", type=list_of(int), metavar="A,B",
                   help="search only these context-parallel degrees (default: 1, and the powers of two that leave "
                        f"each rank at least {MIN_TOKENS_PER_RANK} tokens of a sequence; memx-run runs CP 1 only)")
    p.add_argument("--recompute-some-layers", "--recompute_some_layers", action=argparse.BooleanOptionalAction,
                   default=True, help="a stage that needs full recompute recomputes only its first K layers "
                   "(full:K, Megatron's block method) (default on)")
    p.add_argument("--mixed-stages", "--mixed_stages", action="store_true",
                   help="also layouts whose stages take DP replicas from two device types where the "
                        "counts do not divide; memx-run and memx export cannot run such plans, memx estimate can")
    p.add_argument("--per-type-dp", "--per_type_dp", action="store_true",
                   help="let each device type take its own DP degree, each dividing the largest (a type of fewer "
                        "replicas runs larger local micro-batches); memx-run and memx export cannot run such plans, "
                        "memx estimate can")
    p.add_argument("--shard-degrees", "--shard_degrees", type=list_of(int), metavar="A,B",
                   help="also try hybrid sharding (--shard-degree) over A and B ranks of each DP group, e.g. a "
                        "node's, beside the whole group; each degree scores every layout again (without it, "
                        "one line says where the winner sharded within a node would be faster)")
    p.add_argument("--per-type-tp", "--per_type_tp", action="store_true",
                   help="let each device type take its own TP degree (from --tp when given); several times "
                        "the search time; memx-run and memx export cannot run such plans, memx estimate can")
    add_cost_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_config_args(p)
    p.set_defaults(handler=run_plan)


def run_plan(args) -> int:
    from memx_launch.planning import experts, report
    from memx_launch.planning.estimate import host_bound_stages
    from memx_launch.planning.search import search
    from memx_launch.planning.search_space import SearchSpace, restrictions_from_args
    from memx_launch.specs.precision import device_precision
    from memx_launch.planning.baselines import compare_baselines
    from memx_launch.planning.objective import parse_slowdown, parse_weights
    from memx_launch.planning.shard_hint import hybrid_sharding_hint
    from memx_launch.planning.runtime_support import (as_memx_run_trains, one_stage_blocks, one_stage_restriction,
                                                      tp_one_blocks, tp_one_restriction)

    if not 1 <= args.top <= 10_000:
        raise ConfigError("--top", f"must be between 1 and 10000, got {args.top}", "e.g. --top 5")
    check_finite(args.search_budget_s, "--search-budget-s")
    check_finite(args.memory_headroom, "--memory-headroom")
    if args.search_budget_s is not None and args.search_budget_s <= 0:
        raise ConfigError("--search-budget-s", f"must be positive, got {args.search_budget_s}", "e.g. 30")
    check_headroom(args)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError("--plot", f"{args.plot} is not a .png path", "e.g. --plot pareto.png")
    check_new_file(args.json, "--json", args.force)
    check_new_file(args.plot, "--plot", args.force)
    check_distinct_outputs({"--json": args.json, "--plot": args.plot})
    model = model_from_args(args)
    cluster = ClusterSpec.from_yaml(args.cluster)
    training, precision = device_precision(cluster, training_from_args(args, model), args.dtype is not None)
    # --setup memx-run plans the model memx-run trains (no multi-token prediction modules) and searches
    # what memx-run's own search does: TP 1 for blocks memx has no TP plan for (a mixture's among them),
    # one stage for blocks taking per-layer inputs (Gemma 4's E models), each expert whole, one
    # micro-batch per stage at least.
    memx_run = training.setup == "memx-run"
    model = as_memx_run_trains(model) if memx_run else model
    weights = parse_weights(args.weights) if args.weights else None
    cost_model = cost_model_from_args(args, model, cluster, training)

    restrictions = restrictions_from_args(args)
    one_stage = one_stage_blocks(model) if memx_run else None  # one stage over every device type
    if memx_run:
        restrictions["tp_degrees"] = tp_one_restriction(restrictions.get("tp_degrees"), tp_one_blocks(model))
        restrictions["pipeline_degrees"] = one_stage_restriction(restrictions.get("pipeline_degrees"), one_stage)
    searches_experts = not memx_run and not args.expert_parallel
    space = SearchSpace(memory_headroom=args.memory_headroom,
                        max_slowdown=parse_slowdown(args.max_slowdown) if args.max_slowdown else None, recompute_some_layers=args.recompute_some_layers,
                        per_type_tp=args.per_type_tp, per_type_dp=args.per_type_dp, mixed_stages=args.mixed_stages or one_stage is not None,
                        cp_degrees=tuple(args.cp) if args.cp else None, **restrictions,
                        shard_degrees=tuple(args.shard_degrees) if args.shard_degrees else None,
                        fewer_microbatches_than_stages=not memx_run,
                        # A mixture of experts without --expert-parallel / --expert-tensor-parallel: the
                        # search tries the degrees.
                        expert_degrees=experts.search_degrees(model, cluster.world_size) if searches_experts else None,
                        expert_tensor_degrees=None if args.expert_tensor_parallel or memx_run
                        else experts.search_tensor_degrees(model, cluster))
    result = search(model, cluster, training, cost_model=cost_model, space=space, objective=args.objective,
                    weights=weights, time_budget_s=args.search_budget_s, top_k=args.top, progress=progress_from_args(args))
    print(report.plan_report(result, cluster, analytical_rates(args, cluster, training, model)))
    if not args.profile_db:  # the winner's host-bound stages: the analytical model's word, as memx estimate's
        for line in report.host_bound_lines(result.best, host_bound_stages(result.best, cluster)):
            print(line)
    if precision:
        print(f"precision: {precision}")
    if not args.shard_degrees:
        hint = hybrid_sharding_hint(result.best, cluster, training, cost_model, args.memory_headroom)
        if hint:
            print(hint)
    print(report.search_stats_line(result.stats), file=sys.stderr)
    if args.compare:
        baselines = compare_baselines(model, cluster, training, cost_model=cost_model, space=space,
                                      objective=args.objective, weights=weights, memx=result)
        print("\ncompared in the same cost model:")
        print(report.compare_table(baselines))
    if args.json:
        result.best.save(args.json, overwrite=args.force, flag="--json")
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.plot:
        report.pareto_plot(result, args.plot, overwrite=args.force, emulated=cluster.is_emulated)
        print(f"Pareto plot written to {args.plot}", file=sys.stderr)
    return 0


_LAYOUT_FLAGS = ("tp", "stage_tp", "pp", "cp", "dp", "stage_dp", "micro_batch_size", "recompute", "layers_per_stage",
                 "stage_devices", "schedule", "virtual_stages", "model", "global_batch_size", "seq_len")


def analytical_rates(args, cluster: ClusterSpec, training, model) -> list[str]:
    """The report's rates line: the analytical model's, so none under ``--profile-db`` (the learned
    ratios carry what the profile measured)."""
    from memx_launch.planning import report

    return [] if args.profile_db else report.rate_lines(cluster, training, model)


def add_estimate_command(sub) -> None:
    p = sub.add_parser("estimate", help="predict memory and time of a layout you already have",
                       description="Will it fit? Predicted memory per stage against capacity, stage and "
                                   "iteration time (and which stages the host sets), and Phi, for a given layout "
                                   "or a plan file (exit code 3 when a stage does not fit), or for every row of a "
                                   "--cases file.")
    add_target_args(p, required=False)
    p.add_argument("--plan", metavar="FILE", help="a plan JSON (from memx plan --json) instead of layout flags")
    p.add_argument("--tp", type=int_flag)
    p.add_argument("--stage-tp", "--stage_tp", type=list_of(int),
                   help="one TP degree per stage instead of --tp, e.g. 4,2 (each stage has tp_i x dp devices)")
    p.add_argument("--pp", type=int_flag)
    p.add_argument("--cp", type=int_flag, help="context-parallel degree: each DP replica is cp TP groups, each "
                   "holding 1/cp of every sequence (default 1; needs fused attention, 2*cp dividing --seq-len)")
    p.add_argument("--dp", type=int_flag)
    p.add_argument("--stage-dp", "--stage_dp", type=list_of(int),
                   help="one DP degree per stage instead of --dp, e.g. 4,2: a pipeline micro-batch of the largest "
                        "degree x --micro-batch-size sequences, split over each stage's replicas (Sailor's plans)")
    p.add_argument("--micro-batch-size", "--micro_batch_size", type=int_flag)
    p.add_argument("--recompute", help="none|selective|full, or one level per stage: full,none; full:K "
                   "recomputes a stage's first K layers (Megatron's block method), full:everyN every N-th layer "
                   "(torchtitan's layer checkpointing)")
    p.add_argument("--layers-per-stage", "--layers_per_stage", type=list_of(int),
                   help="layers per stage, kept as given, e.g. 8,24; the first or last of several may be 0, an "
                        "embedding-only or head-only stage (default: even, remainder first)")
    p.add_argument("--stage-devices", "--stage_devices", type=list_of(str),
                   help="device type per stage, e.g. a,b; a+b spreads a stage's DP replicas evenly over both "
                        "types, a*3+b*1 gives the replicas per type")
    p.add_argument("--schedule", choices=("1f1b", "interleaved"))
    p.add_argument("--virtual-stages", "--virtual_stages", type=int_flag)
    p.add_argument("--weights", metavar="wT,wM,wV", help="Phi weights (default: the heterogeneous profile)")
    add_cost_args(p)
    p.add_argument("--cases", metavar="FILE", help="CSV or JSONL, one layout per row (columns: docs/estimate.md); "
                   "--model, --cluster and the training flags fill empty cells")
    p.add_argument("--out", metavar="FILE", help="with --cases: the JSON lines, one per row (default stdout)")
    p.add_argument("--phi", action="store_true",
                   help="with --cases: also score Phi, which needs one search per model, cluster and training "
                        "(under a second each); without it rows give time, memory and fit only")
    add_output_args(p)
    p.set_defaults(handler=run_estimate)


def run_estimate(args) -> int:
    from memx_launch.planning import experts, report
    from memx_launch.planning.estimate import (evaluate_layout, evaluate_plan, host_bound_stages, plan_training,
                                               stage_short_gib)
    from memx_launch.planning.layout_training import plan_sharded_stages
    from memx_launch.planning.objective import parse_weights

    check_headroom(args)
    if args.cases:
        return _run_cases(args)
    if args.phi:
        raise ConfigError("--phi", "only with --cases", "drop it: one layout's estimate always gives Phi")
    check_new_file(args.json, "--json", args.force)
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
                             cost_model=cost_model_from_args(args, model, cluster, training))
    else:
        missing = [f"--{f.replace('_', '-')}" for f in ("model", "tp", "pp", "dp", "micro_batch_size")
                   if getattr(args, f) is None and not (f == "tp" and args.stage_tp) and not (f == "dp" and args.stage_dp)]
        if missing:
            raise ConfigError(missing[0], "missing", "give --model, --tp (or --stage-tp), --pp, --dp (or --stage-dp) "
                              "and --micro-batch-size, or --plan FILE")
        model = model_from_args(args)
        training = training_from_args(args, model)
        split_note = "" if args.layers_per_stage else "no --layers-per-stage: even split, remainder on the first stages"
        plan = evaluate_layout(model, cluster, training, tp=args.tp, stage_tp=args.stage_tp, pp=args.pp, dp=args.dp,
                               cp=1 if args.cp is None else args.cp, stage_dp=args.stage_dp,
                               micro_batch_size=args.micro_batch_size,
                               layers_per_stage=args.layers_per_stage,
                               recompute=args.recompute, stage_devices=args.stage_devices,
                               schedule=args.schedule or "1f1b", virtual_stages=1 if args.virtual_stages is None else args.virtual_stages,
                               weights=weights, cost_model=cost_model_from_args(args, model, cluster, training),
                               memory_headroom=args.memory_headroom)
    sharded = plan_sharded_stages(training, plan)
    if sharded:  # every stage, or those beside a DP group spanning domains (layout_training.py)
        where = "" if len(sharded) == plan.pp else f"stage{'s' * (len(sharded) > 1)} {', '.join(map(str, sharded))} "
        split_note = "; ".join(filter(None, [split_note, f"{where}priced fully sharded: TP > 1 with DP > 1 runs FSDP2 "
                                                         "(--fully-sharded-with-tp)"]))
    if model.last_stage_reads_embedding and plan.pp > 1 and (0 in sharded) != (plan.pp - 1 in sharded):
        split_note = "; ".join(filter(None, [split_note, "memx-run refuses this layout: it would shard one end of "
                                                         "the tied embeddings and not the other"]))
    # The host's share is the analytical model's: a profile DB's learned ratios hold their own.
    host_bound = [] if args.profile_db else host_bound_stages(plan, cluster)
    print(report.estimate_report(plan, cluster, args.memory_headroom, split_note, host_bound,
                                 analytical_rates(args, cluster, training, model)))
    if args.json:
        plan.save(args.json, overwrite=args.force, flag="--json")
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
    if args.weights and not args.phi:
        raise ConfigError("--weights", "only changes Phi, which --cases scores with --phi",
                          "add --phi, or drop --weights")
    check_new_file(args.out, "--out", args.force)
    if args.profile_db and not os.path.exists(args.profile_db):
        raise ConfigError("--profile-db", f"{args.profile_db} does not exist", "run memx profile first")
    print(run_cases(args.cases, args.out, overwrite=args.force, defaults={k: getattr(args, k, None) for k in FLAG_DEFAULTS},
                    memory_headroom=args.memory_headroom, weights=parse_weights(args.weights) if args.weights else None,
                    phi=args.phi,
                    cost_model_for=profile_cost_models(args.profile_db) if args.profile_db else None),
          file=sys.stderr)
    return 0


def add_export_command(sub) -> None:
    p = sub.add_parser("export", help="a plan as Megatron-LM arguments, torchrun lines and MEMX_* variables, "
                       "or as a torchtitan or DeepSpeed config")
    p.add_argument("--plan", required=True, metavar="FILE", help="plan JSON from memx plan --json")
    p.add_argument("--to", choices=("megatron", "torchtitan", "deepspeed"), default="megatron",
                   help="megatron: Megatron-LM arguments, MEMX_* variables and torchrun lines (default); "
                   "torchtitan: its job TOML; deepspeed: its JSON config (data-parallel plans; accelerate "
                   "takes it with --deepspeed_config_file). What the target cannot say is printed as notes")
    p.add_argument("--cluster", help="cluster YAML; needed for the per-node torchrun lines")
    p.add_argument("--script", default="train.py", help="training script for the torchrun lines")
    p.add_argument("--master-addr", "--master_addr",
                   help="rendezvous address (default: the cluster file's master_addr or first node's host)")
    p.add_argument("--master-port", "--master_port", type=int_flag, default=29500)
    p.set_defaults(handler=run_export)


def run_export(args) -> int:
    from memx_launch.planning import exporters, launch_lines
    from memx_launch.planning.runtime_support import check_runnable

    if not 1 <= args.master_port <= 65535:
        raise ConfigError("--master-port", f"{args.master_port} is not a TCP port", "e.g. --master-port 29500")
    plan = Plan.load(args.plan)
    if args.to != "megatron":
        from memx_launch.planning import config_exports

        config = (config_exports.torchtitan_toml if args.to == "torchtitan" else config_exports.deepspeed_json)(plan)
        print(config.text, end="")
        for note in config.notes:  # JSON has no comments: the notes go to stderr for both
            print(f"note: {note}", file=sys.stderr)
        return 0
    cluster = ClusterSpec.from_yaml(args.cluster) if args.cluster else None
    megatron = exporters.megatron_args(plan, cluster)
    print("# Megatron-LM arguments")
    print(megatron.command_line())
    for note in megatron.notes:
        print(f"# note: {note}")
    print("\n# environment for the training script")
    print("\n".join(launch_lines.env_lines(launch_lines.plan_env(plan, os.path.abspath(args.plan)))))
    if cluster is not None:
        targets = [("memx's runtime (the plan's rank order)", False), ("Megatron-LM (stages on consecutive ranks)", True)]
        try:
            check_runnable(plan)
        except ConfigError as refusal:
            print(f"\n# no torchrun lines for memx's runtime: {refusal.problem}")
            targets = targets[1:]
        for title, for_megatron in targets:
            print(f"\n# torchrun for {title}, one line per node")
            for cmd in launch_lines.torchrun_commands(plan, cluster, args.script, master_addr=args.master_addr,
                                                      master_port=args.master_port, for_megatron=for_megatron):
                print(f"{cmd.command_line()}" + "".join(f"  # {note}" for note in cmd.notes))
    return 0
