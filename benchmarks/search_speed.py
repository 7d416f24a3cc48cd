"""Search speed: configurations enumerated, evaluated, pruned, cache hits and seconds.

(a) the paper-sized space on examples/clusters/paper-20gpu.yaml with llama2-7b (the paper's
    MemX searched 31,240 configurations in 26.5 s); goal: under 1 s on 2 CPU cores;
(b) llama3-70b on examples/clusters/hetero-1024.yaml with a 30 s budget; goal: under 30 s;
(c) cluster-scale extension (paper section 4.3): the 20-GPU cluster doubled and tripled;
(d) case (a) and the Table 1 cluster with each device type its own TP degree (memx plan
    --per-type-tp), against the same space with one degree.

Usage: python benchmarks/search_speed.py [--repeats 3] [--out benchmarks/results/search_speed.json]
Seconds are the median of the repeats, measured in one process on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic
from memx_launch.planning.search import SearchSpace, search
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.specs.catalog import get_model

CLUSTERS = os.path.join(os.path.dirname(HERE), "examples", "clusters")
PAPER_SPACE = SearchSpace(micro_batch_sizes=(1, 2, 4, 8, 16), seq_lens=(1024, 2048, 4096),
                          schedules=("1f1b", "interleaved"), virtual_stages=(2, 4))


def scaled(cluster: ClusterSpec, factor: int) -> ClusterSpec:
    nodes = tuple(dataclasses.replace(n, name=f"{n.name}-{k}") for k in range(factor) for n in cluster.nodes)
    return dataclasses.replace(cluster, name=f"{cluster.name}-x{factor}", nodes=nodes)


def run_case(name, model, cluster, training, space, budget, repeats):
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = search(model, cluster, training, space=space, time_budget_s=budget)
        runs.append((time.perf_counter() - start, result))
    seconds = statistics.median(r[0] for r in runs)
    stats = runs[-1][1].stats
    best = runs[-1][1].best
    row = {
        "case": name, "model": model.name, "cluster": cluster.name, "world_size": cluster.world_size,
        "enumerated": stats.enumerated, "evaluated": stats.evaluated, "feasible": stats.feasible,
        "pruned_memory": stats.pruned_memory, "pruned_time": stats.pruned_time,
        "pruned_schedule": stats.pruned_schedule, "pruned_batch": stats.pruned_batch,
        "cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses,
        "seconds_median": round(seconds, 4), "seconds_all": [round(r[0], 4) for r in runs],
        "configs_per_second": round(stats.enumerated / seconds),
        "cached_predictions_per_second": round(stats.cache_hits / seconds),
        "time_budget_s": budget, "budget_exhausted": stats.budget_exhausted,
        "best_plan": {"tp": best.tp, "stage_tp": best.stage_tp, "pp": best.pp, "dp": best.dp, "mbs": best.micro_batch_size,
                      "seq_len": best.seq_len, "schedule": best.schedule,
                      "layers": [s.num_layers for s in best.stages],
                      "recompute": [s.recompute for s in best.stages],
                      "predicted_iteration_time_s": round(best.predicted_iteration_time_s, 4)},
    }
    print(f"{name}: {row['enumerated']} configs, {row['evaluated']} evaluated, {seconds:.3f} s "
          f"({row['configs_per_second']}/s), cache {stats.cache_hits} hits / {stats.cache_misses} misses",
          file=sys.stderr)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "search_speed.json"))
    args = parser.parse_args(argv)
    machine = machine_info()
    paper = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "paper-20gpu.yaml"))
    big = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "hetero-1024.yaml"))
    llama2 = get_model("llama2-7b")
    rows = [run_case("a: paper space, 20 GPUs", llama2, paper, TrainingSpec(global_batch_size=128), PAPER_SPACE,
                     None, args.repeats)]
    rows.append(run_case("b: llama3-70b, 1024 GPUs", get_model("llama3-70b"), big,
                         TrainingSpec(global_batch_size=2048, seq_len=8192, distributed_optimizer=True),
                         SearchSpace(micro_batch_sizes=(1, 2, 4, 8), seq_lens=(4096, 8192)), 30.0, args.repeats))
    for factor in (2, 3):
        rows.append(run_case(f"c: paper space, {20 * factor} GPUs", llama2, scaled(paper, factor),
                             TrainingSpec(global_batch_size=128), PAPER_SPACE, None, args.repeats))
    table1 = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    for per_type in (False, True):
        tag = "per-type TP" if per_type else "one TP"
        rows.append(run_case(f"d: paper space, 20 GPUs, {tag}", llama2, paper, TrainingSpec(global_batch_size=128),
                             dataclasses.replace(PAPER_SPACE, per_type_tp=per_type), None, args.repeats))
        rows.append(run_case(f"d: default space, table1-2vendor, {tag}", llama2, table1,
                             TrainingSpec(global_batch_size=64), SearchSpace(per_type_tp=per_type), None, args.repeats))
    goals = {"a_under_1s": rows[0]["seconds_median"] < 1.0 and rows[0]["enumerated"] >= 31240,
             "b_under_30s_budget_honoured": rows[1]["seconds_median"] < 30.0}
    write_json_atomic(args.out, {"machine": machine, "cases": rows, "goals_met": goals}, overwrite=True)
    print(f"wrote {args.out}: goals {goals}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
