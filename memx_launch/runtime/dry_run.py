"""``memx-run --dry-run``: plan here as the job's rank 0 would (the user's block as it runs, the
job's search space; the analytical model, or ``--profile-db``, where the job has its calibration)
or read the given plan, print it and the torchrun line that runs it without a search, start no
worker."""

from __future__ import annotations

import json
import os

from memx_launch.errors import ConfigError
from memx_launch.planning.objective import parse_weights


def dry_run(args, resolved) -> int:
    from memx_launch.planning import report
    from memx_launch.planning.search import search
    from memx_launch.runtime.job_planning import block_training, job_search_space, planning_env
    from memx_launch.runtime.worker_env import reproduce_command

    cluster, model, training = resolved["cluster"], resolved["model"], resolved["training"]
    if cluster is None:
        raise ConfigError("--cluster", "--dry-run plans without starting workers, so it cannot detect devices",
                          "pass --cluster FILE")
    plan = resolved["plan"]
    if plan is None:
        env = {**os.environ, **planning_env(args, resolved)}
        _, training, own = block_training(env, model, training)
        if own:
            print("the script's block runs " + ", ".join(f"{k}={v}" for k, v in sorted(own.items()))
                  + " (read off its modules): planned so")
        cost_model = None
        if args.profile_db:
            from memx_launch.profiling.predictor import load_cost_model
            cost_model = load_cost_model(args.profile_db, model, cluster, training)
        result = search(model, cluster, training, cost_model=cost_model, objective=args.objective,
                        space=job_search_space(env), weights=parse_weights(args.weights) if args.weights else None,
                        time_budget_s=args.search_budget_s)
        print(report.plan_report(result, cluster))
        plan = result.best
    else:
        print(report.estimate_report(plan, cluster))
    plan_path = args.export_plan or args.plan or "PLAN.json"
    if args.export_plan:
        plan.save(args.export_plan)
        print(f"plan written to {args.export_plan}")
    env = {"MEMX_PLAN": plan_path, "MEMX_CLUSTER": args.cluster,
           "MEMX_REPRODUCE": json.dumps([args.training_script, *resolved["script_args"]])}
    print("torchrun command for this plan (no search):\n  " + reproduce_command(plan, cluster, env))
    return 0
