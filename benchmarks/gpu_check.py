"""GPU check: the paths that only run on a GPU, on one GPU, in under five minutes.

    python benchmarks/gpu_check.py            # writes benchmarks/results/gpu_check.json

1. Calibration of llama2-7b blocks in bf16 with memx's real kernel (CUDA-event timing, the
   host's time to issue a block, allocated and reserved peaks), against the analytical model's
   time and activation memory.
2. The memory monitor's NVML reading against torch.cuda's (device total, this process's use).
3. The cross-vendor path: two processes on this GPU as two communication domains (each its own
   native group), a CUDA tensor summed between them over the bridge (staged to pinned host
   memory and back), and strict mode refusing a CUDA tensor sent over the bridge unstaged.
4. The matmul rates memx's defaults assume: an 8,192-cube GEMM's TFLOPS in bf16, in fp32 with TF32
   off and in fp32 as TF32 (``BEST_MATMUL_SHARE``, ``FP32_MATMUL_SHARE``, TF32 at half the 16-bit
   peak); then 10 s of bf16 GEMMs back to back with NVML's SM clock and board power: whether a
   large matmul settles at the power limit, as memx's power-limit model takes it
   (``power_limited_clock_share``), and the clock and rate it settles at.
5. The memory bandwidth memx times memory-bound work at: a copy and a STREAM triad over 1 GiB
   arrays, GB/s, against the datasheet figure of an H100 or H200 at NVIDIA's sustained share
   (``peaks.SUSTAINED_HBM_SHARE``, from public BabelStream runs).
6. GEMMs by shape: each shape's TFLOPS in bf16 and, on an FP8 GPU, in FP8 (``torch._scaled_mm``)
   as a share of the same precision's 8,192 cube, against the share memx's roofline by shape
   gives it (``planning/matmuls.py``: tiles, waves, split-K, a tile's fill of ``K_FILL`` at the
   16-bit rate and twice that at FP8's) at the measured cube rates, SM count and copy bandwidth.
7. ``memx-run`` of a 1.1B-parameter LLaMA (TinyLlama's shape, ``tinyllama-1.1b``) on this GPU:
   calibration in the job, the plan, 10 training steps; predicted against measured peak memory
   (the device memory the process held, runtime/monitor.py), step time and the stage's compute
   per micro-batch (CUDA events, runtime/stage_clock.py), from the script's per-step lines.

Without a CUDA GPU it stops at once with one line and exit code 1 (nothing is written).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "benchmarks", "results", "gpu_check.json")
RUN_MODEL = "tinyllama-1.1b"
RUN_STEPS = 10
RUN_TIMEOUT_S = 240
# mbs x seq of the llama2-7b blocks measured, and their recompute levels
CALIBRATION_POINTS = [(1, 4096, "none"), (2, 4096, "none"), (1, 4096, "full"), (1, 2048, "selective")]


# Datasheet memory bandwidth (GB/s) of the GPUs this check is lent, by a word of their name.
DATASHEET_HBM_GBPS = {"H200": 4800, "H100": 3350, "A100-SXM4-80GB": 2039, "A100-SXM4-40GB": 1555}


def datasheet_gbps(name: str) -> int | None:
    """The datasheet memory bandwidth of a GPU named ``name`` (:data:`DATASHEET_HBM_GBPS`), or None."""
    return next((gbps for word, gbps in DATASHEET_HBM_GBPS.items() if word in name), None)


def _error(message: str) -> int:
    print(f"gpu_check: error: {message}", file=sys.stderr)
    return 1


def calibration_check() -> list[dict]:
    import torch

    from memx_launch.planning.costmodel import AnalyticalCostModel
    from memx_launch.planning.plan import RECOMPUTE_LEVELS
    from memx_launch.profiling.kernel import calibrate, compute_capability
    from memx_launch.profiling.space import Sample
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.catalog import get_model
    from memx_launch.specs.training import TrainingSpec

    model = get_model("llama2-7b")
    props = torch.cuda.get_device_properties(0)
    # The analytical model's view of this GPU: its capacity and compute capability, the peak the
    # file would declare for an H200/H100 (989 dense bf16 TFLOPS), its datasheet memory bandwidth
    # (H200's 4.8 TB/s for a GPU not in the table), the default efficiency.
    cluster = ClusterSpec.from_dict({"version": 1, "name": "this-gpu", "device_types": {"gpu": {
        "vendor": "nvidia", "memory_gib": round(props.total_memory / 2**30, 1), "peak_tflops": 989,
        "memory_bandwidth_gbps": datasheet_gbps(props.name) or DATASHEET_HBM_GBPS["H200"],
        "compute_capability": compute_capability(props)}},
        "nodes": [{"devices": {"gpu": 1}, "intra_node_gbps": 450}]})
    device_type = cluster.device_type("gpu")
    samples = [Sample(tp=1, micro_batch_size=m, seq_len=s, recompute=r, num_kv_heads=model.num_kv_heads)
               for m, s, r in CALIBRATION_POINTS]
    measured = calibrate(model, device_type, samples, device="cuda", dtype="bf16", num_blocks=1, repeats=5)
    rows = []
    for s, m in zip(samples, measured):
        analytical = AnalyticalCostModel(model, cluster, TrainingSpec(seq_len=s.seq_len, dtype="bf16")).layer_costs(
            0, 1, s.micro_batch_size, s.seq_len, RECOMPUTE_LEVELS.index(s.recompute))
        rows.append({
            "micro_batch_size": s.micro_batch_size, "seq_len": s.seq_len, "recompute": s.recompute,
            "feasible": m.feasible, "time_ms": None if m.time_s is None else round(m.time_s * 1e3, 3),
            "time_spread_ms": None if m.time_spread_s is None else round(m.time_spread_s * 1e3, 3),
            "host_ms": None if m.host_time_s is None else round(m.host_time_s * 1e3, 3),
            "peak_allocated_gib": None if m.peak_memory_bytes is None else round(m.peak_memory_bytes / 2**30, 3),
            "peak_reserved_gib": None if m.peak_reserved_bytes is None else round(m.peak_reserved_bytes / 2**30, 3),
            "analytical_time_ms": round(float(analytical.time_s) * 1e3, 3),
            "analytical_activation_plus_working_gib": round(
                float(analytical.activation_bytes + analytical.working_bytes) / 2**30, 3)})
    return rows


def _mean_seconds(run, device: str, repeats: int) -> float:
    """Mean seconds of ``run()`` over ``repeats`` calls after two warm-up calls, the device
    synchronised around them."""
    import torch

    for _ in range(2):
        run()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def matmul_rates(device: str = "cuda", n: int = 8192, repeats: int = 10) -> dict:
    """TFLOPS of an n x n x n GEMM in bf16, in fp32 with TF32 off and in fp32 as TF32: what
    memx's defaults assume of this GPU (the best bf16 matmul's share of the peak,
    ``BEST_MATMUL_SHARE``; fp32 CUDA-core GEMMs at ``FP32_MATMUL_SHARE`` of the fp32 peak; TF32
    at half the 16-bit peak), measured."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    out = {}
    try:
        for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                                  ("tf32", torch.float32, True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            out[name] = round(2.0 * n ** 3 / _mean_seconds(lambda: a @ b, device, repeats) / 1e12, 3)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return out


# (M, N, K) of the GEMM-shape check: the cube (each precision's best rate) first; a small model's
# thin K (hidden 1,024-2,048), a short micro-batch's thin M, a weight gradient's small output with
# deep K (split-K), a layer's wide MLP GEMM.
GEMM_SHAPES = ((8192, 8192, 8192), (16384, 4096, 1024), (16384, 4096, 2048), (512, 4096, 4096),
               (1024, 256, 16384), (8192, 28672, 8192))


def gemm_shapes(device: str = "cuda", shapes=GEMM_SHAPES, repeats: int = 10, fp8: bool = True, sms: int = 132,
                copy_gbps: float = 3000.0) -> list[dict]:
    """Per precision (bf16; FP8 through ``torch._scaled_mm`` with ``fp8``) and shape, the measured
    TFLOPS and share of that precision's first shape's rate, beside the share memx's
    :func:`~memx_launch.planning.matmuls.gemm_seconds` gives the shape at the first shape's
    measured rate, ``sms`` SMs and ``copy_gbps`` (the fill's depth from the two precisions' rates)."""
    import torch

    from memx_launch.planning.matmuls import fill_depth, gemm_seconds

    def bf16(m, n, k):
        a, b = torch.randn(m, k, device=device, dtype=torch.bfloat16), torch.randn(k, n, device=device,
                                                                                  dtype=torch.bfloat16)
        return _mean_seconds(lambda: a @ b, device, repeats)

    def float8(m, n, k):  # _scaled_mm takes A row-major and B column-major
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device=device)
        return _mean_seconds(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                             device, repeats)

    runs = [("bf16", bf16, 2.0)] + ([("fp8", float8, 1.0)] if fp8 else [])
    measured = {name: [(m, n, k, 2.0 * m * n * k / run(m, n, k)) for m, n, k in shapes] for name, run, _ in runs}
    rows = []
    for name, _, operand_bytes in runs:
        best = measured[name][0][3]
        fill = float(fill_depth(best, measured["bf16"][0][3]))
        for m, n, k, rate in measured[name]:
            predicted = float(gemm_seconds(m, n, k, best, copy_gbps * 1e9, sms, operand_bytes, fill))
            rows.append({"dtype": name, "m": m, "n": n, "k": k, "tflops": round(rate / 1e12, 3),
                         "measured_share": round(rate / best, 3),
                         "predicted_share": round(2.0 * m * n * k / predicted / best, 3)})
    return rows


def stream_bandwidth(device: str = "cuda", mib: int = 1024, repeats: int = 10) -> dict:
    """GB/s of a copy (read one array, write one) and a STREAM triad (a = b + s c: read two, write
    one) over fp32 arrays of ``mib`` MiB each, the best of ``repeats``; on a GPU of
    :data:`DATASHEET_HBM_GBPS` also their share of its datasheet figure, against the share memx
    takes (``SUSTAINED_HBM_SHARE``)."""
    import torch

    from memx_launch.planning.peaks import SUSTAINED_HBM_SHARE

    n = mib * 2**20 // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))

    def best(kernel, arrays: int) -> float:
        seconds = []
        for _ in range(repeats + 1):  # the first also warms up
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            kernel()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        return round(arrays * n * 4 / min(seconds[1:]) / 1e9, 1)

    out = {"copy_gbps": best(lambda: a.copy_(b), 2), "triad_gbps": best(lambda: torch.add(b, c, alpha=3.0, out=a), 3)}
    datasheet = datasheet_gbps(torch.cuda.get_device_properties(0).name) if device == "cuda" else None
    if datasheet:
        out.update(datasheet_gbps=datasheet, triad_share=round(out["triad_gbps"] / datasheet, 3),
                   memx_share=SUSTAINED_HBM_SHARE["nvidia"])
    return out


def sustained_matmul(seconds: float = 10.0, n: int = 8192) -> dict:
    """bf16 GEMMs back to back for ``seconds``, NVML's SM clock and board power sampled after each
    batch: whether a large matmul settles at the power limit (what memx's power-limit model takes,
    ``power_limited_clock_share``), the clock it settles at and the rate it keeps there against
    the first batch's."""
    import torch

    from memx_launch.profiling.kernel import nvml_device

    pynvml, handle = nvml_device(0)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rates, clocks, watts = [], [], []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        rates.append(2.0 * n ** 3 * 20 / (time.perf_counter() - t0) / 1e12)
        clocks.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
        watts.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
    tail = slice(len(rates) // 2, None)  # the settled second half
    return {"power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
            "max_power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)[1] / 1e3,
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "first_tflops": round(rates[0], 1), "settled_tflops": round(statistics.median(rates[tail]), 1),
            "settled_sm_clock_mhz": statistics.median(clocks[tail]),
            "settled_power_w": round(statistics.median(watts[tail]), 1), "batches": len(rates)}


def nvml_check() -> dict:
    import torch

    from memx_launch.profiling.kernel import nvml_device
    from memx_launch.runtime.monitor import memory_reader

    device = torch.device("cuda", 0)
    hold = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)  # 2 GiB held, so both see something
    torch.cuda.synchronize(device)
    reader = memory_reader(device=device)
    reading = reader.read()
    pynvml, handle = nvml_device(0)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
    free, total = torch.cuda.mem_get_info(device)
    result = {
        "nvml_total_gib": round(info.total / 2**30, 3), "torch_total_gib": round(total / 2**30, 3),
        "nvml_used_gib": round(info.used / 2**30, 3), "torch_used_gib": round((total - free) / 2**30, 3),
        "nvml_this_process_gib": round(mine[0] / 2**30, 3) if mine and mine[0] else None,
        "torch_reserved_gib": round(torch.cuda.memory_reserved(device) / 2**30, 3),
        "monitor_capacity_gib": round(reading.capacity_bytes / 2**30, 3),
        "monitor_peak_gib": round(reading.peak_bytes / 2**30, 3),
    }
    if result["nvml_this_process_gib"] is not None:  # the CUDA context and libraries, outside the allocator
        result["context_overhead_gib"] = round(result["nvml_this_process_gib"] - result["torch_reserved_gib"], 3)
    else:
        result["note"] = "NVML lists no process with this PID (a container's PID namespace): per-process use unseen"
    del hold
    torch.cuda.empty_cache()
    return result


STEP = re.compile(r"^step (\d+) \| loss ([0-9.]+) \| ([0-9.]+) s/step \(predicted ([0-9.]+)\).*?"
                  r"s0 [^:]+: mem ([0-9.]+)/([0-9.]+) MiB, mb ([0-9.]+)/([0-9.]+) ms", re.M)


BRIDGE_BYTES = 64 * 2**20


def _bridge_worker(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from memx_launch.runtime.communication import Communicator, DomainViolation

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)  # two domains: the default group is the bridge
    comm = Communicator(["domain-a", "domain-b"], torch.device("cuda", 0), strict=True)
    value = torch.full((BRIDGE_BYTES // 4,), float(rank + 1), device="cuda")
    comm.all_reduce_sum(value, [0, 1])  # warm-up
    value.fill_(rank + 1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    comm.all_reduce_sum(value, [0, 1])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    refused = False
    with comm.strict_check():
        try:
            dist.all_reduce(value, group=dist.group.WORLD)
        except DomainViolation:
            refused = True
    queue.put((rank, {"sum_ok": bool((value == 3).all().item()), "seconds": seconds, "unstaged_refused": refused}))
    dist.barrier()
    dist.destroy_process_group()


def bridge_check() -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_bridge_worker, args=(r, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    worst = max(r["seconds"] for r in results.values())
    return {"bytes": BRIDGE_BYTES, "sum_ok": all(r["sum_ok"] for r in results.values()),
            "unstaged_refused": all(r["unstaged_refused"] for r in results.values()),
            "all_reduce_s": round(worst, 4), "effective_gbps": round(BRIDGE_BYTES / worst / 1e9, 3),
            "exit_codes": [proc.exitcode for proc in procs]}


def memx_run_check(workdir: str) -> dict:
    argv = [sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "1", "--max-restarts", "0",
            "--run-dir", os.path.join(workdir, "run"), "--profile-db", os.path.join(workdir, "profiles.jsonl"),
            "--global-batch-size", "8", "--seq-len", "2048", "--no-replan",
            os.path.join(ROOT, "examples", "train.py"), "--model", RUN_MODEL, "--steps", str(RUN_STEPS), "--synthetic"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": ROOT})
    steps = [dict(zip(("step", "loss", "step_s", "predicted_step_s", "peak_mib", "predicted_peak_mib",
                       "microbatch_ms", "predicted_microbatch_ms"), (int(m[0]), *map(float, m[1:]))))
             for m in STEP.findall(proc.stdout)]
    result = {"command": " ".join(argv[2:]), "exit_code": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
              "steps": steps, "plan": [l for l in proc.stdout.splitlines() if l.startswith("winner:")]}
    if proc.returncode != 0 or not steps:
        result["stderr_tail"] = proc.stderr[-3000:]
        return result
    later = steps[1:] or steps  # the first step includes warm-up
    measured_step = sorted(s["step_s"] for s in later)[len(later) // 2]
    peak = max(s["peak_mib"] for s in steps)
    microbatch = sorted(s["microbatch_ms"] for s in later)[len(later) // 2]  # stage 0's, CUDA events
    result.update(measured_median_step_s=measured_step, predicted_step_s=steps[0]["predicted_step_s"],
                  step_time_error=round(steps[0]["predicted_step_s"] / measured_step - 1, 4),
                  measured_peak_mib=peak, predicted_peak_mib=steps[0]["predicted_peak_mib"],
                  peak_memory_error=round(steps[0]["predicted_peak_mib"] / peak - 1, 4),
                  measured_median_microbatch_ms=microbatch,
                  predicted_microbatch_ms=steps[0]["predicted_microbatch_ms"],
                  microbatch_time_error=round(steps[0]["predicted_microbatch_ms"] / microbatch - 1, 4))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=OUT, help=f"results file (default {os.path.relpath(OUT, ROOT)})")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        return _error("no CUDA GPU here (torch.cuda.is_available() is False); run this on a machine with an "
                      "NVIDIA GPU and a CUDA build of torch")
    from benchmarks.machine import machine_info
    from memx_launch.files import write_json_atomic

    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    result = {"machine": machine_info(),
              "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 2),
                         "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
                         "cuda": torch.version.cuda}}
    result["calibration_llama2_7b_bf16"] = calibration_check()
    print(f"calibration: {result['calibration_llama2_7b_bf16']}", flush=True)
    result["nvml_vs_torch"] = nvml_check()
    print(f"nvml vs torch: {result['nvml_vs_torch']}", flush=True)
    result["bridge"] = bridge_check()
    print(f"bridge: {result['bridge']}", flush=True)
    result["matmul_tflops"] = matmul_rates()
    print(f"matmul TFLOPS: {result['matmul_tflops']}", flush=True)
    result["sustained_matmul"] = sustained_matmul()
    print(f"sustained matmul: {result['sustained_matmul']}", flush=True)
    result["memory_bandwidth"] = stream_bandwidth()
    print(f"memory bandwidth: {result['memory_bandwidth']}", flush=True)
    result["gemm_shapes"] = gemm_shapes(fp8=(props.major, props.minor) >= (8, 9), sms=props.multi_processor_count,
                                        copy_gbps=result["memory_bandwidth"]["copy_gbps"])
    print(f"GEMM shapes: {result['gemm_shapes']}", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        result["memx_run"] = memx_run_check(workdir)
    print(f"memx-run: exit {result['memx_run']['exit_code']}, {len(result['memx_run']['steps'])} steps", flush=True)
    result["total_s"] = round(time.perf_counter() - started, 1)
    write_json_atomic(args.out, result, overwrite=True)
    print(f"written to {args.out} in {result['total_s']} s")
    return 0 if result["memx_run"]["exit_code"] == 0 and result["memx_run"]["steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
