from dataclasses import replace

import pytest

from memx_launch import profiler
from memx_launch.errors import ConfigError
from memx_launch.profiledb import Measurement
from memx_launch.profiler import (PARAMETERS, ProfileSpace, Sample, ablation_samples, calibrate,
                                  minimal_sample_set, three_point_design)
from memx_launch.specs import MODEL_CATALOG, DeviceType

SPEC = MODEL_CATALOG["llama-tiny"]
CPU = DeviceType(name="cpu", vendor="cpu", memory_gib=8, peak_tflops=0.1, efficiency=1.0)
FIVE = {"tp": (1, 2, 4), "micro_batch_size": (1, 2, 4, 8), "seq_len": (32, 64, 128), "recompute": ("none", "selective", "full"),
        "num_kv_heads": (1, 2, 4)}


def space(values=FIVE):
    return ProfileSpace(values, Sample(tp=values["tp"][0], micro_batch_size=2, seq_len=64, recompute="none",
                                       num_kv_heads=2))


def fake_measure(flat=()):
    """Time and memory grow with every parameter except those in ``flat``."""
    def measure(samples):
        out = []
        for s in samples:
            scale = 1.0
            for name in PARAMETERS:
                if name in flat:
                    continue
                value = getattr(s, name)
                scale *= (1 + ("none", "selective", "full").index(value)) if name == "recompute" else value
            out.append(Measurement(device_type="cpu", device={"vendor": "cpu", "memory_gib": 8.0, "peak_tflops": 0.1},
                                   model=SPEC.name, model_signature=SPEC.signature(), block_shape=SPEC.to_dict(),
                                   tp=s.tp, micro_batch_size=s.micro_batch_size, seq_len=s.seq_len,
                                   recompute=s.recompute, dtype="fp32", num_blocks=1, feasible=True,
                                   time_s=scale, peak_memory_bytes=scale))
        return out
    return measure


def test_five_parameters_all_high_impact_measure_at_most_243():
    result = minimal_sample_set(space(), fake_measure())
    assert result.design_count == 243 and result.measured_count <= 243
    assert result.full_grid_size == 3 * 4 * 3 * 3 * 3
    assert "of a full grid of 324" in result.summary()


def test_ablation_fixes_low_impact_parameters():
    result = minimal_sample_set(space(), fake_measure(flat=("num_kv_heads",)))
    impact = {p.name: p.high for p in result.impact}
    assert impact["num_kv_heads"] is False and sum(impact.values()) == 4
    assert result.design_count == 81 and result.measured_count < 243
    assert "num_kv_heads" not in result.design_parameters


def test_budget_drops_the_least_impactful_parameter_first():
    result = minimal_sample_set(space(), fake_measure(), budget=60)
    assert result.measured_count <= 60
    change = {p.name: p.time_change for p in result.impact}
    kept = min(change[n] for n in result.design_parameters)
    assert result.dropped_for_budget and all(change[n] <= kept for n in result.dropped_for_budget)
    with pytest.raises(ConfigError, match="--budget"):
        minimal_sample_set(space(), fake_measure(), budget=3)


def test_ablation_varies_one_parameter_at_a_time():
    samples = ablation_samples(space())
    # tp and recompute defaults are their minimum: one extra point each, two for the others.
    assert samples[0] == space().default and len(samples) == 1 + 1 + 2 + 2 + 1 + 2
    for s in samples[1:]:
        assert sum(getattr(s, p) != getattr(space().default, p) for p in PARAMETERS) == 1


def test_three_point_design_uses_min_mid_max():
    impact = [profiler.ParameterImpact(p, 1.0, 1.0, p == "micro_batch_size") for p in PARAMETERS]
    samples, names, _ = three_point_design(space(), impact)
    # The default (2) lies inside the range, so it is the mid point.
    assert names == ["micro_batch_size"] and sorted(s.micro_batch_size for s in samples) == [1, 2, 8]


def test_calibration_kernel_measures_time_and_memory_on_cpu():
    samples = [Sample(1, 1, 16, level, SPEC.num_kv_heads) for level in ("none", "selective", "full")]
    none, selective, full = calibrate(SPEC, CPU, samples, repeats=3)
    for m in (none, selective, full):
        assert m.feasible and m.time_s > 0 and m.time_spread_s >= 0 and not m.emulated
    # Full recompute keeps only the block inputs: the least memory.
    assert full.peak_memory_bytes < selective.peak_memory_bytes <= none.peak_memory_bytes
    (slow,) = calibrate(SPEC, CPU, samples[:1], repeats=1, emulation_slowdown=4.0)
    assert slow.emulated and slow.emulation_slowdown == 4.0


def test_out_of_memory_is_stored_as_an_infeasible_point(monkeypatch):
    def oom(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(profiler, "_run_sample", oom)
    (m,) = calibrate(SPEC, CPU, [Sample(1, 64, 4096, "none", SPEC.num_kv_heads)])
    assert not m.feasible and m.time_s is None


def test_tp_sample_needs_a_tp_group():
    with pytest.raises(ConfigError, match="TP group has 1 rank"):
        calibrate(SPEC, CPU, [Sample(2, 1, 16, "none", SPEC.num_kv_heads)])


def test_space_rejects_a_default_outside_its_values():
    with pytest.raises(ConfigError, match="profile_space.seq_len"):
        ProfileSpace(FIVE, replace(space().default, seq_len=48))


def test_memx_profile_prints_ablation_and_counts_and_appends(tmp_path, capsys):
    from memx_launch.cli import main
    from memx_launch.profiledb import ProfileDB

    out = tmp_path / "profile.jsonl"
    code = main(["profile", "--model", "llama-tiny", "--out", str(out), "--max-micro-batch", "2",
                 "--seq-lens", "16,32", "--repeats", "1", "--num-blocks", "1", "--budget", "12", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "ablation (threshold 10%" in printed and "of a full grid of" in printed
    assert "tp                one value in the space: fixed" in printed
    records = ProfileDB(str(out)).read()
    assert 0 < len(records) <= 12 and all(r.model == "llama-tiny" for r in records)


def test_memx_profile_needs_a_device_type_for_a_mixed_cluster(tmp_path, capsys):
    from memx_launch.cli import main

    cluster = tmp_path / "mixed.yaml"
    cluster.write_text("version: 1\ndevice_types:\n  a: {memory_gib: 1, peak_tflops: 1}\n"
                       "  b: {memory_gib: 2, peak_tflops: 1}\nnodes:\n  - devices: {a: 1, b: 1}\n"
                       "    intra_node_gbps: 10\n")
    code = main(["profile", "--model", "llama-tiny", "--cluster", str(cluster)])
    assert code == 2
    assert "--device-type: mixed has 2 device types; pass --device-type with one of a, b" in capsys.readouterr().err


def _tp_calibration_worker(rank, port, queue):
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        samples = [Sample(2, 1, 16, "none", SPEC.num_kv_heads), Sample(2, 1, 16, "full", SPEC.num_kv_heads)]
        out = calibrate(SPEC, CPU, samples, tp_group=dist.group.WORLD, repeats=2, tp_link_gbps=2.0)
        queue.put((rank, [(m.tp, m.feasible, m.time_s, m.peak_memory_bytes, m.tp_link_gbps) for m in out]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_calibration_kernel_runs_tensor_parallel_over_a_group():
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_calibration_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        (tp, feasible, time_s, peak, link), (_, _, _, full_peak, _) = results[rank]
        assert tp == 2 and feasible and time_s > 0 and link == 2.0
        assert full_peak < peak
