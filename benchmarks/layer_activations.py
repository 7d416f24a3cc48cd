"""memx's count of what one transformer block keeps for its backward, against the bytes a real run
of it allocated: Sailor's ``llm_info.json`` (shared/peer-data/sailor), where each block of its
Megatron-DeepSpeed fork ran its forward once on a GPU at micro-batch 1 (fp32, unfused attention,
torch's softmax) and ``torch.cuda.memory_allocated()`` was read before and after it (its output
included, its input not: what a block adds to a chain of blocks), at each TP degree.

memx's count is the cost model's ``activation_bytes`` of the block with no recompute, for each
model asked as the fork runs it (read in its public code, github.com/eth-easl/sailor,
``third_party/Megatron-DeepSpeed/megatron/model``): GPT-Neo's own block file (torch's LayerNorm,
GELU, a dropout on the attention's and on the MLP's output: Sailor's OPT-350 options,
``real_runs.SAILOR_RUN_OPTIONS``); OPT the same, with OPT's ReLU MLP (its block file is not
public); the fork's LLaMA as its block file builds it: every head its own key and value (no
grouped queries), the gate and up projections apart, torch-op RMSNorms, no dropout.

Per model and TP degree: measured and counted MB and their ratio; and, fitted over the TP degrees
as ``replicated + split / TP`` in units of one fp32 ``s x b x h`` tensor, the part every TP rank
keeps whole and the part TP splits (scores included), measured and counted: where a count differs,
this says which part.

Writes benchmarks/results/layer_activations.json. Run: .venv/bin/python benchmarks/layer_activations.py
(a second).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.predictor_accuracy import SAILOR_MODELS, SAILOR_SEQ, bench_cluster, sailor_device  # noqa: E402
from benchmarks.real_runs import SAILOR_RUN_OPTIONS, shared_dir  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning.costmodel import AnalyticalCostModel  # noqa: E402
from memx_launch.planning.plan import NONE  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "layer_activations.json")
FIRST_BLOCK = "1"  # unit 0 is the embedding; every block was measured alike
LLAMA_FORK_OPTIONS = {"flash_attention": False, "fused_softmax": False, "fused_norm": False, "dropout": False,
                      "fused_gate_up": False, "eager_block": True}


def asked(model_dir: str):
    """The model and training options memx is asked with for the fork's block of ``model_dir``."""
    model = get_model(SAILOR_MODELS[model_dir])
    if model_dir.startswith("LLAMA"):
        return replace(model, num_kv_heads=model.num_heads), LLAMA_FORK_OPTIONS
    return model, SAILOR_RUN_OPTIONS


def replicated_and_split(tps, values) -> tuple[float, float]:
    """Least-squares ``replicated + split / tp`` through ``values`` at ``tps``."""
    design = np.column_stack([np.ones(len(tps)), 1.0 / np.asarray(tps, dtype=np.float64)])
    (replicated, split), *_ = np.linalg.lstsq(design, np.asarray(values, dtype=np.float64), rcond=None)
    return float(replicated), float(split)


def compare(model_dir: str, by_tp: dict) -> dict:
    """One model's blocks: measured against counted at each TP degree, and the fitted parts."""
    model, options = asked(model_dir)
    seq = SAILOR_SEQ[model_dir]
    training = TrainingSpec(dtype="fp32", seq_len=seq, **options)
    cost = AnalyticalCostModel(model, bench_cluster(sailor_device("A100-40")), training)
    tps = sorted(int(tp) for tp in by_tp)
    counted = cost.layer_costs(np.zeros(len(tps), dtype=np.int64), np.asarray(tps, dtype=np.float64),
                               np.ones(len(tps)), np.full(len(tps), seq), np.full(len(tps), NONE)).activation_bytes
    measured = [float(by_tp[str(tp)][FIRST_BLOCK]["act_mem_bytes"]) for tp in tps]
    unit = seq * model.hidden_size * 4.0  # one fp32 s x b x h tensor at micro-batch 1
    return {"model": model.name, "asked_as": {**options, "num_kv_heads": model.num_kv_heads,
                                               "relu_mlp": model.relu_mlp},
            "seq_len": seq,
            "by_tp": [{"tp": tp, "measured_mb": round(m / 1e6, 1), "memx_mb": round(float(c) / 1e6, 1),
                       "memx_over_measured": round(float(c) / m, 3)} for tp, m, c in zip(tps, measured, counted)],
            "fp32_sbh_tensors": {
                "measured": dict(zip(("replicated", "split"),
                                     (round(v, 2) for v in replicated_and_split(tps, [m / unit for m in measured])))),
                "memx": dict(zip(("replicated", "split"),
                                 (round(v, 2) for v in replicated_and_split(tps, [c / unit for c in counted]))))}}


def measured_blocks(shared: str) -> dict:
    """Sailor's ``llm_info.json``: per model, TP degree and unit, what its blocks allocated."""
    with open(os.path.join(shared, "peer-data", "sailor", "llm_info.json")) as f:
        return json.load(f)


def main() -> None:
    start = time.time()
    info = measured_blocks(shared_dir())
    models = [compare(model_dir, info[model_dir]) for model_dir in SAILOR_MODELS]
    for m in models:
        print(f"{m['model']:14s}", " ".join(f"tp{r['tp']} {r['memx_over_measured']}" for r in m["by_tp"]),
              m["fp32_sbh_tensors"])
    write_json_atomic(OUT, {"machine": machine_info(), "what": __doc__.split("\n\n")[0], "models": models,
                            "seconds": round(time.time() - start, 2)}, overwrite=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
