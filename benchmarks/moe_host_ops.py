"""How much host work a mixture-of-experts layer issues: Megatron-Core's MoELayer (the installed
megatron-core, its top-k softmax router with the auxiliary loss, the all-to-all token dispatcher
and one SwiGLU MLP per local expert) run forward and backward on this CPU, every ATen op it
dispatches counted (a TorchDispatchMode), for 2 to 32 local experts. The counts are linear in the
local experts: a per-layer part (router, dispatch and combine, permutes) and a per-expert part
(each expert's linears and activation, forward, data and weight gradients). Also counted: the
forward's ops before the dispatcher makes the host wait for the device (its
``_maybe_dtoh_and_synchronize`` at its ``cuda_sync_point``: the token counts the exchange and the
experts' splits need on the host; at EP 1 without permute fusion, before the second permutation),
which ``host_time`` takes as what a MoE layer's forward issues before it waits. Also measured: the
elements autograd keeps for the backward per routed copy of a token inside the experts (saved-
tensor hooks while they run), which memx's activation memory of the experts follows
(``experts.ROUTED_ACTIVATION_KEPT``, unfused).
``memx_launch.planning.experts`` prices a MoE layer's host time from these counts (its
``MOE_HOST_OPS``); a test holds the constants to this file. Also timed: the host seconds per op
(eager PyTorch on CPU tensors of a few tokens, the layer's Python included), the least of several
steps of each layer, taken in turns; their median is what memx prices each op at
(``host_time.EAGER_OP_HOST_S``, held to ``host_us_per_op`` within 10% by a test).

The dispatcher creates CUDA streams and the router places its weight on the current CUDA device;
on this CPU-only torch both are stood in (a stream that does nothing, the CPU as the device), and
megatron-core 0.16.1 names ``te_general_gemm`` without Transformer Engine installed, so it is set
to None as its own import fallback intends. Writes benchmarks/results/moe_host_ops.json.
Run: .venv/bin/python benchmarks/moe_host_ops.py   (seconds, after megatron-core's import)
     .venv/bin/python benchmarks/moe_host_ops.py --counts-only   (the op counts, which do not
     depend on the machine, into the file's rows; its timing and machine stay the run's that timed)
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

OUT = os.path.join(HERE, "results", "moe_host_ops.json")
LOCAL_EXPERTS = (2, 4, 8, 16, 32)
ROUNDS, STEPS_PER_ROUND = 8, 4


class _NoStream:
    """A CUDA stream or event that does nothing: the CPU runs every op inline."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoStream()


def _stand_in_cuda() -> None:
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def moe_layer(local_experts: int):
    """Megatron-Core's MoELayer with ``local_experts`` experts on one rank (EP 1), small widths:
    the op count does not depend on them."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=32,
                               num_moe_experts=local_experts, moe_router_topk=2, moe_ffn_hidden_size=32,
                               moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                               moe_aux_loss_coeff=1e-3, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                       linear_fc2=RowParallelLinear))
    return MoELayer(config, submodules=MoESubmodules(experts=experts))


def forward_backward_ops(forward_step) -> tuple[int, int]:
    """ATen ops ``forward_step()`` (returning the output) dispatches, and the backward from its
    sum, after a warm-up step."""
    for _ in range(2):
        with _OpCounter() as forward:
            out = forward_step()
        with _OpCounter() as backward:
            out.float().sum().backward()
    return sum(forward.ops.values()), sum(backward.ops.values())


def count_ops(layer) -> tuple[int, int, int]:
    """ATen ops one forward and one backward of ``layer`` dispatch, and the forward's before the
    host waits for the device (the token dispatcher's synchronisation; the last forward's)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    synchronise = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    before_wait = []

    def counted(dispatcher, point, *args, **kwargs):
        if point == dispatcher.cuda_sync_point:  # the forward's op counter is the current mode here
            before_wait.append(sum(_get_current_dispatch_mode().ops.values()))
        return synchronise(dispatcher, point, *args, **kwargs)

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = counted
    try:
        x = torch.randn(16, 2, 64, requires_grad=True)
        forward, backward = forward_backward_ops(lambda: layer(x)[0])
    finally:
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = synchronise
    return forward, backward, before_wait[-1]


def expert_saved_bytes(layer, tokens: int) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``layer``'s experts run forward
    on ``tokens`` tokens (each storage once, the parameters not counted): the dispatched tokens and
    what each expert's linears and activation keep, not the router's nor the permutation's."""
    inside, kept = [False], {}
    hooks = [layer.experts.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)),
             layer.experts.register_forward_hook(lambda *a: inside.__setitem__(0, False))]
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(tokens, 1, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _bias = layer(x)
    out.sum().backward()
    for hook in hooks:
        hook.remove()
    return sum(kept.values())


def host_seconds(layers) -> list[float]:
    """Fewest seconds one forward and backward of each of ``layers`` took on a few tokens: host
    work only. The layers take turns over several rounds, and each keeps its least step: a shared
    host's other work, or a slow spell of its CPU, only ever adds to a step."""
    x = torch.randn(8, 1, 64, requires_grad=True)
    best = [float("inf")] * len(layers)
    for _ in range(ROUNDS):
        for i, layer in enumerate(layers):
            for step in range(STEPS_PER_ROUND + 1):  # the first of each turn warms up
                start = time.perf_counter()
                out, _bias = layer(x)
                out.sum().backward()
                if step:
                    best[i] = min(best[i], time.perf_counter() - start)
    return best


def linear_fit(xs, ys) -> dict:
    """Least-squares line through (xs, ys), rounded to whole ops, with its largest miss."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    per_expert, per_layer = round(slope), round(my - slope * mx)
    miss = max(abs(y - (per_layer + per_expert * x)) for x, y in zip(xs, ys))
    return {"per_layer": per_layer, "per_local_expert": per_expert, "largest_miss": miss}


def start_megatron_on_cpu(port: int) -> str:
    """megatron-core on this CPU-only torch: its CUDA streams stood in, one gloo rank, TP, PP and
    EP 1. Its version."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    _stand_in_cuda()
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import __version__, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    return __version__


def count_lines(rows: list[dict]) -> dict:
    """The op counts' lines in the local experts: forward, backward and the forward's before the wait."""
    xs = [r["local_experts"] for r in rows]
    return {key: linear_fit(xs, [r[field] for r in rows]) for key, field in (
        ("forward", "forward_ops"), ("backward", "backward_ops"), ("forward_before_wait", "forward_ops_before_wait"))}


def refresh_counts(counts: list[tuple[int, int, int]]) -> None:
    """The op counts of each number of local experts (and their lines) into the results file,
    its timed fields left as they are."""
    with open(OUT) as f:
        result = json.load(f)
    for row, (forward, backward, before_wait) in zip(result["rows"], counts):
        row.update(forward_ops=forward, backward_ops=backward, forward_ops_before_wait=before_wait)
    result.update(count_lines(result["rows"]))
    result["counts_from"] = machine_info()["date"]
    write_json_atomic(OUT, result, overwrite=True)
    print(f"forward {result['forward']} ({result['forward_before_wait']} before the wait), "
          f"backward {result['backward']} -> {OUT}")


def main() -> None:
    counts_only = "--counts-only" in sys.argv[1:]
    megatron_version = start_megatron_on_cpu(29561)
    started = time.perf_counter()
    layers, counts = [], []
    for local in LOCAL_EXPERTS:
        torch.manual_seed(0)
        layers.append(moe_layer(local))
        counts.append(count_ops(layers[-1]))
    if counts_only:
        dist.destroy_process_group()
        return refresh_counts(counts)
    rows = []
    for local, layer, (forward, backward, before_wait), seconds in zip(LOCAL_EXPERTS, layers, counts,
                                                                       host_seconds(layers)):
        # fp32 elements kept per routed copy (top-2): the slope over the tokens, which cancels what does not grow with them.
        per_copy = (expert_saved_bytes(layer, 512) - expert_saved_bytes(layer, 256)) / 256 / 4 / 2
        rows.append({"local_experts": local, "forward_ops": forward, "forward_ops_before_wait": before_wait,
                     "backward_ops": backward,
                     "kept_elements_per_routed_copy": per_copy,
                     "host_ms_this_cpu": round(seconds * 1e3, 3),
                     "host_us_per_op_this_cpu": round(seconds * 1e6 / (forward + backward), 1)})
        print(f"{local:3d} local experts: {forward} forward + {backward} backward ops, "
              f"{seconds * 1e3:.2f} ms on this CPU", flush=True)
    dist.destroy_process_group()
    result = {
        "machine": machine_info(),
        "megatron_core": megatron_version,
        "torch": torch.__version__,
        "layer": "MoELayer: TopKRouter (softmax, top-2, aux loss), MoEAlltoAllTokenDispatcher, SequentialMLP "
                 "of SwiGLU experts (hidden 64, width 32, unfused activation), EP 1, fp32 on CPU",
        "expert_width": 32, "hidden_size": 64,
        **count_lines(rows),
        "rows": rows,
        # What the cost model prices each of a MoE layer's ops at (host_time.EAGER_OP_HOST_S).
        "host_us_per_op": round(statistics.median(r["host_us_per_op_this_cpu"] for r in rows), 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_json_atomic(OUT, result, overwrite=True)
    print(f"forward {result['forward']}, backward {result['backward']} -> {OUT}")


if __name__ == "__main__":
    main()
