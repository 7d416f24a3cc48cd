"""How much host time DeepSpeed ZeRO-3's hooks add to a transformer block, timed on this CPU.

ZeRO-3 hooks every module: before and after each module's forward and backward its parameter
coordinator fetches the module's weights (an all-gather, and prefetches along its trace), waits
for them, then releases them. That is Python on the host, whatever the block's size: on a small
block or micro-batch the host, not the accelerator, sets the pace.

A LLaMA block of Hugging Face's module tree (``hf``: q, k, v, o, gate, up and down projections,
7 linear modules) and the same block with fused QKV and gate-up linears (``fused``: 4) run
forward and backward under DeepSpeed on one CPU rank (gloo, ``DS_ACCELERATOR=cpu``, one thread,
shapes so small that the host's work is all there is and no collective waits for another rank;
DeepSpeed's default budgets as a share of LLaMA-2 7B's block, so that it releases and fetches
every module as a model larger than its budget does):
ZeRO stage 1 (no hooks on the modules) and stage 3. Each is timed at 8 and 16 blocks (the least of
60 steps after warm-up, in two processes); the difference over 8 is one block's host time, forward and backward,
and ZeRO-3's excess over stage 1 is its hooks'. The two blocks give the hooks' seconds per linear
module (each one fetch and release a pass) and the rest of a block's (its norms', its attention's,
MLP's and block's hooks), forward and backward. The plain block's ATen ops are counted (a
TorchDispatchMode) for the host seconds per op of this run, beside memx's ``EAGER_OP_HOST_S``.

memx adds these seconds to a block's host time where a fully sharded run fetches as DeepSpeed
ZeRO-3 does (``--max-live-params``, ``--setup zero3``): ``host_time.DEEPSPEED_HOOK_HOST_S``;
``tests/test_host_time.py`` holds the constants to this file.

Writes benchmarks/results/deepspeed_zero3_host.json.
Run (DeepSpeed in a virtual environment of its own, as ``benchmarks/deepspeed_zero3_fetch.py`` says):
  DS_ACCELERATOR=cpu /tmp/ds/bin/python benchmarks/deepspeed_zero3_host.py   (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.deepspeed_zero3_fetch import BUDGETS, Model  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

OUT = os.path.join(HERE, "results", "deepspeed_zero3_host.json")
HIDDEN, FFN, HEADS, VOCAB, SEQ = 32, 86, 2, 64, 8
LAYERS = (8, 16)
WARMUP, STEPS, REPEATS = 5, 60, 2
LINEAR_MODULES = {"hf": 7, "fused": 4}
# DeepSpeed's default budgets over LLaMA-2 7B's block, scaled to this block: it fetches and releases
# every module's weights, as a model larger than its live budget does.
BUDGET = BUDGETS["llama2_7b_defaults"]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def run_rank(rank: int, layers: int, fused: bool, stage: int, port: int, out: str) -> None:
    import deepspeed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    block = sum(p.numel() for p in Model(1, HIDDEN, FFN, HEADS, VOCAB, fused).layers.parameters())
    prefetch, live, reuse, reduce = (int(x * block) for x in BUDGET)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": prefetch, "stage3_max_live_parameters": live,
                                    "stage3_max_reuse_distance": reuse, "reduce_bucket_size": reduce},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    torch.manual_seed(0)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Model(layers, HIDDEN, FFN, HEADS, VOCAB, fused)
    else:
        model = Model(layers, HIDDEN, FFN, HEADS, VOCAB, fused)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = torch.randint(0, VOCAB, (1, SEQ))
    forward, backward = [], []
    for _ in range(WARMUP + STEPS):
        start = time.perf_counter()
        loss = engine(ids)
        middle = time.perf_counter()
        engine.backward(loss)
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
        engine.step()
    counter = OpCounter()
    with counter:
        loss = engine(ids)
    forward_ops = counter.ops
    counter.ops = 0
    with counter:
        engine.backward(loss)
    with open(out, "w") as f:
        json.dump({"forward_s": min(forward[WARMUP:]), "backward_s": min(backward[WARMUP:]),
                   "forward_ops": forward_ops, "backward_ops": counter.ops}, f)
    dist.destroy_process_group()


def measure(layers: int, fused: bool, stage: int, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(run_rank, args=(layers, fused, stage, port, out), nprocs=1)
        with open(out) as f:
            return json.load(f)


def per_block(runs: dict, key: str) -> float:
    few, many = (runs[n][key] for n in LAYERS)
    return (many - few) / (LAYERS[1] - LAYERS[0])


def main() -> None:
    import deepspeed
    port, blocks = 29800, {}
    for name in LINEAR_MODULES:
        stages = {}
        for stage in (1, 3):
            runs = {}
            for layers in LAYERS:  # the least of each process's least: the host's own time, not its interruptions
                trials = []
                for _ in range(REPEATS):
                    port += 1
                    trials.append(measure(layers, name == "fused", stage, port))
                runs[layers] = {key: min(t[key] for t in trials) for key in trials[0]}
                print(f"{name} ZeRO-{stage} {layers} blocks: {runs[layers]}", flush=True)
            stages[stage] = {key: per_block(runs, key) for key in ("forward_s", "backward_s", "forward_ops",
                                                                    "backward_ops")}
        plain, zero3 = stages[1], stages[3]
        blocks[name] = {"linear_modules": LINEAR_MODULES[name], "zero1_per_block": plain, "zero3_per_block": zero3,
                        "host_us_per_op_zero1": round(1e6 * (plain["forward_s"] + plain["backward_s"])
                                                      / (plain["forward_ops"] + plain["backward_ops"]), 2),
                        "hook_us_per_block": {p: round(1e6 * (zero3[f"{p}_s"] - plain[f"{p}_s"]), 1)
                                              for p in ("forward", "backward")}}
    hf, fused = blocks["hf"]["hook_us_per_block"], blocks["fused"]["hook_us_per_block"]
    per_linear = {p: (hf[p] - fused[p]) / (LINEAR_MODULES["hf"] - LINEAR_MODULES["fused"]) for p in hf}
    fit = {p: {"per_linear_module_us": round(per_linear[p], 1),
               "rest_of_block_us": round(fused[p] - LINEAR_MODULES["fused"] * per_linear[p], 1)} for p in hf}
    write_json_atomic(OUT, {
        "what": "host time DeepSpeed ZeRO-3's module hooks add to a block, timed on CPU",
        "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "model": {"hidden": HIDDEN, "ffn": FFN, "heads": HEADS, "vocab": VOCAB, "seq": SEQ},
        "blocks": blocks, "hooks": fit, "machine": machine_info()}, overwrite=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
