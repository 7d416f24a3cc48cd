"""What memx-run's partitioned pipeline sends save where a pipeline crosses vendors, as memx prices them.

Between stages of one TP degree each TP rank of memx-run sends its TP-th of every hidden state
and gradient, and the receiving stage all-gathers the whole over its own TP links
(``--partitioned-sends``, on in ``--setup memx-run`` on each edge where that is priced faster:
``--partition-where-faster``, the plan's ``send_parts`` per stage; docs/setups.md). Over the bridge between
vendors (gloo over TCP, staged through host memory: docs/clusters.md) that cuts the bytes each
rank stages and sends by TP. This script runs memx-run's search (``--setup memx-run``) for
LLaMA-2 13B and LLaMA-3 70B on two HGX H100 nodes and two MI300X nodes
(``examples/clusters/h100-mi300x.yaml``; NCCL and RCCL: every pipeline edge between them takes
the bridge), sequence 4,096, global batch 256, bf16, with
partitioned sends and with whole ones: each winner's layout, predicted step, peak memory and
what crosses the bridge per rank and step. Predictions, not measurements: no run here checks them.

Writes benchmarks/results/bridge_sends.json.
Run: .venv/bin/python benchmarks/bridge_sends.py   (seconds)
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning.search import search  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.cluster import ClusterSpec  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "bridge_sends.json")
MODELS = ("llama2-13b", "llama3-70b")
CLUSTER = ClusterSpec.from_yaml(os.path.join(ROOT, "examples", "clusters", "h100-mi300x.yaml"))


def winner(model, partitioned: bool) -> dict:
    training = TrainingSpec(global_batch_size=256, seq_len=4096, dtype="bf16", setup="memx-run",
                            partitioned_sends=partitioned)
    plan = search(model, CLUSTER, training).best
    bridge = [c for c in plan.crossings if c.kind == "pipeline"]
    return {"layout": f"tp={plan.tp} pp={plan.pp} dp={plan.dp} mbs={plan.micro_batch_size} {plan.schedule}",
            "stage_devices": [s.device_type for s in plan.stages],
            "send_parts": [s.send_parts for s in plan.stages],
            "predicted_step_s": plan.predicted_iteration_time_s,
            "peak_gib": max(s.predicted_peak_memory_gib for s in plan.stages),
            "bridge_edges": len(bridge),
            "bridge_gib_per_rank": sum(c.bytes_per_step for c in bridge) / 2**30,
            "bridge_s_per_step": sum(c.seconds_per_step for c in bridge)}


def main() -> None:
    rows = []
    for name in MODELS:
        model = get_model(name)
        split, whole = winner(model, True), winner(model, False)
        rows.append({"model": name, "partitioned": split, "whole": whole,
                     "step_ratio_partitioned_over_whole": split["predicted_step_s"] / whole["predicted_step_s"]})
        print(f"{name}: partitioned {split['layout']} {split['predicted_step_s']:.2f} s, bridge "
              f"{split['bridge_gib_per_rank']:.1f} GiB/rank; whole {whole['layout']} {whole['predicted_step_s']:.2f} s, "
              f"bridge {whole['bridge_gib_per_rank']:.1f} GiB/rank; ratio {rows[-1]['step_ratio_partitioned_over_whole']:.3f}")
    write_json_atomic(OUT, {"machine": machine_info(), "cluster": CLUSTER.name,
                            "what": "memx-run's search (--setup memx-run) with partitioned and with whole pipeline "
                                    "sends; predictions", "rows": rows}, overwrite=True)


if __name__ == "__main__":
    main()
