"""Does the caching allocator explain the Hagemann runs memx calls fits but that ran out of memory?

docs/setups.md names PyTorch's caching allocator as the candidate for the false fits of Hagemann
et al.'s LLaMA-13B sweep (A100-80GB): the loss's multi-GiB blocks, freed after each backward,
are split by the next forward's tensors, so the next loss needs fresh segments, and the device
runs out with less allocated than memx counts. This script tests that with no constant fitted:

1. The allocation trace of a pipeline stage's training steps: the stage's ops as the scaling
   codebase issues them (memx's ``--setup scaling`` reading of it: bf16, 1F1B, torch-op norms
   that keep an fp32 copy or the RMS kernel, the attention kernel of the run, separate gate and
   up linears, sequence parallelism keeping the gathered linear inputs, the head's logits
   gathered over TP for torch's cross entropy in fp32, the previous micro-batch's logits kept,
   stage outputs kept until their gradient returns, full recompute as torch's checkpoint, the
   gradients allocated by the backward and freed after the step, the fp32 all-reduce of 500M-
   element buckets and ZeRO-1's fp32 shard), run on meta tensors under a dispatch mode that
   records every storage an op creates and when it is freed. Two steps, each of
   ``min(micro-batches, pp + 2)`` micro-batches (the allocator's state repeats after that).
2. The trace replayed through :mod:`benchmarks.caching_allocator` (PyTorch's rules), against
   the device's capacity less the bytes memx counts outside the tensors (communicators' buffers
   and the process's fixed overhead).

Each run memx predicts at 55-90 GiB is replayed, on its stages that memx predicts above 40 GiB
(the others hold 40% of the device spare). Written: ``benchmarks/results/allocator_replay.json``
(per run: memx's peak, the trace's allocated and reserved peak per stage, whether the replay ran
out; a confusion of both against the real outcome).

Run: .venv/bin/python benchmarks/allocator_replay.py   (about 15 minutes on 2 cores; a line per replayed run)
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.caching_allocator import replay  # noqa: E402
from benchmarks.common import fit_summary  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.real_runs import hagemann, shared_dir  # noqa: E402
from memx_launch.errors import ConfigError  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning.estimate import evaluate_layout  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "allocator_replay.json")
GIB = 2**30
BF16 = torch.bfloat16
REPLAYED_GIB = (55.0, 90.0)  # runs memx predicts in this range are replayed
TRACED_STAGE_GIB = 40.0
BUCKET_ELEMENTS = 500_000_000  # scaling's allreduce_bucket_size


class AllocationTrace(TorchDispatchMode):
    """("alloc", handle, bytes) for each storage an op creates, ("free", handle, 0) when it dies."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self._live: dict[int, weakref.ref] = {}
        self._handles = itertools.count()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or storage.nbytes() == 0:
            return
        handle = next(self._handles)
        self.events.append(("alloc", handle, storage.nbytes()))
        events, live = self.events, self._live

        def freed(_, handle=handle, key=key):
            events.append(("free", handle, 0))
            live.pop(key, None)
        self._live[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:  # a view shares its input's storage: not an allocation
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in inputs:
                self._track(tensor)
        return out


def empty(*shape, dtype=BF16, grad=False) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


class Gather(torch.autograd.Function):
    """All-gather over TP along ``dim`` (backward: this rank's share, as a reduce-scatter writes)."""

    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        shape = list(x.shape)
        shape[dim] *= tp
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, grad):
        shape = list(grad.shape)
        shape[ctx.dim] //= ctx.tp
        return grad.new_empty(shape), None, None


class ReduceScatter(torch.autograd.Function):
    """Sequence parallelism's reduce-scatter along the sequence (backward: an all-gather)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.new_empty((x.shape[0] // tp, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty((grad.shape[0] * ctx.tp, *grad.shape[1:])), None


class FlashAttention(torch.autograd.Function):
    """On [b, s, heads, d]: keeps q, k, v, the output and its fp32 log-sum-exp; the backward's fp32
    dq accumulator and softmax sums are temporaries."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, lse = ctx.saved_tensors
        sums, accumulator = lse.new_empty(lse.shape), q.new_empty(q.shape, dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del sums, accumulator
        return dq, dk, dv


class FusedSoftmax(torch.autograd.Function):
    """Megatron's scaled upper-triangular masked softmax: 16 bits in and out, keeps its output."""

    @staticmethod
    def forward(ctx, scores):
        probs = torch.empty_like(scores)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


class RMSKernel(torch.autograd.Function):
    """A fused RMSNorm: keeps its input and the fp32 reciprocal RMS per token."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


def rms_norm(x, weight, fused: bool):
    if fused:
        return RMSKernel.apply(x, weight)
    x32 = x.float()  # scaling's 2023 norm: self._norm(x.float()).type_as(x) * self.weight
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight


def rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TransformerBlock:
    """One transformer block's weights on a TP rank and its forward in Megatron's [s, b, h] layout."""

    def __init__(self, model, tp: int):
        h, ffn = model.hidden_size, model.ffn_hidden_size
        self.tp, self.heads, self.head_dim = tp, model.num_heads // tp, model.head_dim
        self.weights = {"norm1": empty(h, grad=True), "qkv": empty(3 * h // tp, h, grad=True),
                        "dense": empty(h, h // tp, grad=True), "norm2": empty(h, grad=True),
                        "gate": empty(ffn // tp, h, grad=True), "up": empty(ffn // tp, h, grad=True),
                        "down": empty(h, ffn // tp, grad=True)}

    def _attention(self, x, kernel: str):
        s, b = x.shape[:2]
        a, d = self.heads, self.head_dim
        q, k, v = F.linear(x, self.weights["qkv"]).view(s, b, a, 3 * d).split(d, dim=-1)
        cos, sin = empty(s, 1, 1, d), empty(s, 1, 1, d)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if kernel.startswith("flash"):
            out = FlashAttention.apply(*(t.transpose(0, 1).contiguous() for t in (q, k, v)))
            return out.transpose(0, 1).reshape(s, b, -1)
        q, k, v = (t.reshape(s, b * a, d).transpose(0, 1) for t in (q, k, v))
        scores = torch.baddbmm(empty(b * a, s, s), q, k.transpose(1, 2), beta=0.0, alpha=d ** -0.5)
        if kernel == "fused":
            probs = FusedSoftmax.apply(scores)
        else:  # torch's softmax, in fp32 (memx's --softmax-in-fp32 reading of these rows)
            mask = torch.empty(1, s, s, dtype=torch.bool, device="meta")
            probs = F.softmax(scores.masked_fill(mask, -10000.0).float(), dim=-1).to(BF16)
        return torch.bmm(probs, v).transpose(0, 1).reshape(s, b, -1)

    def __call__(self, x, options: dict):
        w, tp, sp = self.weights, self.tp, options["sp"]
        normed = rms_norm(x, w["norm1"], options["rms_kernel"])
        out = F.linear(self._attention(Gather.apply(normed, tp, 0) if sp else normed, options["kernel"]), w["dense"])
        x = x + (ReduceScatter.apply(out, tp) if sp else out)
        normed = rms_norm(x, w["norm2"], options["rms_kernel"])
        if sp:
            normed = Gather.apply(normed, tp, 0)
        out = F.linear(F.silu(F.linear(normed, w["gate"])) * F.linear(normed, w["up"]), w["down"])
        return x + (ReduceScatter.apply(out, tp) if sp else out)


def stage_trace(model, training, tp: int, pp: int, dp: int, stage: int, layers: int, micro_batch_size: int,
                micro_batches: int, recompute: str, steps: int = 2) -> list[tuple]:
    """Allocation events of ``steps`` training steps of ``stage`` under 1F1B (module docstring)."""
    seq, b, h, vocab = training.seq_len, micro_batch_size, model.hidden_size, model.vocab_size
    first, last, sp = stage == 0, stage == pp - 1, training.sequence_parallel and tp > 1
    options = {"sp": sp, "rms_kernel": training.fused_norm,
               "kernel": "flash" if training.flash_attention else "fused" if training.fused_softmax else "torch"}
    local_seq = seq // tp if sp else seq
    trace = AllocationTrace()
    with trace:
        blocks = [TransformerBlock(model, tp) for _ in range(layers)]
        embedding = empty(vocab // tp, h, grad=True) if first else None
        final_norm, head = (empty(h, grad=True), empty(vocab // tp, h, grad=True)) if last else (None, None)
        params = [p for block in blocks for p in block.weights.values()] + \
            [p for p in (embedding, final_norm, head) if p is not None]
        shard = -(-sum(p.numel() for p in params) // dp)
        optimizer_states = [empty(shard, dtype=torch.float32) for _ in range(3)]  # ZeRO-1: master, two moments
        in_flight, kept_logits = {}, []

        def forward(i):
            x = empty(local_seq, b, h, grad=not first)  # the embedding's output, or the received activation
            if first:
                x = x + 0 * embedding[0, 0]  # ties the embedding's gradient to the stage
            for block in blocks:
                x = checkpoint(block, x, options, use_reentrant=False) if recompute == "full" else block(x, options)
            if not last:
                in_flight[i] = x  # the pipeline engine keeps the stage output until its gradient returns
                return
            normed = rms_norm(x, final_norm, options["rms_kernel"])
            logits = F.linear(Gather.apply(normed, tp, 0) if sp else normed, head)
            if tp > 1:
                logits = Gather.apply(logits, tp, 2)  # every TP rank computes the loss on the whole vocabulary
            in_flight[i] = F.cross_entropy(logits.float().reshape(-1, vocab),
                                           torch.zeros(seq * b, dtype=torch.long, device="meta"))
            kept_logits[:] = [logits]  # the last stage's output buffer keeps the latest logits

        def backward(i):
            out = in_flight.pop(i)
            out.backward(None if last else empty(*out.shape))

        for _ in range(steps):
            done_forward = done_backward = 0
            for _ in range(min(pp - stage - 1, micro_batches)):
                forward(done_forward)
                done_forward += 1
            while done_backward < micro_batches:
                if done_forward < micro_batches:
                    forward(done_forward)
                    done_forward += 1
                backward(done_backward)
                done_backward += 1
            _optimizer_step(params, shard)
        del optimizer_states
    return trace.events


def _optimizer_step(params, shard: int) -> None:
    """scaling's step (``allreduce_no_retain``): gradients all-reduced over DP in fp32 buckets of
    :data:`BUCKET_ELEMENTS`, the shard's fp32 gradient, the updated weights all-gathered in
    buckets, then the gradients set to None."""
    bucket, elements = [], 0
    for p in params:
        bucket.append(p.grad)
        elements += p.numel()
        if elements > BUCKET_ELEMENTS:
            _all_reduce_in_fp32(bucket)
            bucket, elements = [], 0
    if bucket:
        _all_reduce_in_fp32(bucket)
    shard_gradient = empty(shard, dtype=torch.float32)
    gathered = empty(min(shard * 2, BUCKET_ELEMENTS))  # one all-gather bucket of updated bf16 weights
    del shard_gradient, gathered
    for p in params:
        p.grad = None


def _all_reduce_in_fp32(bucket) -> None:
    """The bucket's temporaries: its flat 16-bit copy and that copy cast to fp32."""
    flat = torch._utils._flatten_dense_tensors(bucket)
    cast = flat.to(torch.float32)
    del flat, cast


def replayed(row: dict, model, cluster, training, **layout) -> dict:
    """``row`` with memx's stage peaks and, for the runs in :data:`REPLAYED_GIB`, each traced
    stage's allocated and reserved peak and whether the replay ran out of memory."""
    try:
        plan = evaluate_layout(model, cluster, training, references=(1.0, 1.0, 1.0), **layout)
    except ConfigError as exc:
        return {**row, "error": str(exc)}
    peaks = [s.predicted_peak_memory_gib for s in plan.stages]
    row = {**row, "fits": all(p <= s.memory_capacity_gib for p, s in zip(peaks, plan.stages)),
           "peak_gib": round(max(peaks), 2)}
    if not REPLAYED_GIB[0] <= max(peaks) < REPLAYED_GIB[1]:
        return row
    pp = layout["pp"]
    micro_batches = min(training.global_batch_size // (layout["dp"] * layout["micro_batch_size"]), pp + 2)
    stages = []
    for i, stage in enumerate(plan.stages):
        if peaks[i] < TRACED_STAGE_GIB:
            continue
        outside = stage.memory_parts_gib["communicator_buffers"] + stage.memory_parts_gib["fixed_overhead"]
        events = stage_trace(model, training, layout["tp"], pp, layout["dp"], i, layout["layers_per_stage"][i],
                             layout["micro_batch_size"], micro_batches, layout["recompute"])
        result = replay(events, (stage.memory_capacity_gib - outside) * GIB)
        stages.append({"stage": i, "memx_gib": round(peaks[i], 2), "outside_tensors_gib": round(outside, 2),
                       "trace_allocated_gib": round(result["peak_allocated"] / GIB + outside, 2),
                       "replay_reserved_gib": round(result["peak_reserved"] / GIB + outside, 2),
                       "replay_out_of_memory": result["out_of_memory"]})
    return {**row, "replayed": stages, "replay_fits": not any(s["replay_out_of_memory"] for s in stages)}


def main() -> None:
    info, start = machine_info(), time.time()

    def replayed_with_progress(row, *args, **kwargs):
        row = replayed(row, *args, **kwargs)
        if "replayed" in row:
            print(f"{time.time() - start:6.0f} s  {row['real']:>3} {row['seq_len']} {row['layout']}: memx "
                  f"{row['peak_gib']} GiB, replay {'fits' if row['replay_fits'] else 'out of memory'}", flush=True)
        return row

    rows = hagemann(shared_dir(), predict=replayed_with_progress)
    chosen = [r for r in rows if "replayed" in r]
    # The reserve over allocated where the replay ran to the end (the device not yet full).
    reserve = [s["replay_reserved_gib"] - s["trace_allocated_gib"] for r in chosen for s in r["replayed"]
               if not s["replay_out_of_memory"]]
    out = {"machine": info, "replayed_range_gib": list(REPLAYED_GIB), "traced_stage_gib": TRACED_STAGE_GIB,
           "runs": len(chosen),
           "memx": fit_summary(chosen),
           "replay": fit_summary([{**r, "fits": r["replay_fits"]} for r in chosen]),
           "reserve_over_allocated_gib": {"stages": len(reserve), **{
               f"p{q}": round(float(np.percentile(reserve, q)), 2) for q in (10, 50, 90)}, "max": round(max(reserve), 2)},
           "verdicts_that_differ": [{"real": r["real"], "run": f"{r['seq_len']} {r['layout']}", "memx_gib": r["peak_gib"],
                                     "replay": "fits" if r["replay_fits"] else "out of memory"}
                                    for r in chosen if r["fits"] != r["replay_fits"]],
           "rows": chosen, "seconds": round(time.time() - start, 1)}
    write_json_atomic(OUT, out, overwrite=True)
    print(f"memx {out['memx']['confusion']}\nreplay {out['replay']['confusion']}\n-> {OUT}")


if __name__ == "__main__":
    main()
