"""Step time with and without the memory monitor on a real training loop.

2 gloo ranks, llama-tiny in a 2-stage 1F1B pipeline with the runtime's emulated devices (the
monitor's CPU reader), the monitor at its default interval. Steps alternate in blocks between
"monitor on" and "monitor off" so that drift from other load on the machine hits both alike;
the result is the difference of the medians, and, separately, the measured cost of
``after_step`` itself (its sampled calls and the free ones) per step.

    python benchmarks/monitor_overhead.py [--steps 240] [--block 10]

Writes benchmarks/results/monitor_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memx_launch.runtime.monitor import MonitorConfig
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.files import write_json_atomic
from memx_launch.specs.catalog import get_model

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "monitor_overhead.json")
MODEL = "llama-tiny"


def make_plan() -> Plan:
    spec = get_model(MODEL)
    stages = [StagePlan("cpu", [0], 4, "none", 0.05, 0.0, 1.0), StagePlan("cpu", [1], 4, "selective", 0.05, 0.0, 1.0)]
    plan = Plan(MODEL, spec, "bench", 1, 2, 1, 1, 8, 64, "1f1b", 1, stages, 0.0,
                Objective(1.0, "default", (0.4, 0.2, 0.4)))
    plan.validate()
    return plan


def _worker(rank, port, steps, block, queue):
    import torch.distributed as dist
    from memx_launch.runtime.monitor import MemoryMonitor, MonitorConfig, memory_reader
    from memx_launch.runtime.training import Runtime
    from memx_launch.profiling.emulation import EmulatedDevice

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    plan = make_plan()
    runtime = Runtime(plan, rank, emulated=EmulatedDevice("cpu", memory_gib=1.0))
    config = MonitorConfig(above_prediction=100.0)  # default interval; never fires here
    monitor = MemoryMonitor(plan, rank, memory_reader(emulated=runtime.emulated), config)
    gen = torch.Generator().manual_seed(0)
    on, off, hook = [], [], []
    for step in range(1, steps + 1 + block):  # the first block warms up and is dropped
        tokens = torch.randint(0, plan.model_spec.vocab_size, (plan.global_batch_size, plan.seq_len + 1), generator=gen)
        monitored = (step // block) % 2 == 1
        start = time.perf_counter()
        runtime.step(runtime.local_batch(tokens[:, :-1]), runtime.local_batch(tokens[:, 1:]))
        if monitored:
            t0 = time.perf_counter()
            monitor.after_step(step)
            hook.append((time.perf_counter() - t0, step % config.interval == 0))
        elapsed = time.perf_counter() - start
        if step > block:
            (on if monitored else off).append(elapsed)
    queue.put((rank, on, off, hook, config.interval))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--block", type=int, default=10)
    args = p.parse_args()
    machine = machine_info()
    interval = MonitorConfig().interval
    if args.block % interval:
        p.error(f"--block must be a multiple of the monitor interval ({interval}) so every monitored block samples")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.steps, args.block, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=900) for _ in procs))
    for proc in procs:
        proc.join()
    on, off, hook, interval = results[0]
    med_on, med_off = statistics.median(on), statistics.median(off)
    hook_per_step = statistics.fmean(t for t, _ in hook)
    sampled = [t for t, was_sampled in hook if was_sampled]
    result = {
        "machine": machine, "model": MODEL, "ranks": 2, "pipeline": "2 stages, 1F1B, 8 micro-batches, emulated CPU devices",
        "monitor_interval_steps": interval, "block_steps": args.block, "sampled_steps": len(sampled), "steps_with_monitor": len(on), "steps_without_monitor": len(off),
        "median_step_s_with_monitor": med_on, "median_step_s_without_monitor": med_off,
        "overhead_of_medians": med_on / med_off - 1,
        "after_step_mean_s_per_step": hook_per_step,
        "after_step_share_of_median_step": hook_per_step / med_off,
        "after_step_median_s_on_sampled_steps": statistics.median(sampled),
        "goal": "under 1% per training step",
        "note": "overhead_of_medians mixes in the noise of a shared 2-core machine; after_step_share_of_median_step "
                "is the monitor's own measured cost (sampled steps' read + all_gather averaged over all steps)",
    }
    write_json_atomic(OUT, result, overwrite=True)
    for k, v in result.items():
        print(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
