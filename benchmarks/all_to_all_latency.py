"""memx's expert-parallel all-to-all against Megatron-Core's measured ones: the dispatch and
combine latencies of DeepSeek-V3's MoE layer (hidden 7,168, 4,096 tokens a rank, top-8 of 256
experts) on DGX-H100 (8 GPUs a node, NVLink 4 inside, 400 Gb/s a GPU between nodes) and GB200
NVL72 (one NVLink 5 domain) at EP 8-64, from Table 7 of NVIDIA's "Scalable Training of
Mixture-of-Experts Models with Megatron Core" (arXiv 2603.07685), copied into
benchmarks/data/mcore_moe_all_to_all.csv. memx times each of the table's dispatchers, uncalibrated,
at the datasheet links of ``benchmarks.common``, in bf16, with DeepSeek-V3's group-limited routing
(top-8 from 4 of 8 groups; ``experts.exchange_seconds``): the all-to-all dispatcher, every
routed copy sent, and HybridEP as the flex dispatcher, a token sent once to each rank, and
across nodes once to each node; a quarter of each (one of a block's four exchanges). Writes benchmarks/results/all_to_all_latency.json.
Run: .venv/bin/python benchmarks/all_to_all_latency.py   (under a second)
"""

from __future__ import annotations

import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import dgx_cluster, mape  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning import experts  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

DATA = os.path.join(HERE, "data", "mcore_moe_all_to_all.csv")
OUT = os.path.join(HERE, "results", "all_to_all_latency.json")
SYSTEMS = {"dgx-h100": "h100_80gb", "dgx-gb200": "gb200"}
TOKENS = 4096


def predicted_us(system: str, ep: int, dispatcher: str = "alltoall") -> float:
    """memx's one exchange of DeepSeek-V3's routed tokens over ``ep`` ranks by ``dispatcher``, in
    microseconds."""
    gpu, model = SYSTEMS[system], get_model("deepseek-v3")
    cluster = dgx_cluster(gpu, 64 if gpu == "gb200" else max(ep, 8))
    training = TrainingSpec(global_batch_size=64, seq_len=TOKENS, setup="megatron", expert_parallel=ep,
                            expert_dispatcher=dispatcher)
    per_byte = experts.exchange_seconds_per_byte(model, training, cluster, gpu)
    seconds = float(experts.exchange_seconds(model, training, TOKENS, 1, per_byte))
    return seconds / experts.ALL_TO_ALLS * 1e6


def main() -> None:
    with open(DATA) as f:
        rows = [{**r, "ep": int(r["ep"]), "all_to_all_us": float(r["all_to_all_us"]),
                 "hybridep_us": float(r["hybridep_us"])} for r in csv.DictReader(f)]
    for r in rows:
        for dispatcher, measured in (("alltoall", "all_to_all_us"), ("flex", "hybridep_us")):
            r[f"predicted_{dispatcher}_us"] = round(predicted_us(r["system"], r["ep"], dispatcher), 1)
            r[f"{dispatcher}_ratio"] = round(r[f"predicted_{dispatcher}_us"] / r[measured], 3)

    def summarise(members, dispatcher, measured):
        return {"rows": len(members), "mape_pct": round(mape([r[f"predicted_{dispatcher}_us"] for r in members],
                                                             [r[measured] for r in members]), 1),
                "ratio_range": [min(r[f"{dispatcher}_ratio"] for r in members),
                                max(r[f"{dispatcher}_ratio"] for r in members)]}
    summary = {f"{dispatcher} {system}": summarise(members, dispatcher, measured)
               for dispatcher, measured in (("alltoall", "all_to_all_us"), ("flex", "hybridep_us"))
               for system, members in [*((s, [r for r in rows if r["system"] == s]) for s in SYSTEMS), ("all", rows)]}
    write_json_atomic(OUT, {"machine": machine_info(), "source": "arXiv 2603.07685, Table 7", "summary": summary,
                            "rows": rows}, overwrite=True)
    for r in rows:
        print(f"{r['system']:10s} {r['op']:8s} EP {r['ep']:3d}  all-to-all {r['all_to_all_us']:6.0f} us,"
              f" memx {r['predicted_alltoall_us']:6.0f} ({r['alltoall_ratio']:.2f});  HybridEP"
              f" {r['hybridep_us']:6.0f} us, memx flex {r['predicted_flex_us']:6.0f} ({r['flex_ratio']:.2f})")
    for name, s in summary.items():
        print(f"{name}: {s}")


if __name__ == "__main__":
    main()
