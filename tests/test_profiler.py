import math
from dataclasses import replace

import numpy as np
import pytest

from memx_launch.planning.tp_links import TpLink
from memx_launch.profiling import design, kernel
from memx_launch.errors import ConfigError
from memx_launch.profiling.profiledb import Measurement
from memx_launch.profiling.space import PARAMETERS, ProfileSpace, Sample
from memx_launch.profiling.design import ablation_samples, minimal_sample_set, three_point_design
from memx_launch.profiling.refinement import analytical_log_ratios
from memx_launch.profiling.kernel import calibrate
from memx_launch.specs.catalog import MODEL_CATALOG
from memx_launch.specs.cluster import DeviceType

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
    # docs/profiler.md: the design is 3^5; refinement adds at most a third of it (where this
    # fixture's plain products bend away from the GEMM-by-shape analytical trends)
    assert result.design_count == 243 and result.refinement_budget == 81
    assert result.measured_count <= 243 + len(result.refinements) and len(result.refinements) <= 81
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
    with pytest.raises(ConfigError, match="--budget: must be 1 or more"):
        minimal_sample_set(space(), fake_measure(), budget=0)


def test_budget_below_the_ablation_measures_each_tp_degree_then_micro_batch_extremes():
    measured = []

    def measure(samples):
        measured.extend(samples)
        return fake_measure()(samples)

    result = minimal_sample_set(space(), measure, budget=5)
    assert result.few_sample and result.measured_count == len(measured) == 5
    # One sample per TP degree at the default micro-batch, then the micro-batches farthest from it.
    assert [(s.tp, s.micro_batch_size) for s in measured] == [(1, 2), (2, 2), (4, 2), (1, 8), (1, 1)]
    assert all(s.seq_len == 64 and s.recompute == "none" for s in measured)
    assert "few-sample profile" in result.summary()


def test_new_type_design_covers_every_level_before_spreading():
    configs = [(model, tp, mbs) for model in "ab" for tp in (1, 2, 4) for mbs in (1, 2, 4, 8, 16)]
    chosen = design.new_type_design(configs, 5, levels=lambda c: (c[0], c[1]),
                                      centre=lambda c: abs(math.log2(c[2]) - 2), position=lambda c: math.log2(c[2]),
                                      group=lambda c: c[0])
    assert {c[0] for c in chosen[:3]} == {"a", "b"} and {c[1] for c in chosen[:3]} == {1, 2, 4}
    assert all(c[2] == 4 for c in chosen[:3])  # nearest the centre while covering
    assert {c[2] for c in chosen[3:]} == {1, 16}  # then the far ends of micro-batch
    assert len(design.new_type_design(configs[:2], 5, levels=lambda c: (c[1],), centre=lambda c: 0,
                                        position=lambda c: 0)) == 2


def test_ablation_varies_one_parameter_at_a_time():
    samples = ablation_samples(space())
    # tp and recompute defaults are their minimum: one extra point each, two for the others.
    assert samples[0] == space().default and len(samples) == 1 + 1 + 2 + 2 + 1 + 2
    for s in samples[1:]:
        assert sum(getattr(s, p) != getattr(space().default, p) for p in PARAMETERS) == 1


def test_three_point_design_uses_min_mid_max():
    impact = [design.ParameterImpact(p, 1.0, 1.0, p == "micro_batch_size") for p in PARAMETERS]
    samples, names, _ = three_point_design(space(), impact)
    # The default (2) lies inside the range, so it is the mid point.
    assert names == ["micro_batch_size"] and sorted(s.micro_batch_size for s in samples) == [1, 2, 8]


def tp_mbs_space(tp=(1, 2, 4, 8), mbs=(1, 2, 4, 8, 16)):
    """TP and micro-batch vary, everything else fixed; defaults at the middle values."""
    values = {"tp": tp, "micro_batch_size": mbs, "seq_len": (64,), "recompute": ("none",),
              "num_kv_heads": (SPEC.num_kv_heads,)}
    return ProfileSpace(values, Sample(tp=tp[len(tp) // 2], micro_batch_size=mbs[len(mbs) // 2], seq_len=64,
                                       recompute="none", num_kv_heads=SPEC.num_kv_heads))


def physical_measure(time_factor, infeasible=()):
    """Measurements that are the analytical model's time times ``time_factor(sample)`` (memory
    exactly analytical): the ratio the refinement judges is the factor itself."""
    def measure(samples):
        out = []
        for s in samples:
            unit = Measurement(device_type="cpu", device={"vendor": "cpu", "memory_gib": 8.0, "peak_tflops": 0.1},
                               model=SPEC.name, model_signature=SPEC.signature(), block_shape=SPEC.to_dict(),
                               tp=s.tp, micro_batch_size=s.micro_batch_size, seq_len=s.seq_len,
                               recompute=s.recompute, dtype="fp32", num_blocks=1, feasible=True, time_s=1.0,
                               peak_memory_bytes=1.0, tp_link_gbps=25.0 if s.tp > 1 else None)
            if s in infeasible:
                out.append(replace(unit, feasible=False, time_s=None, peak_memory_bytes=None))
                continue
            log_time, log_memory = analytical_log_ratios(unit)  # log(1 / analytical)
            out.append(replace(unit, time_s=time_factor(s) / math.exp(log_time),
                               peak_memory_bytes=1.0 / math.exp(log_memory)))
        return out
    return measure


# RTX-3090-like: TP=2 as cheap as TP=1 (a bridged pair), TP=4 and 8 far above the link model.
KINKED_TP = {1: 1.0, 2: 1.0, 4: 2.6, 8: 10.0}


def test_a_parameter_linear_over_the_analytical_model_gets_no_extra_points():
    # Ratios that are constant or straight in log2 of TP and micro-batch: nothing to refine.
    result = minimal_sample_set(tp_mbs_space(), physical_measure(
        lambda s: 1.3 * (1 + 0.2 * math.log2(s.tp)) * (1 + 0.1 * math.log2(s.micro_batch_size))))
    assert result.refinements == [] and result.refinement_budget == 3
    assert result.design_count == 9 and result.measured_count == 9
    assert "budget 3): 0 configurations" in result.summary()


def test_a_kinked_parameter_gets_its_missing_value_measured():
    result = minimal_sample_set(tp_mbs_space(), physical_measure(lambda s: KINKED_TP[s.tp]))
    # The design sees TP 1, 4, 8; each of the three TP lines gets TP=2, micro-batch lines none.
    measured = {(m.tp, m.micro_batch_size) for m in result.measurements}
    assert {(2, b) for b in (1, 4, 16)} <= measured and result.measured_count == 12
    assert sorted((r.parameter, r.value, r.line["micro_batch_size"]) for r in result.refinements) == [
        ("tp", 2, 1), ("tp", 2, 4), ("tp", 2, 16)]
    assert all(r.metric == "time" and r.error > 0.10 for r in result.refinements)
    assert "tp=2 on the line micro_batch_size=4 (time:" in result.summary()
    assert "3 refinement" in result.summary()


def test_refinement_honours_its_budget_and_the_total_budget():
    kinked = physical_measure(lambda s: KINKED_TP[s.tp])
    result = minimal_sample_set(tp_mbs_space(), kinked, refine_budget=2)
    assert len(result.refinements) == 2 and result.measured_count == 11
    assert "budget 2): 2 configurations" in result.summary()
    result = minimal_sample_set(tp_mbs_space(), kinked, budget=10)
    assert len(result.refinements) == 1 and result.measured_count == 10 and result.refinement_budget == 1
    assert minimal_sample_set(tp_mbs_space(), kinked, refine_budget=0).measured_count == 9


def test_refinement_bisects_in_rounds_until_no_kink_has_an_untested_neighbour():
    # The ratio steps up between micro-batch 16 and 32; the design sees 1, 8, 64.
    space = tp_mbs_space(tp=(1,), mbs=(1, 2, 4, 8, 16, 32, 64))
    result = minimal_sample_set(space, physical_measure(lambda s: 3.0 if s.micro_batch_size >= 32 else 1.0),
                                refine_budget=10)
    # Round 1 splits both intervals beside the kink at 8; round 2 the one beside the kink at 16;
    # then the step is bracketed by measured neighbours (16, 32) and 4 is never measured.
    assert [(r.value, r.round) for r in result.refinements] == [(2, 1), (16, 1), (32, 2)]
    assert result.measured_count == 6


def test_an_infeasible_refinement_point_counts_and_is_not_retried():
    kinked = physical_measure(lambda s: KINKED_TP[s.tp], infeasible={Sample(2, 1, 64, "none", SPEC.num_kv_heads)})
    result = minimal_sample_set(tp_mbs_space(), kinked)
    tp2 = [m for m in result.measurements if m.tp == 2]
    assert len(tp2) == 3 and sum(not m.feasible for m in tp2) == 1 and result.measured_count == 12


def test_a_default_that_does_not_fit_recentres_the_design_on_the_heaviest_sample_that_does():
    # A small device: micro-batches of 4 and more run out of memory, the default (4) among them.
    space = tp_mbs_space(tp=(1, 2), mbs=(1, 2, 4, 8, 16))
    too_big = {s for tp in (1, 2) for b in (4, 8, 16) for s in [replace(space.default, tp=tp, micro_batch_size=b)]}
    result = minimal_sample_set(space, physical_measure(lambda s: 1.0, infeasible=too_big))
    # Re-centred on (TP 2, micro-batch 1), the only ablation sample that fit; its TP line measured too.
    assert {(m.tp, m.micro_batch_size) for m in result.measurements if m.feasible} == {(1, 1), (2, 1)}
    assert result.impact and result.measured_count == len(result.measurements)


def test_a_device_that_holds_no_configuration_says_how_much_is_short():
    from memx_launch.errors import ConfigError, NoFeasiblePlanError
    from memx_launch.profiling.design import nothing_fits

    space = tp_mbs_space(tp=(1,), mbs=(1, 2))
    with pytest.raises(ConfigError, match="does not fit cpu: every profiled configuration"):  # real OOMs: no peak
        minimal_sample_set(space, physical_measure(lambda s: 1.0, infeasible={
            replace(space.default, micro_batch_size=b) for b in (1, 2)}))
    # An emulated device measured its peak over the capacity: the shortfall is said, as the planner says it.
    unit = physical_measure(lambda s: 1.0)([space.default])[0]
    over = replace(unit, feasible=False, peak_memory_bytes=8.5 * 2**30)
    error = nothing_fits([over, replace(over, peak_memory_bytes=9 * 2**30)])
    assert isinstance(error, NoFeasiblePlanError) and "cpu short 512.0 MiB per device" in str(error)


def test_calibration_kernel_measures_time_and_memory_on_cpu():
    samples = [Sample(1, 1, 16, level, SPEC.num_kv_heads) for level in ("none", "selective", "full")]
    none, selective, full = calibrate(SPEC, CPU, samples, repeats=3)
    for m in (none, selective, full):
        assert m.feasible and m.time_s > 0 and m.time_spread_s >= 0 and not m.emulated
    # Full recompute keeps only the block inputs: the least memory.
    assert full.peak_memory_bytes < selective.peak_memory_bytes <= none.peak_memory_bytes
    assert none.peak_reserved_bytes is None and none.context_bytes is None  # no caching allocator, no CUDA context
    assert none.host_time_s is None  # ops run inline: the host's time is the step's
    (slow,) = calibrate(SPEC, CPU, samples[:1], repeats=1, emulation_slowdown=4.0)
    assert slow.emulated and slow.emulation_slowdown == 4.0
    # An emulated type at its CPU's own speed is still a stand-in (learned against a CPU's estimate).
    (as_fast,) = calibrate(SPEC, CPU, samples[:1], repeats=1, emulation_slowdown=1.0)
    assert as_fast.emulated and as_fast.emulation_slowdown == 1.0


def test_emulated_calibration_times_the_block_under_the_emulated_device(monkeypatch):
    """Training runs an emulated rank under its device's guard, which keeps books on every operator
    and sleeps the slowdown: calibration times the block under the same guard, not a bare block's
    time multiplied."""
    from memx_launch.profiling import emulation

    guards = []

    class Recorded(emulation.EmulatedDevice):
        def __enter__(self):
            guards.append(self)
            return super().__enter__()

    monkeypatch.setattr(emulation, "EmulatedDevice", Recorded)
    sample = Sample(1, 2, 16, "none", SPEC.num_kv_heads)
    (slow,) = calibrate(SPEC, CPU, [sample], repeats=3, emulation_slowdown=3.0)
    (guard,) = guards
    assert guard.slowdown == 3.0 and guard.compute_s > 0
    # The slowdown is slept: up to (3 - 1) x the operators' time, less where a busy host stretched
    # them (each takes 3 x its own CPU time in all) and less what is still owed (under 2 ms) ...
    assert 0.5 * guard.compute_s <= guard.slept_s <= 2.0 * guard.compute_s + emulation.MIN_SLEEP_S
    # ... and the record is the timed runs' own median (a step is its operators, their sleeps and
    # the guard's books): about a third of the three runs' time, nothing multiplied on top.
    timed = guard.compute_s + guard.slept_s
    assert 0.5 * timed <= 3 * slow.time_s * slow.num_blocks <= 2.0 * timed
    (bare,) = calibrate(SPEC, CPU, [sample], repeats=1)
    assert len(guards) == 1 and not bare.emulated  # a real device's timing runs unguarded


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_cpu_peak_is_not_lowered_by_the_garbage_of_an_earlier_measurement():
    """A tensor an earlier measured step left in a reference cycle, collected inside the next
    step, reads in the profiler's events as a free of that step's: its peak came out short by it."""
    import gc

    import torch

    def leaves_a_cycle():
        cycle = [torch.zeros(4000)]
        cycle.append(cycle)

    def step():
        x = torch.zeros(1000)
        gc.collect()  # as the collector may run anywhere in a step
        y = torch.zeros(1000)
        del x, y

    kernel._peak_memory_bytes(leaves_a_cycle, torch.device("cpu"))
    assert kernel._peak_memory_bytes(step, torch.device("cpu"))[0] == 8000


@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_gpu_calibration_times_with_events_and_reads_both_allocator_peaks():
    import torch

    gpu = DeviceType(name="gpu", vendor="nvidia", memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
                     peak_tflops=100.0)
    (m,) = calibrate(SPEC, gpu, [Sample(1, 2, 64, "none", SPEC.num_kv_heads)], device="cuda", dtype="bf16",
                     repeats=3)
    assert m.feasible and m.time_s > 0
    assert 0 < m.peak_memory_bytes <= m.peak_reserved_bytes
    assert m.context_bytes > 0  # the CUDA context at least (untested here: no GPU in development)
    # The host issues a tiny block's kernels in about the time the device runs them (it waits at
    # most for a full launch queue, far beyond one block's kernels).
    assert 0 < m.host_time_s < 10 * m.time_s


def test_out_of_memory_is_stored_as_an_infeasible_point(monkeypatch):
    def oom(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(kernel, "_run_sample", oom)
    (m,) = calibrate(SPEC, CPU, [Sample(1, 64, 4096, "none", SPEC.num_kv_heads)])
    assert not m.feasible and m.time_s is None


def test_tp_sample_needs_a_tp_group():
    with pytest.raises(ConfigError, match="TP group has 1 rank"):
        calibrate(SPEC, CPU, [Sample(2, 1, 16, "none", SPEC.num_kv_heads)])


def test_space_rejects_a_default_outside_its_values():
    with pytest.raises(ConfigError, match="profile_space.seq_len"):
        ProfileSpace(FIVE, replace(space().default, seq_len=48))


def run_memx_profile(tmp_path, capsys, max_micro_batch: int, budget: int):
    """``memx profile`` of llama-tiny on this CPU: (printed output, records appended)."""
    from memx_launch.cli import main
    from memx_launch.profiling.profiledb import ProfileDB

    out = tmp_path / "profile.jsonl"
    code = main(["profile", "--model", "llama-tiny", "--out", str(out), "--max-micro-batch", str(max_micro_batch),
                 "--seq-lens", "16,32", "--repeats", "1", "--num-blocks", "1", "--budget", str(budget), "--quiet"])
    assert code == 0
    return capsys.readouterr().out, ProfileDB(str(out)).read()


def test_memx_profile_prints_ablation_and_counts_and_appends(tmp_path, capsys):
    printed, records = run_memx_profile(tmp_path, capsys, max_micro_batch=2, budget=12)
    assert "ablation (threshold 10%" in printed and "of a full grid of" in printed
    assert "refinement (ratio to the analytical model" in printed
    assert "tp                one value in the space: fixed" in printed
    assert 0 < len(records) <= 12 and all(r.model == "llama-tiny" for r in records)


def test_memx_profile_below_the_ablation_measures_a_few_samples(tmp_path, capsys):
    printed, records = run_memx_profile(tmp_path, capsys, max_micro_batch=8, budget=2)
    assert "few-sample profile of a device type joining a profiled fleet" in printed
    assert "measured 2 configurations" in printed and "ablation (threshold" not in printed
    # The default micro-batch (4 of 1..8), then the end farthest from it.
    assert sorted(r.micro_batch_size for r in records) == [1, 4]


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
        out = calibrate(SPEC, CPU, samples, tp_group=dist.group.WORLD, repeats=2, tp_link=TpLink(2.0, True))
        queue.put((rank, [(m.tp, m.feasible, m.time_s, m.peak_memory_bytes, m.tp_link_gbps, m.tp_over_pcie)
                               for m in out]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_calibration_kernel_runs_tensor_parallel_over_a_group():
    from ranks import spawn_ranks

    results = spawn_ranks(_tp_calibration_worker, 2)
    for rank in (0, 1):
        (tp, feasible, time_s, peak, link, over_pcie), (_, _, _, full_peak, _, _) = results[rank]
        assert tp == 2 and feasible and time_s > 0 and link == 2.0 and over_pcie
        assert full_peak < peak


def test_a_kink_within_the_repeat_noise_buys_no_point():
    from memx_launch.profiling.interpolation import line_kinks

    x = np.log2([1.0, 2.0, 4.0, 8.0])
    y = np.array([1.0, 1.0, 1.3, 1.0])  # 30% off its neighbours' line
    assert line_kinks(x, y)[0][0] == 2
    # The same line measured with a 20% spread per point: within 2x the noise, not a kink.
    assert line_kinks(x, y, noise=np.full(4, 0.2))[0] == []


def test_memx_run_s_blocks_are_timed_in_one_autocast_region_as_its_steps_run():
    """memx-run's micro-batches run inside one autocast region (--autocast-per-step), which casts
    each weight once a step: its calibration times its repeats inside one too, where a region per
    forward (the Lightning callback's records, memx's default options) casts at every repeat."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].dim() == 2 and args[0].dtype == torch.float32 \
                    and (kwargs or {}).get("dtype") == torch.bfloat16:
                self.count += 1
            return func(*args, **(kwargs or {}))

    repeats, casts = 4, {}
    for name, options in (("memx-run", None), ("defaults", {})):
        with WeightCasts() as counted:
            [record] = calibrate(SPEC, CPU, [Sample(1, 1, 16, "none", SPEC.num_kv_heads)], dtype="bf16",
                                 num_blocks=1, warmup=1, repeats=repeats, run_options=options)
        casts[name] = counted.count
        assert record.feasible
    linears = 7  # q, k, v, o, gate, up, down
    assert casts["defaults"] - casts["memx-run"] == repeats * linears
