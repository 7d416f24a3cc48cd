"""How DeepSpeed ZeRO-3 fetches a transformer's weights: its all-gathers per block and pass, its
reduce-scatters and the most parameters it holds gathered at once, traced on this CPU.

A LLaMA-style model of Hugging Face's module structure (RMSNorm, q, k, v and o projections,
gate, up and down projections: seven linear modules a block) trains four steps under DeepSpeed
ZeRO-3 on two CPU ranks (gloo, ``DS_ACCELERATOR=cpu``, fp32). A TorchDispatchMode records every
c10d collective DeepSpeed issues, by pass, and at each one how many parameters are not in their
partitioned state (gathered or in flight). The last step is read, once the coordinator has its
trace and prefetches, summed over its micro-batches: one a step, and two (gradient accumulation)
for a budget the model outgrows and one it fits (each micro-batch fetches and reduces again,
both); and on four ranks with ZeRO++'s hpZ (``zero_hpz_partition_size`` 2), each all-gather
counted by the ranks it spans. Each budget runs at 12 and 24 blocks: the difference over 12 is what one more block
costs, free of the embedding, the head and the step's edges.

The budgets are DeepSpeed's, scaled by the block: ``stage3_prefetch_bucket_size``,
``stage3_max_live_parameters``, ``stage3_max_reuse_distance`` and ``reduce_bucket_size`` as the
same multiple of one block's parameters as they are of a real model's block:

- ``llama2_7b_defaults``: DeepSpeed's defaults (5e7, 1e9, 1e9, 5e8) over LLaMA-2 7B's block of
  202.4M parameters;
- ``llama2_70b_defaults``: the same over LLaMA-2 70B's block of 855.6M (the budget under 1.2 blocks);
- ``huggingface_auto``: Hugging Face's ``auto`` values for hidden 4,096 (prefetch 0.9 h^2, reduce
  bucket h^2) with the live budget of the defaults;
- ``model_under_budget``: a model smaller than the live budget and the reuse distance (a
  sub-billion model under the defaults), with the default prefetch bucket over LLaMA-2 7B's block;
- ``under_budget_huggingface_auto``: the same with Hugging Face's ``auto`` prefetch bucket (under one linear);
- ``under_budget_small_blocks``: the same with DeepSpeed's defaults over a block of hidden 1,024
  (12.6M parameters, as OPT-350M's or a 0.4B LLaMA's): a prefetch bucket of four blocks.

memx prices ZeRO-3 from this (``--max-live-params``, ``--setup zero3``): one all-gather per
linear module a pass, and gathered weights up to the live budget plus the linear whose fetch
crosses it; a model within the budget gathered whole, in the forward only, one all-gather per
prefetch bucket (``--prefetch-bucket-params``); ``tests/test_deepspeed_fetch.py`` holds memx's
counts to this file.

Writes benchmarks/results/deepspeed_zero3_fetch.json.
Run (DeepSpeed is not a memx dependency; a virtual environment of its own):
  python -m venv /tmp/ds && /tmp/ds/bin/pip install torch==2.13.0 numpy psutil
  DS_BUILD_OPS=0 /tmp/ds/bin/pip install --no-build-isolation deepspeed==0.19.8
  DS_ACCELERATOR=cpu /tmp/ds/bin/python benchmarks/deepspeed_zero3_fetch.py   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

OUT = os.path.join(HERE, "results", "deepspeed_zero3_fetch.json")
HIDDEN, FFN, HEADS, VOCAB, SEQ = 256, 688, 4, 1000, 64  # FFN / HIDDEN as LLaMA-2 7B's 11008 / 4096
MODULES = {"q_proj": HIDDEN * HIDDEN, "k_proj": HIDDEN * HIDDEN, "v_proj": HIDDEN * HIDDEN,
           "o_proj": HIDDEN * HIDDEN, "gate_proj": HIDDEN * FFN, "up_proj": HIDDEN * FFN, "down_proj": FFN * HIDDEN}
BLOCK = sum(MODULES.values()) + 2 * HIDDEN  # and its two norms
LLAMA2_7B_BLOCK, LLAMA2_70B_BLOCK = 202_383_360, 855_654_400
SMALL_BLOCK = 12 * 1024**2 + 4 * 1024  # hidden 1,024, MLP 4,096: four attention and two MLP weights, two norms
# (prefetch bucket, max live parameters, max reuse distance, reduce bucket), in blocks.
BUDGETS = {
    "llama2_7b_defaults": tuple(x / LLAMA2_7B_BLOCK for x in (5e7, 1e9, 1e9, 5e8)),
    "llama2_70b_defaults": tuple(x / LLAMA2_70B_BLOCK for x in (5e7, 1e9, 1e9, 5e8)),
    "huggingface_auto": tuple(x / LLAMA2_7B_BLOCK for x in (0.9 * 4096**2, 1e9, 1e9, 4096**2)),
    "model_under_budget": (5e7 / LLAMA2_7B_BLOCK, 50.0, 50.0, 5e8 / LLAMA2_7B_BLOCK),
    "under_budget_huggingface_auto": (0.9 * 4096**2 / LLAMA2_7B_BLOCK, 50.0, 50.0, 5e8 / LLAMA2_7B_BLOCK),
    "under_budget_small_blocks": (5e7 / SMALL_BLOCK, 50.0, 50.0, 5e8 / SMALL_BLOCK),
}
# Budgets traced again with two micro-batches a step (gradient accumulation): what is fetched
# once a step, and what each micro-batch.
TWO_MICRO_BATCHES = ("llama2_7b_defaults", "model_under_budget")
# Traced again on four ranks with ZeRO++'s hpZ second shard over two (zero_hpz_partition_size).
HPZ = ("llama2_7b_defaults",)
LAYERS = (12, 24)
STEPS = 4


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def linear(n_in: int, n_out: int) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out, bias=False)


class Attention(torch.nn.Module):
    """q, k, v and o projections, each a module; ``fused``: one QKV module."""

    def __init__(self, hidden: int, heads: int, fused: bool):
        super().__init__()
        self.heads, self.fused = heads, fused
        if fused:
            self.qkv_proj = linear(hidden, 3 * hidden)
        else:
            self.q_proj, self.k_proj, self.v_proj = (linear(hidden, hidden) for _ in range(3))
        self.o_proj = linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.qkv_proj(x).chunk(3, -1) if self.fused else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in qkv)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attention.transpose(1, 2).reshape(b, s, h))


class MLP(torch.nn.Module):
    """SwiGLU's gate, up and down projections, each a module, and its activation; ``fused``: one
    gate-up module."""

    def __init__(self, hidden: int, ffn: int, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up_proj = linear(hidden, 2 * ffn)
        else:
            self.gate_proj, self.up_proj = linear(hidden, ffn), linear(hidden, ffn)
        self.down_proj = linear(ffn, hidden)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1) if self.fused else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act_fn(gate) * up)


class Block(torch.nn.Module):
    """Hugging Face's LlamaDecoderLayer's module tree: its attention and MLP modules, each linear
    a module of its own (DeepSpeed's hooks fire on every module, and each may prefetch)."""

    def __init__(self, hidden: int, ffn: int, heads: int, fused: bool):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(hidden), Attention(hidden, heads, fused)
        self.post_attention_layernorm, self.mlp = RMSNorm(hidden), MLP(hidden, ffn, fused)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(torch.nn.Module):
    def __init__(self, layers: int, hidden: int = HIDDEN, ffn: int = FFN, heads: int = HEADS, vocab: int = VOCAB,
                 fused: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Block(hidden, ffn, heads, fused) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = linear(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1), ids.flatten())


class CollectiveRecorder(TorchDispatchMode):
    """Each c10d collective of the last step, by pass, and by the ranks it spans (an all-gather's
    output over its input); the most parameters gathered at one, and ZeRO++'s second shard."""

    def __init__(self, model):
        super().__init__()
        self.model, self.phase, self.counts, self.by_ranks, self.peak, self.secondary = model, None, {}, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.phase and name.startswith("c10d."):
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
            key = f"{self.phase} {name.split('.')[1].strip('_')}"
            self.counts[key] = self.counts.get(key, 0) + 1
            if "allgather" in name:
                output, source = (a for a in args[:2])
                spanned = f"{key} over {round(output.numel() / source.numel())}"
                self.by_ranks[spanned] = self.by_ranks.get(spanned, 0) + 1
            params = list(self.model.parameters())
            gathered = sum(p.ds_numel for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE)
            self.peak = max(self.peak, gathered)
            self.secondary = max(self.secondary, sum(p.ds_secondary_tensor.numel() for p in params
                                                     if getattr(p, "ds_secondary_tensor", None) is not None))
        return func(*args, **(kwargs or {}))


def run_rank(rank: int, layers: int, budget: tuple, micro_batches: int, ranks: int, hpz: int, port: int,
             out: str) -> None:
    import deepspeed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    prefetch, live, reuse, reduce = (int(x * BLOCK) for x in budget)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": hpz,
                                    "stage3_prefetch_bucket_size": prefetch, "stage3_max_live_parameters": live,
                                    "stage3_max_reuse_distance": reuse, "reduce_bucket_size": reduce},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Model(layers)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = torch.randint(0, VOCAB, (1, SEQ))
    recorder = CollectiveRecorder(model)
    with recorder:
        for step in range(STEPS):
            last = step == STEPS - 1
            for _ in range(micro_batches):  # the engine steps the optimizer after the last
                recorder.phase = "forward" if last else None
                loss = engine(ids)
                recorder.phase = "backward" if last else None
                engine.backward(loss)
                recorder.phase = None
                engine.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"counts": recorder.counts, "by_ranks": recorder.by_ranks, "peak_gathered_params": recorder.peak,
                       "second_shard_params": recorder.secondary}, f)
    dist.barrier()


def trace(layers: int, budget: tuple, micro_batches: int, ranks: int, hpz: int, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace.json")
        mp.spawn(run_rank, args=(layers, budget, micro_batches, ranks, hpz, port, out), nprocs=ranks)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    import deepspeed
    results, port = {}, 29600
    # (result, budget, micro-batches a step, ranks, ZeRO++'s hpZ shard)
    runs_asked = [(name, budget, 1, 2, 1) for name, budget in BUDGETS.items()]
    runs_asked += [(f"{name}_two_micro_batches", BUDGETS[name], 2, 2, 1) for name in TWO_MICRO_BATCHES]
    runs_asked += [(f"{name}_hpz_2_of_4", BUDGETS[name], 1, 4, 2) for name in HPZ]
    for result, budget, micro_batches, ranks, hpz in runs_asked:
        runs = {}
        for layers in LAYERS:
            port += 1
            runs[layers] = trace(layers, budget, micro_batches, ranks, hpz, port)
            print(f"{result} {layers} blocks: {runs[layers]}", flush=True)

        def per_block(key):
            few, many = (runs[n][key] for n in LAYERS)
            return {k: (many.get(k, 0) - few.get(k, 0)) / (LAYERS[1] - LAYERS[0]) for k in many}
        results[result] = {
            "blocks_of_prefetch_bucket_live_reuse_reduce_bucket": [round(x, 4) for x in budget],
            "micro_batches_a_step": micro_batches, "ranks": ranks, "hpz_partition_size": hpz,
            "per_block": per_block("counts"), "per_block_by_ranks": per_block("by_ranks"),
            "last_step": {str(n): runs[n]["counts"] for n in LAYERS},
            "peak_gathered_blocks": {str(n): round(runs[n]["peak_gathered_params"] / BLOCK, 4) for n in LAYERS},
            "second_shard_blocks": {str(n): round(runs[n]["second_shard_params"] / BLOCK, 4) for n in LAYERS}}
    write_json_atomic(OUT, {
        "what": "DeepSpeed ZeRO-3's collectives per block and pass in the last step (summed over its "
                "micro-batches), and its most parameters gathered, traced on CPU",
        "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "model": {"hidden": HIDDEN, "ffn": FFN, "heads": HEADS, "vocab": VOCAB, "seq": SEQ, "block_params": BLOCK,
                  "linear_modules": MODULES},
        "budgets": results, "machine": machine_info()}, overwrite=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
