"""memx's iteration time against published throughput tables (uncalibrated, datasheet peaks).

Tables (copied into benchmarks/data/, sources in benchmarks/data/README.md):

- Narayanan et al. 2021, Table 1 (narayanan2021_table1.csv): GPT models of 1.7B to 1T parameters
  trained with Megatron-LM on up to 3,072 A100-80GB (Selene: DGX A100 nodes, NVSwitch, 8 HDR
  200 Gb/s NICs per node), sequence 2,048, vocabulary 51,200. The table gives TP, PP, GPUs and
  the global batch, and the achieved TFLOP/s per GPU counted with the paper's Eq. 3 (which
  includes the recomputed forward). The step time follows: Eq. 3's FLOPs / (GPUs x TFLOP/s).
  Their setup, through memx's options: fp16 with fp32 main gradients and no distributed
  optimizer (it came later), full activation recomputation (Eq. 3 counts it), no flash
  attention and no sequence parallelism (both later), Megatron's fused softmax and LayerNorm,
  hidden and attention dropout on (GPT's 0.1), blocking pipeline sends (the 2021 interleaved
  schedule waited on each; the overlapped sends came in 2023). The table leaves out the micro-batch size and the
  schedule, which the authors tuned per row; memx is asked for every micro-batch size (1, 2, 4,
  8) and schedule (1F1B, interleaved with each v that divides the layers per stage) at the
  table's TP/PP/DP, and its fastest layout that fits is compared, as a user would plan it.
- MosaicML's MPT throughput tables (mpt_llm_foundry.csv): MPT-125M to 70B trained with Composer
  and PyTorch FSDP (FULL_SHARD, no TP or PP) on H100-80GB, A100-80GB and A100-40GB nodes of 8,
  sequences of 512 to 65,536 tokens. Each row gives the micro-batch size, gradient accumulation,
  GPUs, global batch and tokens per second: the step time is global tokens / tokens per second,
  the layout is fully given. Their setup, read from llm-foundry's yamls and
  ``submit_benchmarks.py``: bf16, GELU MLP 4x, tied embeddings, vocabulary 50,368, no dropout,
  a one-kernel LayerNorm, flash-attn's fused cross entropy (``loss_fn: fused_crossentropy``, MPT's
  default: ``--fused-loss``), flash attention in Triton (``attn_impl: triton``, counted as
  FlashAttention 1: its forward is as fast as FA1's CUDA kernel and its backward slower),
  activation checkpointing of every block when the row says so. FSDP mixed precision ``PURE``
  (bf16 weights gathered, bf16 gradients reduced) is memx's ``--setup zero3`` with torch FSDP's
  units (``--max-live-params 0``: one all-gather per block) and MPT's fused ``Wqkv``; ``DEFAULT``
  (fp32 weights gathered, bf16 gradients) is ``--setup fsdp2``, which gathers in bf16 and
  reduces in fp32: the same bytes on the wire within 20%, overlapped with compute either way.
  Inter-node links: 1,600 Gb/s per A100 node (the table's heading: 25 GB/s per GPU); the H100
  nodes' network is not stated, 3,200 Gb/s per node assumed (DGX H100's 8 x 400 Gb/s).

- The same README's H100 FP8 table (mpt_llm_foundry_fp8.csv): Composer's ``amp_fp8``, Transformer
  Engine's linears with delayed scaling, asked with ``--fp8 delayed``. Five of its layouts ran in
  BF16 too: the BF16 / FP8 step-time ratio, measured and predicted, is compared per pair.
- torchtitan's performance tables (torchtitan_performance.csv): Llama 3 / 3.1 and Llama 2 with
  FSDP2 on 64 A100-80GB, 8-512 H100-96GB (the H100 rows of its December 2024 benchmark: FSDP on 8
  and 128 GPUs, FSDP + CP, FSDP + TP 8 with and without AsyncTP, FSDP + TP 8 + PP 8 with 1F1B and
  interleaved 1F1B, and with CP) and 32-64 H200 (Trainy's June 2025 runs: FSDP with compile,
  Float8 and its FP8 all-gather, asked with ``--fp8-params``; that torchtitan compiles the loss
  with the blocks, asked as a fused loss, ``--fused-loss``), no gradient accumulation outside a
  pipeline (the micro-batch is the local batch, the global batch local x FSDP ranks). Every row is
  asked with ``--setup torchtitan``: FSDP2's mixed precision, TP's sequence-parallel norms whose
  gathered output the linears keep, the loss on the vocabulary shards with torch's loss parallel
  under TP, op-level selective checkpointing (``--selective-recompute op``) and torchao's Float8
  linears, which cast the weight at each GEMM (``--no-fp8-weight-cache``); Float8 is
  ``--fp8 current`` (tensorwise dynamic scaling), selective layer checkpointing (every other block) is
  ``full:every2``, context parallelism is ``--cp``, AsyncTP is ``--async-tp``.
  Its pipelines split the layers as torchtitan's ``generate_split_points`` does without given
  split points (two stages a rank for the interleaved schedule) and run as many micro-batches as
  pipeline ranks. memx has no torch.compile: a compiled row is asked with a fused norm only, so
  its other fusions count as unfused. Ratios of two rows of one table (the policy, Float8,
  AsyncTP, the schedule, CP's time per token) are compared measured against predicted, as the FP8
  pairs. The H100 hosts ran at "the default 500W power limit" of their 700 W boards (the tables'
  text; ``benchmarks/common.py``); their rows are also predicted at the rated power
  (``h100_at_rated_power``), what counting the limit changed.
  Memory: the H100 and H200 tables give the memory torchtitan logs, the caching allocator's peak
  reserve (its ``DeviceMemoryMonitor``: ``reserved_bytes.all.peak``, without NCCL's buffers and
  the CUDA context; the largest over the ranks); ``reserved_memory`` holds memx's peak less the
  communicators' buffers and the context (``CONTEXT_GIB``) against it, and
  ``reserved_memory_as_megatron`` the same with the loss and the FP8 weights counted as Megatron
  and Transformer Engine keep them.

Every published run ran, so every row is also a fit check: memx should say each layout fits.

Writes benchmarks/results/published_throughput.json and the plot published_throughput.png.
Run: .venv/bin/python benchmarks/published_throughput.py   (a few seconds)
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.common import (dgx_cluster, grouped, identity_axes, mape, no_nan, predicted, run_summary,  # noqa: E402
                               step_time_by_group, time_mape)
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.specs.cluster import CONTEXT_GIB  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.model import ModelSpec  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

DATA = os.path.join(ROOT, "benchmarks", "data")
OUT = os.path.join(ROOT, "benchmarks", "results", "published_throughput.json")
PLOT = os.path.join(ROOT, "benchmarks", "results", "published_throughput.png")

# --------------------------------------------------------------------------- Narayanan et al. 2021


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with full recomputation, the paper's Eq. 3."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def narayanan_layouts(layers: int, pp: int):
    """(micro-batch size, schedule, v) the table's authors could have run."""
    per_stage = layers // pp if layers % pp == 0 else 0
    for mbs in (1, 2, 4, 8):
        yield mbs, "1f1b", 1
        if pp > 1:
            for v in range(2, per_stage + 1):
                if per_stage % v == 0:
                    yield mbs, "interleaved", v


def narayanan() -> list[dict]:
    seq, vocab = 2048, 51200
    rows = []
    with open(os.path.join(DATA, "narayanan2021_table1.csv")) as f:
        for d in csv.DictReader(f):
            heads, hidden, layers = int(d["attention_heads"]), int(d["hidden_size"]), int(d["layers"])
            tp, pp, gpus, batch = int(d["tp"]), int(d["pp"]), int(d["gpus"]), int(d["batch_size"])
            real = narayanan_flops(batch, seq, layers, hidden, vocab) / (gpus * float(d["achieved_tflops_per_gpu"]) * 1e12)
            model = ModelSpec(f"gpt-{d['parameters_billion']}b", layers, hidden, heads, heads, 4 * hidden, vocab, seq,
                              gated_mlp=False, tie_embeddings=True)
            training = TrainingSpec(global_batch_size=batch, seq_len=seq, dtype="fp16", flash_attention=False,
                                    dropout=True, attention_dropout=True, overlap_p2p_comm=False)
            cluster = dgx_cluster("a100_80gb", gpus)
            base = {"group": "narayanan2021", "real": "ok", "real_time_s": real,
                    "model": model.name, "published_tflops_per_gpu": float(d["achieved_tflops_per_gpu"])}
            options = [predicted({**base, "layout": f"tp{tp} pp{pp} dp{gpus // (tp * pp)} mbs{mbs} {schedule}"
                                  + (f" v{v}" if v > 1 else "")}, model, cluster, training, tp=tp, pp=pp,
                                 dp=gpus // (tp * pp), micro_batch_size=mbs, recompute="full",
                                 schedule=schedule, virtual_stages=v)
                       for mbs, schedule, v in narayanan_layouts(layers, pp)]
            runnable = [o for o in options if "time_s" in o]
            fitting = [o for o in runnable if o["fits"]]
            pick = min(fitting or runnable, key=lambda o: o["time_s"])
            times = [o["time_s"] for o in runnable]
            rows.append({**pick, "layouts_asked": len(options),
                         "predicted_range_s": [round(min(times), 3), round(max(times), 3)]})
    return rows


# --------------------------------------------------------------------------- MosaicML MPT (llm-foundry)


# MPT shapes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): layers, d_model, heads.
MPT_SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
              "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56),
              "70b": (80, 8192, 64)}
# FSDP's PURE is ZeRO-3's state with torch's FSDP units: one all-gather per block, MPT's fused Wqkv
# and its one-kernel LayerNorm, llm-foundry's own blocks (not Transformers').
MPT_SETUP = {"PURE": dict(setup="zero3", max_live_params=0.0, fused_qkv=True, fused_norm=True,
                          transformers_blocks=False),
             "DEFAULT": dict(setup="fsdp2")}


def mpt(fused_loss: bool = True, table: str = "mpt_llm_foundry.csv") -> list[dict]:
    """The MPT rows of ``table``; ``fused_loss=False`` asks with torch's cross entropy instead of
    MPT's fused one. ``amp_fp8`` rows (Composer's Transformer Engine autocast, delayed scaling)
    are asked with ``--fp8 delayed``."""
    rows = []
    with open(os.path.join(DATA, table)) as f:
        for d in csv.DictReader(f):
            layers, hidden, heads = MPT_SHAPES[d["model"]]
            seq, gpus, mbs = int(d["seq_len"]), int(d["gpus"]), int(d["micro_batch_size"])
            batch = int(d["global_batch_size"])
            model = ModelSpec(f"mpt-{d['model']}", layers, hidden, heads, heads, 4 * hidden, 50368, seq,
                              gated_mlp=False, tie_embeddings=True)
            training = TrainingSpec(global_batch_size=batch, seq_len=seq, dtype="bf16",
                                    **MPT_SETUP[d["fsdp_mixed_precision"]], flash_attention=True,
                                    flash_attention_version=1, dropout=False, fused_loss=fused_loss,
                                    fp8="delayed" if d["precision"] == "amp_fp8" else None)
            recompute = "full" if d["activation_checkpointing"] == "True" else "none"
            row = {"group": d["gpu"], "real": "ok", "real_time_s": batch * seq / float(d["tokens_per_s"]),
                   "model": model.name, "seq_len": seq, "gpus": gpus, "tokens": batch * seq, "recompute": recompute,
                   "layout": f"{d['model']} s{seq} {gpus}x{d['gpu']} mbs{mbs} x{d['grad_accum']} {recompute}"
                             f" {d['fsdp_mixed_precision']}"}
            rows.append(predicted(row, model, dgx_cluster(d["gpu"], gpus), training, tp=1, pp=1, dp=gpus,
                                  micro_batch_size=mbs, recompute=recompute))
    return rows


def fp8_speedups(bf16_rows: list[dict], fp8_rows: list[dict]) -> dict:
    """Measured and predicted step-time ratio BF16 / FP8 for each FP8 row whose layout the BF16
    table ran too (same model, sequence, GPUs, micro-batch, accumulation and checkpointing): a
    ratio measured in one table, which the H100's common under-prediction cancels out of."""
    bf16 = {r["layout"]: r for r in bf16_rows if "time_s" in r}
    pairs = []
    for r in fp8_rows:
        twin = bf16.get(r["layout"])
        if twin is None or "time_s" not in r:
            continue
        pairs.append({"layout": r["layout"], "measured": round(twin["real_time_s"] / r["real_time_s"], 3),
                      "predicted": round(twin["time_s"] / r["time_s"], 3)})
    errors = [abs(p["predicted"] - p["measured"]) / p["measured"] * 100 for p in pairs]
    return {"pairs": pairs, "speedup_mape_pct": round(sum(errors) / len(errors), 1) if errors else None}


def a100_over_h100(rows: list[dict], seq_lens: tuple[int, int] = (0, 4096)) -> dict:
    """A100-80GB over H100-80GB step time for each layout the MPT table ran on both (same model,
    sequence, GPUs, micro-batch, accumulation, checkpointing) with a sequence in ``seq_lens``
    (inclusive): measured and predicted medians and each pair's measured over predicted, a
    ratio within one table that its software cancels out of. At most 4,096 tokens the matmuls
    are most of the step, and Hopper's default efficiency is what matches them; from 16,384 on
    attention is, at its kernels' published shares of the peak."""
    def layout(r):  # the row's layout without its GPU type
        return r["layout"].replace(r["group"], "")
    low, high = seq_lens
    h100 = {layout(r): r for r in rows if r["group"] == "h100_80gb" and "time_s" in r and low <= r["seq_len"] <= high}
    pairs = [(r["real_time_s"] / h100[layout(r)]["real_time_s"], r["time_s"] / h100[layout(r)]["time_s"])
             for r in rows if r["group"] == "a100_80gb" and "time_s" in r and layout(r) in h100]
    return {"pairs": len(pairs), "seq_lens": list(seq_lens),
            "measured_median": round(float(np.median([m for m, _ in pairs])), 3),
            "predicted_median": round(float(np.median([p for _, p in pairs])), 3),
            "measured_over_predicted": sorted(round(m / p, 3) for m, p in pairs)}


# --------------------------------------------------------------------------- torchtitan


def at_rated_power(cluster):
    """``cluster`` with its device types' power limits left out: what memx predicted before it
    counted them."""
    types = tuple(dataclasses.replace(t, power_limit_w=None, rated_power_w=None) for t in cluster.device_types)
    return dataclasses.replace(cluster, device_types=types)


def torchtitan_stage_layers(num_layers: int, pp: int, virtual_stages: int) -> list[int]:
    """Layers per pipeline rank as torchtitan splits a model without given split points
    (``generate_split_points`` in ``torchtitan/parallelisms/pipelining_utils.py``, commit 6806473):
    ``pp x virtual_stages`` stages of ``num_layers // stages`` layers, one more on each middle
    stage while the remainder lasts; rank r runs stages r, r + pp, ..."""
    stages = pp * virtual_stages
    base, extra = divmod(num_layers, stages)
    sizes = [base] + [base + (i < extra) for i in range(stages - 2)]
    sizes.append(num_layers - sum(sizes))
    return [sum(sizes[r::pp]) for r in range(pp)]


def torchtitan(rated_power: bool = False, as_megatron: bool = False, async_tp_as: str = "async_tp") -> list[dict]:
    """The rows of torchtitan_performance.csv with memx's estimate of each; with ``rated_power``,
    as if their GPUs ran at the board's rated power rather than the tables' 500 W limit; with
    ``as_megatron``, their loss under TP counted as Megatron's kernel and their FP8 weights as
    Transformer Engine keeps them (what memx counted before ``--torch-loss-parallel`` and
    ``--no-fp8-weight-cache``); ``async_tp_as``: their AsyncTP rows asked with ``--async-tp``,
    ``--tp-comm-overlap`` (``userbuffers``: every TP collective hidden) or neither (``none``)."""
    rows = []
    with open(os.path.join(DATA, "torchtitan_performance.csv")) as f:
        for d in csv.DictReader(f):
            seq, gpus, cp, local = int(d["seq_len"]), int(d["gpus"]), int(d["cp"]), int(d["local_batch_size"])
            tp, pp, async_tp = int(d["tp"]), int(d["pp"]), d["async_tp"] == "True"
            model = dataclasses.replace(get_model(d["model"]), seq_len=seq)
            dp, policy = gpus // (cp * tp * pp), d["activation_checkpointing"]
            schedule = d["pp_schedule"] or "1f1b"
            virtual_stages = 2 if schedule == "interleaved" else 1  # torchtitan's default for looped schedules
            compiled, float8 = d["compile"] == "True", d["float8"] == "True"
            fp8_gather, compiled_loss = d["float8_all_gather"] == "True", d["compiled_loss"] == "True"
            # torchao's FSDP float8 all-gather gathers each weight cast to FP8 (--fp8-params); a compiled
            # loss runs as one fused kernel (--fused-loss).
            training = TrainingSpec(global_batch_size=local * dp, seq_len=seq, setup="torchtitan", fused_norm=compiled,
                                    eager_block=not compiled, fp8="current" if float8 else None,
                                    fp8_params=fp8_gather, fused_loss=compiled_loss,
                                    async_tp=async_tp and async_tp_as == "async_tp",
                                    tp_comm_overlap=async_tp and async_tp_as == "userbuffers")
            if as_megatron:
                training = dataclasses.replace(training, torch_loss_parallel=tp == 1, fp8_weight_cache=True)
            recompute = {"none": "none", "full": "full", "selective_op": "selective",
                         "selective_layer": "full:every2"}[policy]
            row = {"group": d["table"], "gpu": d["gpu"], "real": "ok", "model": d["model"], "seq_len": seq,
                   "gpus": gpus, "tokens": local * dp * seq,
                   "real_time_s": local * dp * seq / (float(d["tokens_per_s_per_gpu"]) * gpus),
                   "real_memory_gib": float(d["memory_gib"]) if d["memory_gib"] else None,
                   "layout": f"{d['model']} s{seq} {gpus}x{d['gpu']} fsdp{dp} cp{cp}"
                             + f" tp{tp}" * (tp > 1) + f" pp{pp} {schedule}" * (pp > 1) + f" b{local} {policy}"
                             + " compile" * compiled + " float8" * float8 + " float8_all_gather" * fp8_gather
                             + " compiled_loss" * compiled_loss + " async_tp" * async_tp}
            cluster = dgx_cluster(d["gpu"], gpus)
            # As many micro-batches as pipeline ranks (torchtitan's default), none without a pipeline.
            pipeline = dict(micro_batch_size=local // pp, schedule=schedule, virtual_stages=virtual_stages,
                            layers_per_stage=torchtitan_stage_layers(model.num_layers, pp, virtual_stages)) \
                if pp > 1 else dict(micro_batch_size=local)
            row = predicted(row, model, at_rated_power(cluster) if rated_power else cluster, training, parts=True,
                            tp=tp, pp=pp, dp=dp, cp=cp, recompute=recompute, **pipeline)
            # torchtitan logs the caching allocator's peak reserve (its DeviceMemoryMonitor:
            # reserved_bytes.all.peak), which holds neither NCCL's buffers nor the CUDA context.
            parts = row.pop("parts_gib", None)
            if parts:
                row["reserved_gib"] = round(row["peak_gib"] - parts["communicator_buffers"] - CONTEXT_GIB, 2)
            rows.append(row)
    return rows


def reserved_summary(rows: list[dict]) -> dict:
    """memx's allocator reserve (its peak less NCCL's buffers and the CUDA context) against the
    reserve the runs logged."""
    logged = [r for r in rows if r.get("real_memory_gib") and "reserved_gib" in r]
    return {"runs": len(logged), "mape_pct": round(mape([r["reserved_gib"] for r in logged],
                                                        [r["real_memory_gib"] for r in logged]), 1),
            "predicted_over_measured": [round(r["reserved_gib"] / r["real_memory_gib"], 3) for r in logged]}


def torchtitan_ratios(rows: list[dict]) -> list[dict]:
    """Step-time ratios of two rows of one table (per token where the batches differ), measured
    and predicted: what each option changes, which a device's common bias cancels out of."""
    def row(group, *words, without=()):
        return next(r for r in rows if r["group"] == group and all(f" {w} " in r["layout"] + " " for w in words)
                    and not any(f" {w} " in r["layout"] + " " for w in without))

    def per_token(r, key):
        return r[key] * r["gpus"] / r["tokens"]  # GPU-seconds per token

    llama2, llama3, h100 = "a100-llama2", "a100-llama3", "h100-1"
    pairs = [(row(llama2, "selective_op"), row(llama2, "none"), "llama2-13b A100: op-level over no checkpointing"),
             (row(llama2, "b2", "selective_layer"), row(llama2, "none"), "llama2-13b A100: every other layer over none"),
             (row(llama3, "selective_op"), row(llama3, "selective_layer"),
              "llama3-8b A100: op-level over every other layer"),
             (row(h100, "float8"), row(h100, "compile", without=("float8",)),
              "llama3-8b H100: compile + Float8 over compile"),
             (row(h100, "compile", without=("float8",)), row(h100, "selective_op", without=("compile",)),
              "llama3-8b H100: compile over eager (not modelled)"),
             (row("h100-3", "selective_op", without=("compile",)), row(h100, "selective_op", without=("compile",)),
              "llama3-8b H100: per token and GPU, FSDP over 128 GPUs over 8"),
             (row("h100-4", "async_tp"), row("h100-4", "float8", without=("async_tp",)),
              "llama3-70b H100: AsyncTP over TP 8"),
             (row("h100-5", "interleaved"), row("h100-5", "1f1b"), "llama3.1-405b H100: Interleaved 1F1B over 1F1B"),
             (row("h200-trainy", "64xh200"), row("h200-trainy", "32xh200"),
              "llama3-8b H200: per token and GPU, FSDP over 64 GPUs over 32")]
    pairs += [(row(group, f"cp{cp}"), row(group, "cp1"), f"{model} H100: per token, CP {cp} at "
               f"{row(group, f'cp{cp}')['seq_len']} over CP 1 at 32768")
              for group, model in (("h100-2", "llama3-8b"), ("h100-6", "llama3.1-405b")) for cp in (2, 4, 8)]
    return [{"what": what, "measured": round(per_token(a, "real_time_s") / per_token(b, "real_time_s"), 3),
             "predicted": round(per_token(a, "time_s") / per_token(b, "time_s"), 3)}
            for a, b, what in pairs if "time_s" in a and "time_s" in b]


# --------------------------------------------------------------------------- summary and plot


def by(rows, key) -> dict:
    return {name: run_summary(members) for name, members in grouped(rows, key).items()}


def plot(narayanan_rows, mpt_rows, titan_rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memx_launch.planning.report import save_png_atomic

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(18, 5))
    left.scatter([r["real_time_s"] for r in narayanan_rows], [r["time_s"] for r in narayanan_rows], s=24)
    for r in narayanan_rows:
        left.annotate(r["model"].replace("gpt-", ""), (r["real_time_s"], r["time_s"]), fontsize=7)
    identity_axes(left, [r[k] for r in narayanan_rows for k in ("real_time_s", "time_s")], "published step time (s)",
              "memx (s)", f"Megatron-LM GPT on A100 (Narayanan 2021): MAPE "
              f"{time_mape(narayanan_rows):.1f}%")
    for axis, rows, title in ((middle, mpt_rows, "MPT with FSDP (MosaicML)"),
                              (right, titan_rows, "torchtitan with FSDP2 (Meta)")):
        step_time_by_group(axis, rows, title, plt.cm.tab10.colors)
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=100)


def main() -> None:
    started = time.perf_counter()
    n, m = narayanan(), mpt()
    result = {"machine": machine_info(), "cost_model": "analytical, datasheet peaks, default efficiency",
              "narayanan2021_table1": {**run_summary(n), "rows": n},
              "mpt_llm_foundry": {**run_summary(m), "by_gpu": by(m, lambda r: r["group"]),
                                  "by_seq_len": by(m, lambda r: r["seq_len"]),
                                  "by_recompute": by(m, lambda r: r["recompute"]),
                                  "a100_over_h100": a100_over_h100(m),
                                  "a100_over_h100_long": a100_over_h100(m, (16384, 65536)), "rows": m},
              # What the fused loss changes: the same rows with torch's cross entropy (14 bytes per logit).
              "mpt_llm_foundry_with_torch_cross_entropy": run_summary(mpt(fused_loss=False)),
              "all": run_summary(n + m)}
    fp8 = mpt(table="mpt_llm_foundry_fp8.csv")
    result["mpt_llm_foundry_fp8"] = {**run_summary(fp8), "fp8_over_bf16": fp8_speedups(m, fp8), "rows": fp8}
    titan = torchtitan()
    result["torchtitan"] = {**run_summary(titan), "by_table": by(titan, lambda r: r["group"]),
                            "by_gpu": by(titan, lambda r: r["gpu"]),
                            "ratios": torchtitan_ratios(titan), "reserved_memory": reserved_summary(titan), "rows": titan}
    # What counting the H100 runs' 500 W power limit changed: the same rows at the rated 700 W.
    rated = [r for r in torchtitan(rated_power=True) if r["gpu"] == "h100_96gb"]
    result["torchtitan"]["h100_at_rated_power"] = {**run_summary(rated), "by_table": by(rated, lambda r: r["group"]),
                                                   "predicted_over_measured": sorted(
                                                       round(r["time_s"] / r["real_time_s"], 3) for r in rated)}
    # What AsyncTP's overlap changes: its rows asked without any, and as Megatron's userbuffers (every pass hidden).
    for priced in ("none", "userbuffers"):
        result["torchtitan"][f"async_tp_rows_as_{priced}"] = {
            r["layout"]: round(r["time_s"] / r["real_time_s"], 3) for r in torchtitan(async_tp_as=priced)
            if "async_tp" in r["layout"]}
    # What counting torch's loss parallel and torchao's weight casts changed: the rows counted as Megatron's.
    result["torchtitan"]["reserved_memory_as_megatron"] = reserved_summary(torchtitan(as_megatron=True))
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json_atomic(OUT, no_nan(result), overwrite=True)
    plot(n, m, titan, PLOT)
    for key in ("narayanan2021_table1", "mpt_llm_foundry", "mpt_llm_foundry_with_torch_cross_entropy", "all",
                "mpt_llm_foundry_fp8", "torchtitan"):
        print(key, result[key]["time"], result[key]["fit"]["confusion"])
    print("  FP8 over BF16", result["mpt_llm_foundry_fp8"]["fp8_over_bf16"])
    print("  MPT A100 over H100", result["mpt_llm_foundry"]["a100_over_h100"])
    print("  MPT A100 over H100, 16k-65k tokens", result["mpt_llm_foundry"]["a100_over_h100_long"])
    for part in ("by_table", "by_gpu"):
        for name, summary in result["torchtitan"][part].items():
            print("  torchtitan", name, summary["time"], summary["fit"]["confusion"]["real_ok_pred_oom"], "called OOM")
    print("  torchtitan reserved memory", result["torchtitan"]["reserved_memory"])
    print("  counted as Megatron's", result["torchtitan"]["reserved_memory_as_megatron"])
    for ratio in result["torchtitan"]["ratios"]:
        print("  ", ratio)
    for gpu, s in result["mpt_llm_foundry"]["by_gpu"].items():
        print(" ", gpu, s["time"])
    for seq, s in result["mpt_llm_foundry"]["by_seq_len"].items():
        print(" ", seq, s["time"])
    print(f"{result['seconds']} s")


if __name__ == "__main__":
    main()
