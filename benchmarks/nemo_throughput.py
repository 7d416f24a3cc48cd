"""memx's iteration time against NVIDIA's published NeMo / Megatron-Bridge throughput on DGX-H100 and
on Blackwell (DGX-B200 and B300, GB200 and GB300 NVL72; uncalibrated, datasheet peaks): FP8 and FP4
training, interleaved pipelines, context parallelism, Megatron FSDP, activation offloading, full
fine-tuning and LoRA, mixtures of experts with expert parallelism, from 8 to 1,024 GPUs.

Tables (copied into benchmarks/data/nemo_performance.csv, sources in benchmarks/data/README.md):

- NeMo 24.07's performance summary (``nemo-24.07``): GPT-3 5B-175B, Llama 2 7B-70B, Nemotron 8B-340B
  and Llama 3 8B/70B pre-training, and Llama 2 SFT and LoRA fine-tuning (SQuAD packed to 4,096
  tokens), all FP8 on DGX-H100 (80 GB, NVLink 4, 8 x 400 Gb/s NICs per node).
- Megatron-Bridge's performance summary (``bridge-25.11``, ``bridge-26.02``): the dense DGX-H100
  rows (Llama 3 8B with Megatron FSDP, Llama 3 70B, Llama 3.1 405B on 1,024 GPUs), FP8 with
  current scaling ("FP8-CS"; 26.02's H100 rows say "FP8", the same recipe of its H100 configs);
  and the dense Blackwell rows: Llama 3 8B on 8 GPUs, Llama 3 70B on 64 (Megatron FSDP with 20
  or 40 layers' activations offloaded to the Grace CPU, or an interleaved pipeline) and Llama
  3.1 405B on 128-256, in FP8-CS, MXFP8 ("FP8-MX": ``--fp8 mxfp8``) and NVFP4 (``--fp4
  nvfp4``). The systems (``benchmarks/common.GPUS``): B200 in nodes of 8 over PCIe Gen5 to the
  host; GB200 and GB300 in NVLink domains of 64 (an NVL72 rack's 72, of which a job of 64-GPU
  multiples is taken to use 64) over NVLink-C2C to the host, GB300 with 800 Gb/s NICs; GB200 at
  its own best matmul (72.9% of its peak), the others at the generation's default. The 8B
  recipes capture the whole iteration in a CUDA graph, which memx does not model (its host time
  per layer for a fused block, 0.2 ms, is small beside these layers').
- Megatron-Bridge's Qwen3-30B-A3B and Qwen3-235B-A22B rows (mixtures of 128 experts, top-8, heads
  128 wide) on every system, FP8-CS, MXFP8 and BF16, with their expert-parallel degree (``ep``)
  and, where the recipe overlaps them, the all-to-alls behind another micro-batch's compute
  (``overlap_expert_comm``), and its token dispatcher (``dispatcher``: the all-to-all, or the flex
  dispatcher with HybridEP on 26.02's NVL72 systems). Their recipes also capture the router and
  the dispatch's preprocessing in CUDA graphs, which memx does not model. Megatron-Bridge counts their
  attention FLOPs causal (half), which ``flops_per_token`` follows for mixtures of experts.
- Megatron-Bridge 26.02's GPT-OSS-120B rows (BF16, 64 GPUs, EP 64; half its blocks attend within
  128 tokens), its activation unfused as its model provider sets it (``bias_activation_fusion=False``:
  the CSV's ``fused_activation``, ``--no-fused-activation``, megatron-core's eager path keeping more per
  routed copy).
- Apart (``dgxc``, from benchmarks/data/dgxc_performance.csv): NVIDIA's DGX Cloud Benchmarking
  recipes (NeMo 25.04, BF16 and FP8 with delayed scaling, micro-batch 1 at 8,192 tokens) for
  Llama 4 Maverick on 128-512 GB200s (TP 1, PP 2 x VP 12, EP 64: every other block runs the
  experts, the others a dense MLP, so each of the 24 chunks holds one of each) and on 512 H100s
  (TP 4 with sequence parallelism and TP overlap, EP 128, each expert over 4 ranks: ``etp``,
  ``--expert-tensor-parallel 4``), and for Grok-1 (314B, 8 experts of 32,768, top-2) on 128-512
  GB200s (TP 4, EP 8, ETP 4) and on 512 H100s (TP 4, PP 8 x VP 8, CP 2, EP 8). Where a run
  captures CUDA graphs (the GB200 Grok-1 runs, Maverick's H100 FP8 run) memx does not model them.
- Megatron-Bridge's DeepSeek-V3 rows of 25.11 and 26.02 (256 GPUs, EP 8-64, MXFP8 and BF16;
  latent attention, three dense first blocks, the multi-token prediction module where the row
  runs it), in the recipes' layout of 16 chunks where it has one, with selective recompute
  (Megatron's ``mla_up_proj``) and fp32 master weights beside bf16 moments.

Each row gives GPUs, global and micro-batch, sequence length and TP/PP/CP/VP: the layout is fully
given; the step time is global batch x sequence / (tokens per second per GPU x GPUs). How each
recipe runs, read from its public configuration (columns of the CSV, per row): Megatron-Core with
Transformer Engine (memx's ``--setup megatron``: distributed optimizer, overlapped gradient
reduce, fused SwiGLU), bf16 gradients (NeMo's ``grad_sync_dtype: bf16``, Megatron-Bridge's
``grad_reduce_in_fp32=False``), ``--fp8 delayed`` (NeMo 24.07's ``fp8_hybrid`` recipe),
``--fp8 current``, ``--fp8 mxfp8`` or ``--fp4 nvfp4``, FP8 weights where the recipe keeps them
(``fp8_params``, ``fp8_param_gather``: not with NVFP4), activation offloading where it offloads
(``cpu_offloading_num_layers``), 16-bit optimizer states where it says ``dtype: bf16``, the plain
(non-distributed) Adam of its LoRA scripts, sequence parallelism and TP communication overlap
where it turns them on, its activation recompute (none in the dense recipes; the MoE recipes'
selective modules, ``recompute_modules``), cuDNN fused attention (Transformer Engine's backend
on Hopper, timed as FlashAttention-3: written for Hopper), the fused
vocab-parallel cross entropy where it fuses it, LoRA of rank 32 (NeMo adapts the fused QKV
projection only, memx every linear: 1.9% of a frozen Llama 2 7B block's FLOPs against 0.4%). The layers of
an interleaved pipeline are split as Megatron splits them: evenly, or with the embedding and the
loss counted as a layer each where the recipe says so. The same rows without the recipes'
memory settings (fp32 gradients and optimizer states, 16-bit weights) are summarised too.

The published "Model TFLOP/s per GPU" column checks the transcribed model shapes: the table's
FLOPs per token (TFLOP/s over tokens/s) against 6 x the matmul parameters plus the full s x s
attention (the formula NeMo's tables count), per model.

Every published run ran: each row is also a fit check (memx should say it fits on its GPU).

Apart (``validated_recipes``, from benchmarks/data/megatron_bridge_validated.csv): the Megatron-Bridge
recipes whose docstrings publish a validation run's seconds per update and peak allocated memory
(Llama 3.1 405B, MXFP8, 64 GB200s): the step time, and the fullest stage's tensors (the estimate's
peak less communicator buffers and fixed overhead, which allocated memory does not hold).

Writes benchmarks/results/nemo_throughput.json and the plot nemo_throughput.png.
Run: .venv/bin/python benchmarks/nemo_throughput.py   (a few seconds)
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import dgx_cluster, grouped, no_nan, predicted, run_summary, step_time_by_group  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning import mamba  # noqa: E402
from memx_launch.planning.matmuls import linear_shapes  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.model import ModelSpec  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

DATA = os.path.join(ROOT, "benchmarks", "data", "nemo_performance.csv")
DGXC_DATA = os.path.join(ROOT, "benchmarks", "data", "dgxc_performance.csv")
VALIDATED_DATA = os.path.join(ROOT, "benchmarks", "data", "megatron_bridge_validated.csv")
OUT = os.path.join(ROOT, "benchmarks", "results", "nemo_throughput.json")
PLOT = os.path.join(ROOT, "benchmarks", "results", "nemo_throughput.png")

# The recipes' models that memx's catalog lacks (layers, hidden, heads, KV heads, FFN, vocabulary),
# from NeMo's model configurations. GPT-3: GELU MLP, LayerNorm and biases, learned positions, tied
# embeddings, GPT-2's vocabulary. Nemotron: squared-ReLU MLP (two matrices), LayerNorm, no biases,
# rotary positions, untied embeddings.
GPT3 = {"gpt3-5b": (24, 4096, 32, 16384), "gpt3-20b": (44, 6144, 48, 24576), "gpt3-175b": (96, 12288, 96, 49152)}
NEMOTRON = {"nemotron-8b": (32, 4096, 32, 32, 16384), "nemotron-22b": (40, 6144, 48, 48, 24576),
            "nemotron-340b": (96, 18432, 96, 8, 73728)}
# Grok-1 as NVIDIA's recipe runs it: 8 experts of 32,768 (gated), top-2, Llama 3's tokenizer as a proxy.
GROK1 = ModelSpec("grok-1-314b", 64, 6144, 48, 8, 32768, 128256, 8192, num_experts=8, experts_per_token=2)


# The tables' precisions: NeMo 24.07's FP8 hybrid (delayed scaling), Megatron-Bridge's FP8 with current
# scaling ("FP8-CS"), MXFP8 ("FP8-MX") and NVFP4.
PRECISIONS = {"bf16": {}, "fp8": {"fp8": "delayed"}, "fp8-cs": {"fp8": "current"}, "fp8-mx": {"fp8": "mxfp8"},
              "nvfp4": {"fp4": "nvfp4"}}
SYSTEMS = {"dgx-h100": "h100_80gb", "dgx-b200": "b200", "dgx-b300": "b300", "dgx-gb200": "gb200", "dgx-gb300": "gb300"}


def nemo_model(name: str, seq: int) -> ModelSpec:
    if name in GPT3:
        layers, hidden, heads, ffn = GPT3[name]
        return ModelSpec(name, layers, hidden, heads, heads, ffn, 50257, seq, gated_mlp=False, tie_embeddings=True,
                         layer_norm=True, linear_biases=True, position_embeddings=seq)
    if name in NEMOTRON:
        layers, hidden, heads, kv, ffn = NEMOTRON[name]
        return ModelSpec(name, layers, hidden, heads, kv, ffn, 256000, seq, gated_mlp=False, layer_norm=True)
    if name == "deepseek-v3-no-mtp":  # the rows Megatron-Bridge ran without multi-token prediction
        return dataclasses.replace(get_model("deepseek-v3"), name=name, mtp_layers=0, seq_len=seq)
    base = {GROK1.name: GROK1}.get(name) or get_model(name)
    return dataclasses.replace(base, seq_len=seq)


def flops_per_token(model: ModelSpec, seq: int) -> float:
    """Training FLOPs per token as NeMo's tables count them: 6 x the matmul parameters a token
    runs through (blocks, a mixture's top-k experts or its dense first blocks' MLP, each
    multi-token prediction module's block, projection and output layer, the output layer) plus
    the whole s x s attention (QK^T at the queries' width and AV at the values', forward and
    backward); Megatron-Bridge counts its mixtures of experts' attention causal, half of it. A hybrid
    model's layers (Nemotron-H, as its recipe's notes count them): each kind's linears and whole
    attention, and the Mamba layers' chunked scans (forward and backward: 3 x its forward FLOPs)."""
    if model.hybrid_pattern:
        return float(sum(count * (6.0 * sum(n * k for n, k in linear_shapes(kind, TrainingSpec(), 1))
                                  + 6.0 * seq * (kind.q_hidden_size + kind.value_hidden_size)
                                  + 3.0 * float(mamba.scan_flops(kind, 1, 1)))
                         for kind, count in model.layer_kinds) + 6.0 * model.head_params)
    blocks = model.num_layers + model.mtp_layers
    attention = (3.0 if model.num_experts else 6.0) * blocks * seq * (model.q_hidden_size + model.value_hidden_size)
    dense = model.dense_block_count * (model.dense_block.mlp_params - model.active_mlp_params)
    matmuls = (blocks * (model.attention_params + model.active_mlp_params) + dense
               + model.mtp_layers * 2 * model.hidden_size ** 2 + (1 + model.mtp_layers) * model.head_params)
    return 6.0 * matmuls + attention


# Megatron-Bridge's DeepSeek-V3 layout for 16 chunks (PP 16, PP 4 x VP 4, PP 2 x VP 8): Et*4|(t*4|)*14tmL.
DEEPSEEK_V3_CHUNKS = [4] * 15 + [1]


def stage_layers(model: ModelSpec, pp: int, vp: int, with_ends: bool) -> list[int] | None:
    """Megatron's split over ``pp`` stages of ``vp`` chunks: even (None), or with the embedding and
    the loss counted as a layer each (``account_for_embedding/loss_in_pipeline_split``): the
    first and last chunks hold one layer less; DeepSeek-V3's layout of 16 chunks where it has one."""
    if model.name.startswith("deepseek-v3") and pp * vp == len(DEEPSEEK_V3_CHUNKS):
        return [sum(DEEPSEEK_V3_CHUNKS[s::pp]) for s in range(pp)]
    if not with_ends:
        return None
    per_chunk = (model.num_layers + 2) // (pp * vp)
    layers = [per_chunk * vp] * pp
    layers[0] -= 1
    layers[-1] -= 1
    return layers


def nemo_rows(recipe_memory: bool = True, path: str = DATA, predict=predicted) -> list[dict]:
    """Every row of ``path`` with memx's estimate; ``recipe_memory=False`` asks without the recipes'
    memory settings (16-bit gradients, FP8 weights, 16-bit optimizer states, offloaded
    activations): what they are worth. ``predict(row, model, cluster, training, **layout)``:
    :func:`~benchmarks.common.predicted`, memx's estimate."""
    rows = []
    with open(path) as f:
        for d in csv.DictReader(f):
            gpus, seq, batch, mbs = (int(d[k]) for k in ("gpus", "seq_len", "global_batch_size", "micro_batch_size"))
            tp, pp, cp, vp = (int(d[k]) for k in ("tp", "pp", "cp", "vp"))
            model = nemo_model(d["model"], seq)
            dp = gpus // (tp * pp * cp)
            flag = {k: d[k] == "True" for k in ("sequence_parallel", "tp_comm_overlap", "fused_loss", "fused_activation",
                                                 "fp8_params", "distributed_optimizer", "overlap_expert_comm")}
            memory = dict(grad_dtype="training", optimizer_dtype=d["optimizer_dtype"],
                          activation_offload_layers=int(d["activation_offload_layers"])) if recipe_memory \
                else dict(grad_dtype="fp32", optimizer_dtype="fp32", fp8_params=False)
            training = TrainingSpec(global_batch_size=batch, seq_len=seq, setup="megatron",
                                    fully_sharded=d["fsdp"] == "1", flash_attention_version=3,
                                    **PRECISIONS[d["precision"]], lora_rank=int(d["lora_rank"]),
                                    expert_parallel=int(d["ep"]), expert_tensor_parallel=int(d.get("etp") or 1),
                                    expert_dispatcher=d["dispatcher"],
                                    recompute_modules=tuple(d["recompute_modules"].split()) or None,
                                    **{**flag, **memory})
            gpu = SYSTEMS[d["system"]]
            tokens = batch * seq
            row = {"group": d["table"], "system": d["system"], "precision": d["precision"], "real": "ok",
                   "kind": "moe" if model.num_experts else "dense",
                   "model": d["model"], "task": d["task"], "gpus": gpus,
                   "seq_len": seq, "tokens": tokens, "tp_overlap": tp_overlap_group(tp, flag["tp_comm_overlap"]),
                   "real_time_s": tokens / (float(d["tokens_per_s_per_gpu"]) * gpus),
                   "table_flops_per_token": float(d["model_tflops_per_gpu"]) * 1e12 / float(d["tokens_per_s_per_gpu"]),
                   "shape_flops_per_token": flops_per_token(model, seq),
                   "layout": f"{d['model']} {d['task']} {gpus}x{gpu.split('_')[0]} tp{tp} pp{pp} cp{cp} vp{vp} dp{dp}"
                             + f" ep{d['ep']}" * (d["ep"] != "1") + f" etp{d.get('etp')}" * (d.get("etp", "1") != "1")
                             + f" mbs{mbs} {d['precision']} {d['recompute']}" + " fsdp" * (d["fsdp"] == "1")
                             + f" offload{d['activation_offload_layers']}" * (d["activation_offload_layers"] != "0")}
            rows.append(predict(row, model, dgx_cluster(gpu, gpus), training, tp=tp, pp=pp, dp=dp, cp=cp,
                                micro_batch_size=mbs, recompute=d["recompute"],
                                schedule="interleaved" if vp > 1 else "1f1b", virtual_stages=vp,
                                layers_per_stage=stage_layers(model, pp, vp, d["embedding_in_split"] == "True")))
    return rows


def tp_overlap_group(tp: int, overlapped: bool) -> str:
    """A row's TP communication: none (TP 1), overlapped behind its GEMMs (Transformer Engine's
    userbuffers, ``tp_comm_overlap``) or not."""
    return "tp1" if tp == 1 else "overlapped" if overlapped else "not overlapped"


def validated_recipes(path: str = VALIDATED_DATA) -> list[dict]:
    """The Megatron-Bridge recipes whose docstrings publish a validation run's seconds per update and
    peak allocated memory: memx's step time and its fullest stage's tensors against them. Allocated
    memory (torch's ``max_memory_allocated``) holds the tensors only: the estimate's peak less its
    communicator buffers and fixed overhead (the process's context and the allocator's reserve)."""
    rows = nemo_rows(path=path, predict=lambda row, *args, **layout: predicted(row, *args, parts=True, **layout))
    with open(path) as f:
        allocated = [float(d["peak_allocated_gib"]) for d in csv.DictReader(f)]
    out = []
    for row, measured in zip(rows, allocated):
        parts = row["parts_gib"]
        tensors = row["peak_gib"] - parts["communicator_buffers"] - parts["fixed_overhead"]
        out.append({**row, "real_peak_allocated_gib": measured, "predicted_tensors_gib": round(tensors, 2),
                    "predicted_over_measured_time": round(row["time_s"] / row["real_time_s"], 3),
                    "predicted_over_measured_allocated": round(tensors / measured, 3)})
    return out


def shape_check(rows: list[dict]) -> dict:
    """Per model: the table's FLOPs per token over the transcribed shape's, its first row's (1.0:
    the shape and the table's count agree)."""
    return {name: round(members[0]["table_flops_per_token"] / members[0]["shape_flops_per_token"], 3)
            for name, members in grouped(rows, lambda r: r["model"]).items()}


def rows_off_shape(rows: list[dict]) -> dict:
    """The rows whose published TFLOP/s and tokens/s disagree with the shape by more than 5%
    (``group system layout``: the ratio): a table's two columns disagreeing with each other, or a
    transcription slip."""
    ratios = {f"{r['group']} {r['layout']}": r["table_flops_per_token"] / r["shape_flops_per_token"] for r in rows}
    return {key: round(ratio, 3) for key, ratio in ratios.items() if not 0.95 <= ratio <= 1.05}


def fp8_pairs(rows: list[dict]) -> list[dict]:
    """The runs a table gives in BF16 and in an FP8 recipe with one layout: FP8's measured speedup
    (the BF16 run's step time over the FP8 one's) against memx's."""
    pairs = []
    for (group, layout), members in grouped(rows, lambda r: (r["group"], r["layout"].replace(
            f" {r['precision']} ", " "))).items():
        bf16 = [r for r in members if r["precision"] == "bf16" and "time_s" in r]
        pairs += [{"group": group, "layout": layout, "precision": r["precision"],
                   "measured_speedup": round(bf16[0]["real_time_s"] / r["real_time_s"], 3),
                   "predicted_speedup": round(bf16[0]["time_s"] / r["time_s"], 3)}
                  for r in members if bf16 and r["precision"].startswith("fp8") and "time_s" in r]
    return pairs


def plot(rows: list[dict], dgxc: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memx_launch.planning.report import save_png_atomic

    dense = [r for r in rows if r["kind"] == "dense"]
    fig, (hopper, blackwell, moe, recipes) = plt.subplots(1, 4, figsize=(25, 6))
    step_time_by_group(hopper, [r for r in dense if r["system"] == "dgx-h100"], "NeMo / Megatron-Bridge on DGX-H100",
                       plt.cm.tab10.colors, size=18, label=lambda r: f"{r['model']} {r['task']}")
    step_time_by_group(blackwell, [{**r, "group": r["system"]} for r in dense if r["system"] != "dgx-h100"],
                       "Megatron-Bridge on Blackwell", plt.cm.tab10.colors, size=18,
                       label=lambda r: f"{r['model']} {r['precision']}")
    step_time_by_group(moe, [{**r, "group": r["system"]} for r in rows if r["kind"] == "moe"],
                       "Megatron-Bridge, mixtures of experts", plt.cm.tab10.colors, size=18,
                       label=lambda r: f"{r['model']} mbs{r['layout'].split(' mbs')[1].split()[0]}")
    step_time_by_group(recipes, [{**r, "group": f"{r['model']} {r['system']}"} for r in dgxc],
                       "DGX Cloud recipes: mixtures of experts, Nemotron-H", plt.cm.tab10.colors, size=18,
                       label=lambda r: f"{r['gpus']} {r['precision']}")
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=100)


def main() -> None:
    started = time.perf_counter()
    rows, without = nemo_rows(), nemo_rows(recipe_memory=False)
    dense = [r for r in rows if r["kind"] == "dense"]  # by system and precision: the mixtures apart
    result = {"machine": machine_info(), "cost_model": "analytical, datasheet peaks, default efficiency",
              **run_summary(rows),
              "by_table": {name: run_summary(members) for name, members in grouped(rows, lambda r: r["group"]).items()},
              "by_task": {name: run_summary(members) for name, members in grouped(rows, lambda r: r["task"]).items()},
              "by_system": {name: run_summary(members) for name, members in grouped(dense, lambda r: r["system"]).items()},
              "moe_by_system": {name: run_summary(members) for name, members in grouped(
                  [r for r in rows if r["kind"] == "moe"], lambda r: r["system"]).items()},
              "moe_by_model": {name: run_summary(members) for name, members in grouped(
                  [r for r in rows if r["kind"] == "moe"], lambda r: r["model"].removesuffix("-no-mtp")).items()},
              "by_kind": {name: run_summary(members) for name, members in grouped(rows, lambda r: r["kind"]).items()},
              "dense_h100": run_summary([r for r in rows if r["system"] == "dgx-h100" and r["kind"] == "dense"]),
              "dense_blackwell": run_summary([r for r in rows if r["system"] != "dgx-h100" and r["kind"] == "dense"]),
              "by_precision": {name: run_summary(members)
                               for name, members in grouped(dense, lambda r: r["precision"]).items()},
              "dense_by_tp_overlap": {name: run_summary(members)
                                      for name, members in grouped(dense, lambda r: r["tp_overlap"]).items()},
              "table_over_shape_flops": shape_check(rows),
              "table_flops_off_shape": rows_off_shape(rows),
              "without_recipe_memory_settings": run_summary(without),
              "without_recipe_memory_settings_dense_h100": run_summary(
                  [r for r in without if r["system"] == "dgx-h100" and r["kind"] == "dense"]), "rows": rows}
    dgxc = nemo_rows(path=DGXC_DATA)
    result["dgxc"] = {**run_summary(dgxc), **{f"by_{key}": {
        name: run_summary(members) for name, members in grouped(dgxc, lambda r: r[key]).items()}
        for key in ("model", "precision", "system")}, "table_over_shape_flops": shape_check(dgxc), "rows": dgxc}
    result["fp8_over_bf16"] = fp8_pairs(rows + dgxc)
    result["validated_recipes"] = validated_recipes()
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json_atomic(OUT, no_nan(result), overwrite=True)
    plot(rows, dgxc, PLOT)
    print("all", result["time"], result["fit"]["confusion"], "errors", result["errors"])
    print("dense H100", result["dense_h100"]["time"], "dense Blackwell", result["dense_blackwell"]["time"])
    for part in ("by_table", "by_task", "by_system", "by_precision", "by_kind", "moe_by_system", "moe_by_model"):
        for name, summary in result[part].items():
            print(" ", name, summary["time"], summary["fit"]["confusion"]["real_ok_pred_oom"], "called OOM")
    print("  table / shape FLOPs per token", result["table_over_shape_flops"])
    print("  without the recipes' memory settings", result["without_recipe_memory_settings"]["fit"]["confusion"])
    apart = result["dgxc"]
    print("DGX Cloud recipes", apart["time"], apart["fit"]["confusion"], apart["table_over_shape_flops"],
          *({name: s["time"]["time_mape_pct"] for name, s in apart[f"by_{key}"].items()}
            for key in ("model", "precision", "system")))
    for pair in result["fp8_over_bf16"]:
        print("FP8 over BF16", pair["layout"], pair["precision"], "measured", pair["measured_speedup"], "predicted",
              pair["predicted_speedup"])
    for r in result["validated_recipes"]:
        print("validated recipe", r["layout"], "time", r["predicted_over_measured_time"], "allocated",
              r["predicted_tensors_gib"], "GiB predicted,", r["real_peak_allocated_gib"], "measured")
    for r in rows + dgxc:
        print(f"  {r['layout']:75s} {r['real_time_s']:7.2f} s", f"{r['time_s']:7.2f} s" if "time_s" in r else r["error"],
              f"{r.get('peak_gib', '')} GiB")
    print(f"{result['seconds']} s")


if __name__ == "__main__":
    main()
