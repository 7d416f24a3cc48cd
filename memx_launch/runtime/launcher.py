"""``memx-run``: torchrun plus memx.

The parser is torch.distributed.run's own, so every torchrun flag keeps its spelling (dashed
and underscore forms) and meaning; memx adds its flags, which like torchrun's go before the
script. The script's own ``--model NAME`` is read (not taken away) when memx-run has none.
Everything is checked before any worker starts (the script too: :mod:`script_check`): a bad
input is one error line and a non-zero exit, and nothing is overwritten.

Then either ``--dry-run`` (plan here, print the plan and the torchrun line, exit) or the job: the workers
run :func:`memx_launch.runtime.worker.run_worker`, which plans (unless --plan) and restarts in place with it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

from memx_launch.errors import ConfigError, MemxError
from memx_launch.files import check_output_path, path_component
from memx_launch.planning.objective import add_slowdown_arg, parse_slowdown, parse_weights
from memx_launch.planning.plan import Plan
from memx_launch.planning.runtime_support import (as_memx_run_trains, check_runnable, one_stage_blocks,
                                                  one_stage_restriction, runnable_model, tp_one_blocks,
                                                  tp_one_restriction)
from memx_launch.planning.search import check_space
from memx_launch.planning.search_space import SearchSpace, add_restriction_args, restrictions_from_args
from memx_launch.runtime import rendezvous
from memx_launch.runtime.agent import start_fork_server, stop_fork_server
from memx_launch.runtime.dry_run import dry_run
from memx_launch.runtime.job_planning import planning_env
from memx_launch.runtime.node_processes import has_gpu, max_nodes, node_processes
from memx_launch.runtime.process_exit import end_process
from memx_launch.runtime.script_check import check_builder, check_script_args, script_flag
from memx_launch.specs import DTYPE_BYTES, ClusterSpec, TrainingSpec, get_model
from memx_launch.specs.config_file import add_config_args, add_version_arg, config_yaml, one_line_error, parse_with_config
from memx_launch.specs.precision import device_precision, param_dtype, with_param_dtype
from memx_launch.specs.inputs import float_flag, int_flag
from memx_launch.runtime.runs import (CHECKPOINT_DIR, COMMAND_VAR, DEFAULT_PROFILE_DB, DEFAULT_RUNS_DIR,
                                      LAUNCHER_PID_VAR, STOPPED_FILE, check_environment, check_profile_db, max_replans,
                                      prediction_summary, previous_run, record_stopped, stopped_run_of, stopped_state)


EMULATED_GLOBAL_BATCH_SIZE = 16  # emulated devices are CPU stand-ins: a batch they train in seconds, in fp32
# PyTorch's caching allocator in expandable segments: a step's tensors of changing sizes leave
# far less reserve it cannot reuse (NVIDIA's Megatron-Bridge memory guide: a Llama3-70B SFT run
# out of memory at 58.8 GB of allocated peak on 80 GB H100s ran with it, at no cost in
# throughput), which is the small reserve memx's overhead counts. The user's own setting is kept.
ALLOCATOR_CONF_VAR, ALLOCATOR_CONF = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"


def build_parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "memx-run"
    parser.error = lambda message: one_line_error(parser, message, "memx-run")  # not torchrun's usage dump
    # nproc None: not given; this node's count then comes from the cluster file or its GPUs.
    parser.set_defaults(nproc_per_node=os.environ.get("PET_NPROC_PER_NODE"),
                        start_method=os.environ.get("PET_START_METHOD", "forkserver"))
    for action in parser._actions:
        if action.dest == "start_method":
            action.help = ("how workers start (default forkserver: one process imports torch once and forks "
                           "every worker of every start from it; spawn: a new interpreter per worker)")
        elif action.dest == "nproc_per_node":
            action.help = ("processes on this node: a number, or gpu/auto (default: this node's devices in "
                           "--cluster, the entry at --node-rank; without a cluster file one per GPU, 1 on a "
                           "CPU machine). Nodes may start different numbers")
    parser.description = ("torchrun plus memx: plans TP/PP/DP, layer split, recompute and schedule for the "
                          "cluster in the job, then trains with the plan. memx and torchrun flags go before "
                          "the script.")
    g = parser.add_argument_group("memx")
    g.add_argument("--cluster", metavar="FILE", help="cluster YAML (default: detect the devices in the job)")
    g.add_argument("--plan", metavar="FILE", help="run this plan (skip calibration and search)")
    g.add_argument("--model", help="model to plan for (default: the script's own --model)")
    g.add_argument("--dry-run", "--dry_run", action="store_true",
                   help="plan here (analytical model, or --profile-db), print the plan and the torchrun line, exit")
    g.add_argument("--export-plan", "--export_plan", metavar="FILE", help="also write the plan to FILE (must not exist)")
    g.add_argument("--objective", choices=("default", "safety", "throughput"),
                   help="weight profile of Phi (no --max-slowdown bound unless given too)")
    g.add_argument("--weights", metavar="wT,wM,wV",
                   help="explicit Phi weights (override --objective; no --max-slowdown bound unless given too)")
    add_slowdown_arg(g)
    g.add_argument("--search-budget-s", "--search_budget_s", type=float_flag, metavar="S", help="search time budget")
    add_restriction_args(g)
    g.add_argument("--mixed-stages", "--mixed_stages", action="store_true", help="also search stages whose DP "
                   "replicas sit on several device types (and domains: gradients summed over the bridge)")
    g.add_argument("--per-type-tp", "--per_type_tp", action="store_true",
                   help="let each device type take its own TP degree (stages of different degrees)")
    g.add_argument("--calibration-budget-s", "--calibration_budget_s", type=float_flag, metavar="S",
                   help="time each device type may spend calibrating (default 600): fewer samples when the "
                        "estimate is over it, and a refusal up front when not even a few fit")
    g.add_argument("--fully-sharded", "--fully_sharded", action="store_true",
                   help="shard weights, gradients and optimizer states over each stage's DP ranks (FSDP2, block by "
                        "block), planned as torch's pipeline schedules run it: a stage holds its gathered weights "
                        "and unsharded gradients through the step (default: a given plan's, else DDP)")
    g.add_argument("--shard-degree", "--shard_degree", type=int_flag, metavar="N",
                   help="with --fully-sharded: shard over N consecutive ranks of each DP group, e.g. a node's, "
                        "replicated over the rest (HSDP: FSDP2 on a replicate x shard mesh; default: a given plan's, "
                        "else the whole group)")
    g.add_argument("--frozen-fraction", "--frozen_fraction", type=float_flag, metavar="F",
                   help="fine-tuning: the share of the model's parameters the script freezes (requires_grad off), "
                        "planned without their gradients, optimizer states and weight-gradient GEMMs (default: a "
                        "given plan's, else 0; the job says where the model's own share differs)")
    g.add_argument("--no-replan", "--no_replan", action="store_true",
                   help="never re-plan during training (passed to the workers as MEMX_NO_REPLAN=1)")
    g.add_argument("--profile-db", "--profile_db", metavar="FILE",
                   help=f"calibration samples, read and appended (default {DEFAULT_PROFILE_DB})")
    g.add_argument("--global-batch-size", "--global_batch_size", type=int_flag,
                   help=f"sequences per step (default 512; {EMULATED_GLOBAL_BATCH_SIZE} on emulated clusters)")
    g.add_argument("--seq-len", "--seq_len", type=int_flag, help="tokens per sequence (default: the model's)")
    g.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                   help="training precision, also calibrated and planned for (default bf16 on GPUs, fp32 on CPUs); "
                        "bf16/fp16 autocast with fp32 master weights")
    g.add_argument("--param-dtype", "--param_dtype", choices=sorted(DTYPE_BYTES),
                   help="the dtype the script builds the model's parameters in: fp32 (default: a given plan's), or "
                        "--dtype's 16 bits (from_pretrained keeps a checkpoint's dtype): weights, gradients and "
                        "Adam's moments in 16 bits, no fp32 master copy; sets --dtype unless given")
    g.add_argument("--model-builder", "--model_builder", metavar="FILE:FUNCTION",
                   help="calibrate the script's own block: FUNCTION(model, seed) in FILE builds the nn.Module "
                        "(e.g. examples/train_own_model.py:build); plans then keep TP = 1")
    g.add_argument("--run-dir", "--run_dir", metavar="DIR",
                   help=f"where the plan, restart records and checkpoints go (default {DEFAULT_RUNS_DIR}/<model>-<time>); "
                        "a run directory that already holds this model's plan is resumed from its latest checkpoint")
    g.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped run: its plan and its latest checkpoint (same as --run-dir RUN_DIR)")
    g.add_argument("--verbose", action="store_true",
                   help="when workers fail, also torchrun's root-cause table and its log lines (default: one line)")
    add_config_args(g)  # memx's and torchrun's options; the script's stay after the script
    add_version_arg(g)
    parser.set_defaults(argv=None)
    return parser


class Settings:
    """Resolved settings with where each came from: (default), (file) or (flag)."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, name: str, value, source: str) -> None:
        self.rows.append((name, str(value), source))

    def render(self) -> str:
        width = max(len(n) for n, _, _ in self.rows)
        return "\n".join(f"  {n:<{width}}  {v}  ({s})" for n, v, s in self.rows)


def resolve(args) -> dict:
    """Check every input and resolve every setting; raises ConfigError before anything runs."""
    from memx_launch.runtime.calibration import DEFAULT_CALIBRATION_BUDGET_S  # torch: not before main

    settings = Settings()
    check_environment()
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be 0 or more, got {args.max_restarts}", "e.g. --max-restarts 3")
    if not args.module and not args.no_python and not os.path.isfile(args.training_script):
        raise ConfigError("training_script", f"{args.training_script} does not exist",
                          "give the path of the training script (e.g. examples/train.py)")
    script_args = list(args.training_script_args)
    if not args.module and not args.no_python:  # a typo in its flags would surface after calibration
        check_script_args(args.training_script, script_args,
                          {flag for action in build_parser()._actions for flag in action.option_strings})
    # The command line as given (main sets it): the same command continues a run a signal stopped.
    run_dir = args.resume or args.run_dir or (stopped_run_of(args.argv) if args.argv is not None else None)
    previous = previous_run(run_dir, args) if run_dir else None
    model_name, source = args.model, "flag"
    if model_name is None and previous is not None:
        model_name, source = previous.model_spec.name, f"{run_dir}/plan.json"
    if model_name is None:
        model_name, source = script_flag(script_args, "--model"), "flag, the script's --model"
    if model_name is None:
        raise ConfigError("--model", "not given", "pass --model NAME to memx-run or to the script")
    read = runnable_model(get_model(model_name))
    model = as_memx_run_trains(read)
    not_llama = [what for what, present in (("experts", model.num_experts), ("latent attention", model.kv_lora_rank))
                 if present]
    if not_llama and not os.path.exists(model_name) and not args.model_builder:
        raise ConfigError("--model", f"{model.name} has {' and '.join(not_llama)}, which memx's own LLaMA does not "
                          "build", "give the model's config.json as --model and train its own module "
                          "(memx_launch.prepare), or plan it with memx plan for Megatron-LM")
    # What the workers read back with get_model: a config.json's path (absolute), else the catalog name.
    model_arg = os.path.abspath(model_name) if os.path.exists(model_name) else model.name
    settings.add("model", model.name, source)
    if read.mtp_layers:
        settings.add("multi-token prediction", f"its {read.mtp_layers} module(s) not in the model trained: "
                     "planned without them", "config.json")

    cluster = ClusterSpec.from_yaml(args.cluster) if args.cluster else None
    nodes = max_nodes(args)
    local, source = node_processes(args, cluster)
    args.nproc_per_node = str(local)
    settings.add("processes on this node", local, source)
    world = None  # known up front with a cluster file or on one node; else from the rendezvous
    if cluster is not None:
        if nodes != len(cluster.nodes) and not args.dry_run:
            raise ConfigError("--nnodes", f"{nodes} node(s), but {args.cluster} lists {len(cluster.nodes)}",
                              f"start memx-run on each node with --nnodes {len(cluster.nodes)} --node-rank N "
                              "--rdzv-backend static --master-addr <node 0's address>")
        world = cluster.world_size
        settings.add("world size", world, "file")
        settings.add("cluster", f"{args.cluster}: {cluster.name}", "flag")
        for name, count in cluster.type_counts().items():
            d = cluster.device_type(name)
            slow = f", slowdown x{cluster.emulation.slowdown_of(name):g} (emulated)" if cluster.is_emulated else ""
            settings.add(f"  {name}", f"{count} x {d.memory_gib:g} GiB, {d.peak_tflops:g} TFLOPS{slow}", "file")
    else:
        if nodes == 1:
            world = local
        settings.add("world size", world or "from the rendezvous (the nodes' processes together)", "default")
        settings.add("cluster", "detected in the job", "default")

    plan = None
    if previous is not None:
        plan = previous
        if plan.model_spec.signature() != model.signature():
            raise ConfigError("--run-dir", f"{run_dir} is a run of {plan.model}, not {model.name}",
                              "choose a new run directory, or pass that run's model")
        if plan.world_size != world:
            raise ConfigError("--run-dir", f"{run_dir} ran on {plan.world_size} ranks but the job launches {world}",
                              f"pass --nproc-per-node {plan.world_size}")
        settings.add("plan", f"{run_dir}/plan.json (continuing that run from its latest checkpoint)", "flag")
    elif args.plan:
        plan = check_runnable(Plan.load(args.plan))
        if plan.model_spec.signature() != model.signature():
            raise ConfigError("--plan", f"{args.plan} is a plan for {plan.model}, not {model.name}",
                              f"pass a plan made for {model.name} or drop --plan to plan in the job")
        if world is not None and plan.world_size != world:
            raise ConfigError("--plan", f"{args.plan} needs {plan.world_size} ranks but the job launches {world}",
                              f"pass a plan for {world} ranks, or start {plan.world_size} processes")
        settings.add("plan", args.plan, "flag")
        counted_for = plan.training.get("setup")
        if counted_for != "memx-run":  # its predicted peaks (the monitor's baseline) are another framework's
            settings.add("plan's setup", f"{counted_for or 'none'}: its memory and time counted for another "
                         "framework than memx-run's (memx plan --setup memx-run counts it as memx-run runs)", "plan")
    else:
        settings.add("plan", "searched in the job after calibration" if not args.dry_run else "searched here",
                     "default")
    emulated = cluster.is_emulated if cluster is not None else not has_gpu()
    # A given or continued plan keeps its batch, in its re-plans too: a flag may only repeat it.
    batch = {"global_batch_size": args.global_batch_size, "seq_len": args.seq_len}
    for field, given in batch.items():
        if None not in (given, getattr(plan, field, None)) and given != getattr(plan, field):
            raise ConfigError(f"--{field.replace('_', '-')}", f"{given}, but the plan trains {getattr(plan, field)}", "drop it")
    gbs = args.global_batch_size or getattr(plan, "global_batch_size", None) or (
        EMULATED_GLOBAL_BATCH_SIZE if emulated else TrainingSpec.global_batch_size)
    # What memx's runtime does: --setup memx-run (specs/setups.py); a given fully sharded plan's re-plans stay so,
    # over its shard groups too (HSDP).
    sharded = args.fully_sharded or bool(plan is not None and plan.training.get("fully_sharded"))
    planned = plan.training.get("shard_degree") if plan is not None else None
    if args.shard_degree is not None and (not sharded or (plan is not None and args.shard_degree != planned)):
        raise ConfigError("--shard-degree", f"{args.shard_degree}, but " + ("the plan shards over "
                          f"{planned or 'the whole DP group'}" if sharded else "nothing is sharded"),
                          "drop it" if sharded else "add --fully-sharded")
    shards = args.shard_degree or (planned if sharded else None)
    frozen = plan.training.get("frozen_fraction", 0.0) if plan is not None else 0.0
    if args.frozen_fraction is not None and plan is not None and args.frozen_fraction != frozen:
        raise ConfigError("--frozen-fraction", f"{args.frozen_fraction}, but the plan freezes {frozen}", "drop it")
    frozen = frozen if args.frozen_fraction is None else args.frozen_fraction
    training = TrainingSpec(global_batch_size=gbs, seq_len=args.seq_len or getattr(plan, "seq_len", None) or model.seq_len,
                            dtype=args.dtype or (args.param_dtype if args.param_dtype not in (None, "fp32") else None)
                            or getattr(plan, "training", {}).get("dtype") or ("fp32" if emulated else "bf16"),
                            setup="memx-run",
                            fully_sharded=sharded or None, shard_degree=shards, frozen_fraction=frozen)
    settings.add("frozen parameters", f"{frozen:.0%} (fine-tuning)" if frozen else "none: every parameter trains",
                 "flag" if args.frozen_fraction is not None else "plan" if plan is not None and frozen else "default")
    settings.add("data parallel", "DDP (FSDP2 with TP)" if not sharded else f"HSDP, shard groups of {shards} (FSDP2)"
                 if shards else "fully sharded (FSDP2)",
                 "flag" if args.fully_sharded or args.shard_degree else "plan" if sharded else "default")
    for name, field in (("global batch size", "global_batch_size"), ("sequence length", "seq_len")):
        settings.add(name, getattr(training, field), "flag" if batch[field] else "plan" if plan else "default")
    training, why = device_precision(cluster, training, args.dtype is not None) if cluster else (training, "")
    settings.add("dtype", why or training.dtype, "flag" if args.dtype else "default")
    given = param_dtype(TrainingSpec(**plan.training)) if plan is not None else None
    if None not in (args.param_dtype, given) and args.param_dtype != given:
        raise ConfigError("--param-dtype", f"{args.param_dtype}, but the plan's parameters are {given}", "drop it")
    training = with_param_dtype(training, args.param_dtype or given or "fp32")
    settings.add("parameters", "fp32" + (", the optimizer's master copy" if training.dtype != "fp32" else "")
                 if param_dtype(training) == "fp32" else f"{training.dtype}: no fp32 copy",
                 "flag" if args.param_dtype else "plan" if given else "default")

    if args.weights:
        parse_weights(args.weights)
    max_slowdown = parse_slowdown(args.max_slowdown) if args.max_slowdown else None
    bound = SearchSpace(max_slowdown=max_slowdown).bound(args.objective, args.weights)
    settings.add("objective", (args.weights or args.objective or "chosen from the cluster")
                 + (f", at most {bound:.0%} slower than the fastest plan" if bound is not None else ", no time bound"),
                 "flag" if args.weights or args.objective or max_slowdown is not None else "default")
    if args.search_budget_s is not None and not 0 < args.search_budget_s < math.inf:
        raise ConfigError("--search-budget-s", f"must be positive, got {args.search_budget_s}", "e.g. 30")
    settings.add("search budget", f"{args.search_budget_s:g} s" if args.search_budget_s else "none",
                 "flag" if args.search_budget_s else "default")
    if args.calibration_budget_s is not None and args.calibration_budget_s <= 0:
        raise ConfigError("--calibration-budget-s", f"must be positive, got {args.calibration_budget_s}", "e.g. 600")
    settings.add("calibration budget", f"{args.calibration_budget_s or DEFAULT_CALIBRATION_BUDGET_S:g} s per device type",
                 "flag" if args.calibration_budget_s else "default")
    builder = None
    if args.model_builder:
        path, _, function = args.model_builder.rpartition(":")
        if not path or not function or not os.path.isfile(path):
            raise ConfigError("--model-builder", f"{args.model_builder!r} is not FILE:FUNCTION of an existing file",
                              "e.g. --model-builder examples/train_own_model.py:build")
        check_builder(path, function)
        builder = [os.path.abspath(path), function, model_arg]
        settings.add("calibrated block", f"{function} in {path} (TP = 1)", "flag")
    restrictions = restrictions_from_args(args)  # the job's search and re-plans (or only those) keep to these
    restrictions.update({flag: True for flag in ("mixed_stages", "per_type_tp") if getattr(args, flag)})
    why = {}  # what set a restriction other than its flag
    tp_one = tp_one_blocks(model, builder is not None)
    if tp_one is not None:
        restrictions["tp_degrees"] = tp_one_restriction(restrictions.get("tp_degrees"), tp_one)
        why["tp_degrees"] = tp_one
    one_stage = one_stage_blocks(model)
    if one_stage is not None:  # one stage over every device type: its DP replicas on several
        restrictions["pipeline_degrees"] = one_stage_restriction(restrictions.get("pipeline_degrees"), one_stage)
        why["pipeline_degrees"] = f"blocks with {one_stage}"
        if not args.mixed_stages:
            restrictions["mixed_stages"], why["mixed_stages"] = True, "one stage over every device type"
    check_space(model, cluster if plan is None else None, training,  # what the job would refuse after calibrating
                SearchSpace(fewer_microbatches_than_stages=False, max_slowdown=max_slowdown, **restrictions))
    applies = "" if previous is None and not args.plan else " (unused: --no-replan)" if args.no_replan \
        else " (re-plans)"
    for field, values in restrictions.items():
        source = why.get(field, "flag")
        shown = ",".join(map(str, values)) if isinstance(values, tuple) else "yes"
        settings.add(f"search {field.replace('_', ' ')}{applies}", shown, source)
    if max_slowdown is not None:  # the job's search and its re-plans (shown with the objective)
        restrictions["max_slowdown"] = max_slowdown
    # The script's own block is stored apart: its samples have the shape of memx's block of that model.
    default_db = DEFAULT_PROFILE_DB if builder is None else os.path.join(
        DEFAULT_RUNS_DIR, f"profiles.{os.path.splitext(os.path.basename(builder[0]))[0]}.{builder[1]}.jsonl")
    profile_db = args.profile_db or default_db
    check_profile_db(profile_db)
    settings.add("profile db", profile_db, "flag" if args.profile_db else "default")
    if args.export_plan:
        check_output_path(args.export_plan, "--export-plan")
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # the model's name is a config.json's: never a path
    run_dir = run_dir or os.path.join(DEFAULT_RUNS_DIR, f"{path_component(model.name, 'model')}-{stamp}")
    if previous is None and os.path.exists(os.path.join(run_dir, CHECKPOINT_DIR)):  # the workers would resume
        raise ConfigError("--run-dir", f"{run_dir} holds checkpoints but no plan.json", "choose a new run directory")
    check_output_path(os.path.join(run_dir, "plan.json"), "--run-dir", force=True)
    settings.add("run dir", run_dir, "flag" if args.run_dir or args.resume else
                 "the stopped run of this command" if previous is not None else "default")
    settings.add("max restarts", f"{args.max_restarts} for crashes (planned restarts not counted)",
                 "flag" if args.max_restarts else "default")
    users_conf = os.environ.get(ALLOCATOR_CONF_VAR)
    allocator_conf = users_conf or ALLOCATOR_CONF
    settings.add("CUDA allocator", allocator_conf, ALLOCATOR_CONF_VAR if users_conf else "default")
    replans = max_replans()
    settings.add("replan during training", "off" if args.no_replan else f"monitor decides, at most {replans} "
                 "re-plans", "flag" if args.no_replan else "MEMX_MAX_REPLANS" if os.environ.get("MEMX_MAX_REPLANS")
                 else "default")
    return dict(settings=settings, model=model, cluster=cluster, training=training, plan=plan,
                profile_db=profile_db, run_dir=run_dir, script_args=script_args, builder=builder,
                model_arg=model_arg, resumed=previous is not None, argv=args.argv, restrictions=restrictions,
                allocator_conf=allocator_conf)


def launch(args, resolved) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from memx_launch.runtime.agent import run_agent
    from memx_launch.runtime.worker import run_worker

    run_dir = resolved["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    if resolved["resumed"]:  # generations count from 0 again: the old planned restarts are not this job's
        from memx_launch.runtime.restarts import PLANNED_RESTARTS_FILE
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, PLANNED_RESTARTS_FILE))
    plan_path = args.export_plan or os.path.join(run_dir, "plan.json")
    if resolved["plan"] is not None:  # re-plans rewrite MEMX_PLAN: never the user's own file
        resolved["plan"].save(plan_path, overwrite=True)
    env = {
        "MEMX_RUN_DIR": run_dir, "MEMX_PLAN": os.path.abspath(plan_path), **planning_env(args, resolved),
        "MEMX_PROFILE_DB": os.path.abspath(resolved["profile_db"]),
        "MEMX_TRAINING": json.dumps(resolved["training"].__dict__),
        "MEMX_OBJECTIVE": args.objective or "", "MEMX_WEIGHTS": args.weights or "",
        "MEMX_SEARCH_BUDGET_S": "" if args.search_budget_s is None else str(args.search_budget_s),
        "MEMX_CALIBRATION_BUDGET_S": "" if args.calibration_budget_s is None else str(args.calibration_budget_s),
        "MEMX_REPRODUCE": json.dumps([args.training_script, *resolved["script_args"]]),
        # The workers stop (with a checkpoint) when this process is gone (supervisor.py), and leave
        # the command line so that the same command continues the run.
        LAUNCHER_PID_VAR: str(os.getpid()), COMMAND_VAR: json.dumps(resolved["argv"]),
    }
    if args.cluster:
        env["MEMX_CLUSTER"] = os.path.abspath(args.cluster)
    env[ALLOCATOR_CONF_VAR] = resolved["allocator_conf"]  # the user's own, else expandable segments
    os.environ.update(env)
    # The workers run memx's worker, which runs the script. Planned restarts (the initial plan,
    # each re-plan) go through the agent too; memx's agent does not count them (agent.py).
    worker_args = (["--module"] if args.module else []) + [args.training_script, *resolved["script_args"]]
    rendezvous.configure(args)  # a one-node job on loopback; a secret run id; no pickle from the store
    rendezvous.check_endpoint(args)  # another program on the store's port: one line, not minutes of silence
    with contextlib.suppress(FileNotFoundError):  # continued now: a later same command starts a new run
        os.remove(os.path.join(run_dir, STOPPED_FILE))
    try:
        code = run_agent(args, run_worker, worker_args, verbose=args.verbose)
        if code == 0 and (summary := prediction_summary(run_dir)):
            print(f"memx-run: {summary}", file=sys.stderr)
        return code
    except SignalException as exc:  # the workers checkpointed and said so (supervisor.stop_at_signal)
        record_stopped(run_dir, resolved["argv"], exc.sigval.name)
        print(f"memx-run: stopped by {exc.sigval.name}: {stopped_state(run_dir, resolved['profile_db'])}",
              file=sys.stderr)
        return 128 + int(exc.sigval)


def main(argv: list[str] | None = None) -> int:
    """memx-run on ``argv`` (default: the command line, whose fork server starts first). Stopped by
    a signal, the command line's process ends without interpreter finalization (:func:`end_process`)."""
    code = _main(argv)
    if argv is None and code > 128:
        end_process(code)
    return code


def _main(argv: list[str] | None) -> int:
    early = argv is None and start_fork_server(sys.argv[1:])
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parse_with_config(parser, argv)
        args.argv = argv
        if args.print_config:
            print(config_yaml(parser, args), end="")
            return 0
        resolved = resolve(args)
        print("memx-run settings:\n" + resolved["settings"].render(), flush=True)
        if args.dry_run:
            return dry_run(args, resolved)
        return launch(args, resolved)
    except MemxError as exc:
        print(f"memx-run: error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if early:  # a job stopped it already; after bad input nothing will fork
            stop_fork_server()


if __name__ == "__main__":
    sys.exit(main())
