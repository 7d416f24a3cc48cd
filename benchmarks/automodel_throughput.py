"""memx's iteration time against NVIDIA NeMo AutoModel's published pre-training throughput: mixtures
of experts trained with PyTorch's FSDP2 and expert parallelism on DGX-H100 (uncalibrated, datasheet
peaks), the PyTorch-native stack beside the Megatron-Core rows of ``nemo_throughput.py``.

Table (copied into benchmarks/data/automodel_performance.csv, source in benchmarks/data/README.md):
NeMo AutoModel's ``docs/performance-summary.md`` (github.com/NVIDIA-NeMo/Automodel, "Last Updated
2025-10-02"), "System: DGX-H100, Precision: BF16": DeepSeek-V3 on 256 and 1,024 GPUs, Kimi K2 on
256, Qwen3-30B-A3B and GPT-OSS-20B on 8, GPT-OSS-120B on 64. Each row gives GPUs, global, local
and micro-batch, sequence length and TP/PP/CP/EP/VP/FSDP degrees; the step time is the table's.

How the rows run, read from their configurations (``examples/benchmark/configs/*_te_deepep*.yaml``):
FSDP2 over every rank of a pipeline stage (``dp_shard``: the stage's ranks), each expert on one
rank of an EP group and sharded over the stage's ranks beyond it (the expert data parallel group:
one rank, so never gathered, but for DeepSeek-V3 on 1,024 GPUs: four), gradients reduced in fp32
(FSDP2's ``MixedPrecisionPolicy`` of the recipe, memx's ``--setup fsdp2``), the model in bf16
throughout: its experts are built in bf16 (``MoEConfig.dtype``) and ``initialize_weights`` casts
the rest, so FSDP2 shards bf16 weights, keeps bf16 gradient shards, and the recipe's
``torch.optim.Adam`` updates them in place with bf16 moments, no fp32 master copy
(``--optimizer-dtype bf16-no-master --grad-dtype bf16``, the reduction in fp32: ``--fp32-allreduce``,
in which a held stage's unsharded gradients accumulate), Transformer Engine linears and attention (cuDNN's
fused attention on Hopper, timed as FlashAttention-3; GPT-OSS: PyTorch's FlexAttention, a Triton
kernel its authors hold against FlashAttention-2, timed as that), DeepEP's dispatcher (memx's
``--expert-dispatcher flex``), balanced routing forced by ``fake_balanced_gate``, which sends
token t to experts t*k to t*k + k - 1 (``--expert-routing consecutive``: its k experts on one or
two ranks of one node, where random top-k routing reaches 3.4-7.4), the cross entropy on the
bf16 logits (``fp32_upcast: false``: ``--loss-dtype bf16``), the routing weights applied inside
the experts' activation, a custom autograd function keeping its input and the weights only
(``WeightedSwiGLUFunction``; GPT-OSS's clamped variant taken as the same: ``--fused-activation``,
which the dense MLPs, eager there, do not have), full activation checkpointing
where ``activation_checkpointing: true`` (DeepSeek-V3, Kimi K2, Qwen3) and none for GPT-OSS;
pipelines with torch's interleaved 1F1B over ``vp`` chunks per stage, the layers split as evenly
as they go. Each block keeps its gathered weights from the forward to the backward
(``reshard_after_forward: false``; ``--hold-gathered weights``) and reduce-scatters its gradients
every micro-batch: AutoModel's patch of the stage's backward (``fsdp_mixin.py``, the outer model
not wrapped) defers the gradient sync of the experts, embedding and head only, not of the blocks
as torch's own pipelining would (``--hold-gathered pipelined``: ``pipelined_rows_held_through_step``,
an upper bound for the pipelined rows, whose deferred experts, embedding and head memx does not
hold otherwise). AutoModel's DeepSeek-V3 has no multi-token prediction module (the table's FLOPs per
token are the model's without it). The table's layouts are used where a configuration stored
today differs (DeepSeek-V3 on 1,024 GPUs: 4 layers per chunk there, VP 8 in the table).

Writes benchmarks/results/automodel_throughput.json.
Run: .venv/bin/python benchmarks/automodel_throughput.py   (a few seconds)
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import dgx_cluster, no_nan, predicted, run_summary  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning import experts  # noqa: E402
from memx_launch.planning.model_states import expert_data_parallel  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

DATA = os.path.join(ROOT, "benchmarks", "data", "automodel_performance.csv")
OUT = os.path.join(ROOT, "benchmarks", "results", "automodel_throughput.json")


def even_split(layers: int, pp: int) -> list[int]:
    """``layers`` over ``pp`` stages, the first stages one more where they do not divide."""
    return [layers // pp + (s < layers % pp) for s in range(pp)]


def automodel_rows(path: str = DATA, routing: str = "consecutive", hold: str = "weights") -> list[dict]:
    """Every row of ``path`` with memx's estimate of it, its tokens routed as ``routing`` says
    (``consecutive``: as the runs routed them), what it gathers held as ``hold`` says (``weights``:
    as the runs hold their blocks' weights)."""
    rows = []
    with open(path) as f:
        for d in csv.DictReader(f):
            gpus, seq, batch, mbs = (int(d[k]) for k in ("gpus", "seq_len", "global_batch_size", "micro_batch_size"))
            tp, pp, cp, ep, vp = (int(d[k]) for k in ("tp", "pp", "cp", "ep", "vp"))
            # AutoModel's DeepSeek-V3 builds no multi-token prediction module (the table's FLOPs per token
            # are the model's without it).
            model = dataclasses.replace(get_model(d["model"]), seq_len=seq, mtp_layers=0)
            dp = gpus // (tp * pp * cp)
            training = TrainingSpec(global_batch_size=batch, seq_len=seq, setup="fsdp2", optimizer_dtype="bf16-no-master",
                                    grad_dtype="bf16", fp32_allreduce=True, expert_parallel=ep,
                                    expert_dispatcher="flex", expert_routing=routing, loss_dtype="training",
                                    fused_activation=True, flash_attention_version=2 if d["attention"] == "flex" else 3,
                                    hold_gathered=hold)
            recompute = "full" if d["activation_checkpointing"] == "True" else "none"
            row = {"group": d["table"], "model": d["model"], "gpus": gpus, "seq_len": seq, "real": "ok",
                   "tokens": batch * seq, "real_time_s": float(d["step_time_s"]),
                   "table_flops_per_token": float(d["model_tflops_per_gpu"]) * 1e12 / float(d["tokens_per_s_per_gpu"]),
                   "expert_data_parallel": int(expert_data_parallel(training, tp, dp * cp)),
                   # EP ranks (and nodes of 8) a token's experts sit on: as the run routed, at random.
                   **{f"{units}_per_token": {r: round(n * experts.hit_share(model, dataclasses.replace(
                       training, expert_routing=r), n), 2) for r in ("consecutive", "random")}
                      for units, n in (("ranks", ep), ("nodes", max(ep // 8, 1)))},
                   "layout": f"{d['model']} {gpus}x{d['gpu'].split('_')[0]} tp{tp} pp{pp} cp{cp} vp{vp} fsdp{dp}"
                             f" ep{ep} mbs{mbs} {recompute}"}
            rows.append(predicted(row, model, dgx_cluster(d["gpu"], gpus), training, parts=True, tp=tp, pp=pp,
                                  dp=dp, cp=cp, micro_batch_size=mbs, recompute=recompute,
                                  schedule="interleaved" if vp > 1 else "1f1b", virtual_stages=vp,
                                  layers_per_stage=even_split(model.num_layers, pp) if pp > 1 else None))
    return rows


def main() -> None:
    started = time.perf_counter()
    rows, random = automodel_rows(), automodel_rows(routing="random")
    result = {"machine": machine_info(), "cost_model": "analytical, datasheet peaks, default efficiency",
              "automodel_dgx_h100_bf16": {**run_summary(rows), "rows": rows},
              # The same rows asked with memx's default routing (random top-k), not how they ran.
              "with_random_routing": {**run_summary(random), "predicted_over_measured": [
                  round(r["time_s"] / r["real_time_s"], 3) for r in random]},
              # The pipelined rows holding every unsharded gradient through the step too, as torch's own
              # pipelining would: AutoModel's (fsdp_mixin.py) holds its experts', embedding's and head's only.
              "pipelined_rows_held_through_step": {
                  r["layout"]: {k: r[k] for k in ("fits", "peak_gib", "time_s")}
                  for r in automodel_rows(hold="pipelined") if " pp1 " not in r["layout"]},
              "seconds": round(time.perf_counter() - started, 1)}
    write_json_atomic(OUT, no_nan(result), overwrite=True)
    print("automodel", {k: v for k, v in result["automodel_dgx_h100_bf16"].items() if k != "rows"})
    for r in rows:
        ratio = f"{r['time_s'] / r['real_time_s']:.2f}" if "time_s" in r else r.get("error")
        print(f"  {r['layout']}: {ratio}")


if __name__ == "__main__":
    main()
