"""Calibration beyond the blocks: embedding and head times, and the measured memory overhead
(synthetic GPU records: no GPU here, the kernel's CUDA path is untested in this suite)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from memx_launch.planning.costmodel import AnalyticalCostModel
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.profiling.calibrated_parts import (measured_efficiency, measured_overhead_gib, one_descriptor_set,
                                                    part_levels, with_type_fields)
from memx_launch.profiling.predictor import LearnedCostModel, fit_predictor, training_signature
from memx_launch.specs.cluster import ClusterSpec, Node
from memx_launch.specs.catalog import MODEL_CATALOG
from memx_launch.specs.training import TrainingSpec
from tests.test_predictor import CLUSTER, DEVICE, LEVELS, SPEC, TRAINING, synthetic_records

GIB = 2**30


def gpu_records(embedding_ratio=3.0, head_ratio=0.5, slack_gib=1.5, context_gib=0.6, head_fixed_s=0.0):
    """Synthetic records of a GPU that timed the embedding and head and read its memory above
    the allocated tensors."""
    cost = AnalyticalCostModel(SPEC, CLUSTER, TRAINING)
    out = []
    for r in synthetic_records():
        emb = cost.embedding_time([0], [r.tp], [r.micro_batch_size], [r.seq_len])[0]
        head = cost.head_time([0], [r.tp], [r.micro_batch_size], [r.seq_len])[0]
        out.append(replace(r, embedding_time_s=float(emb * embedding_ratio), head_time_s=float(head_fixed_s + head * head_ratio),
                           peak_reserved_bytes=r.peak_memory_bytes + slack_gib * GIB, context_bytes=context_gib * GIB))
    return out


@pytest.fixture(scope="module")
def predictor():
    return fit_predictor(gpu_records(), trials=2)


def test_part_levels_and_overhead_come_from_the_records():
    records = gpu_records()
    levels = part_levels(records)
    key = f"dev|{SPEC.signature()}"
    assert levels["embedding"][key] == pytest.approx([3.0, 0.0], abs=1e-9)
    assert levels["head"][key] == pytest.approx([0.5, 0.0], abs=1e-9)
    # A fixed cost per call (launches) beside the scaled physics is recovered too.
    fixed = part_levels(gpu_records(head_fixed_s=2e-3))["head"][key]
    assert fixed == pytest.approx([0.5, 2e-3], rel=1e-6)
    assert measured_overhead_gib(records) == {"dev": pytest.approx(2.1)}
    # Records without the measurements (public time-only profiles, CPUs) give nothing.
    assert part_levels(synthetic_records()) == {"embedding": {}, "head": {}}
    assert measured_overhead_gib([replace(r, context_bytes=None) for r in records]) == {}


def test_learned_model_times_embedding_and_head_by_their_measured_level(predictor):
    learned = LearnedCostModel(SPEC, CLUSTER, TRAINING, predictor)
    base = AnalyticalCostModel(SPEC, CLUSTER, TRAINING)
    args = (np.array([0, 0]), np.array([1, 2]), np.array([2, 8]), np.array([64, 128]))
    assert np.allclose(learned.embedding_time(*args), 3.0 * base.embedding_time(*args))
    assert np.allclose(learned.head_time(*args), 0.5 * base.head_time(*args))
    # A type the profile did not time keeps the analytical time.
    other = replace(DEVICE, name="other")
    cluster = ClusterSpec("c2", (DEVICE, other), (Node("n", (("dev", 4), ("other", 4)), 100.0),), float("inf"))
    with pytest.warns(UserWarning):
        mixed = LearnedCostModel(SPEC, cluster, TRAINING, predictor)
    plain = AnalyticalCostModel(SPEC, cluster, TRAINING)
    one = (np.array([1]), np.array([1]), np.array([4]), np.array([64]))
    assert np.allclose(mixed.head_time(*one), plain.head_time(*one))


def test_estimate_uses_the_measured_overhead_unless_the_cluster_gives_one(predictor):
    training = TrainingSpec(dtype="fp32", global_batch_size=8, seq_len=64)
    model = replace(MODEL_CATALOG["llama-tiny"], seq_len=64)

    def peak(cluster, cost_model=None):
        plan = evaluate_layout(model, cluster, training, tp=1, pp=1, dp=4, micro_batch_size=2,
                               cost_model=cost_model, references=(1.0, 1.0, 1.0))
        return plan.stages[0].predicted_peak_memory_gib

    analytical = AnalyticalCostModel(model, CLUSTER, training)
    default = peak(CLUSTER, analytical)  # vendor default: 1.25 GiB for nvidia
    learned = LearnedCostModel(model, CLUSTER, training, predictor)
    assert learned.measured_overhead_bytes == {"dev": pytest.approx(2.1 * GIB)}
    # Activations differ by the learned memory ratio; the overhead moves by 2.1 - 1.25 GiB.
    acts = peak(CLUSTER, learned) - 2.1 - (default - 1.25)
    assert abs(acts) < 0.05
    given = ClusterSpec("c", (replace(DEVICE, memory_overhead_gib=0.25),), CLUSTER.nodes, float("inf"))
    stated = LearnedCostModel(model, given, training, predictor)
    assert stated.measured_overhead_bytes == {}
    assert peak(given, stated) == pytest.approx(peak(CLUSTER, learned) - 2.1 + 0.25, abs=1e-6)


def test_measured_efficiency_recovers_the_share_of_peak_the_blocks_sustained():
    """Records timed by 'hardware' that sustains 40% of peak (the analytical model at 0.4), the
    records' device saying nothing (the 0.75 default): calibration finds 0.4, and the analytical
    model of the cluster with it reproduces the measured times."""
    big = MODEL_CATALOG["llama-small"]  # large enough that no block is launch-bound
    slow = AnalyticalCostModel(big, ClusterSpec("c", (replace(DEVICE, efficiency=0.4),), CLUSTER.nodes,
                                                float("inf")), TRAINING)
    records = []
    for r in synthetic_records(mbs_values=(4, 8, 16), seqs=(128, 256)):
        level = ("none", "selective", "full").index(r.recompute)
        t = slow.layer_costs([0], [r.tp], [r.micro_batch_size], [r.seq_len], [level]).time_s[0]
        records.append(replace(r, model=big.name, model_signature=big.signature(), block_shape=big.to_dict(),
                               time_s=float(t)))
    # Launch-bound blocks (llama-tiny at small shapes on a device fast enough that its GEMMs take
    # less than the launches) carry no information: no value from them alone.
    fast = [replace(r, device={**r.device, "peak_tflops": 5000.0})
            for r in synthetic_records(mbs_values=(1,), seqs=(32,))]
    assert measured_efficiency(fast) == {}
    eff = measured_efficiency(records)
    assert eff == {"dev": pytest.approx(0.4, rel=0.02)}
    calibrated = with_type_fields(CLUSTER, {"dev": {"efficiency": eff["dev"]}})
    assert calibrated.device_type("dev").efficiency == pytest.approx(0.4, rel=0.02)
    again = AnalyticalCostModel(big, calibrated, TRAINING).layer_costs([0], [1], [4], [64], [0]).time_s
    assert again == pytest.approx(slow.layer_costs([0], [1], [4], [64], [0]).time_s, rel=0.02)
    assert fit_predictor(records, trials=2).meta["efficiency"]["dev"] == pytest.approx(0.4, rel=0.02)


def test_learned_model_carries_the_measured_efficiency_for_compute_share_baselines(predictor):
    eff = predictor.meta["efficiency"]
    learned = LearnedCostModel(SPEC, CLUSTER, TRAINING, predictor)
    assert 0 < eff["dev"] <= 1 and learned.calibrated_cluster.device_type("dev").efficiency == eff["dev"]
    # On the profiled peak, whatever peak and efficiency the file declares: the measured share is of it.
    declared = ClusterSpec("c", (replace(DEVICE, peak_tflops=DEVICE.peak_tflops * 3, efficiency=0.6),), CLUSTER.nodes,
                           float("inf"))
    baseline = LearnedCostModel(SPEC, declared, TRAINING, predictor).calibrated_cluster.device_type("dev")
    assert baseline.effective_tflops == pytest.approx(DEVICE.peak_tflops * eff["dev"])
    # The learned ratios stay on the profile's descriptors: its analytical base is unchanged.
    assert learned.analytical.cluster.device_type("dev") == DEVICE


def test_learned_costs_follow_the_profile_not_what_a_cluster_file_declares_of_its_compute(predictor):
    """A cluster file that declares the profiled type's peak, efficiency, bandwidth or capability
    otherwise leaves the learned costs as they were: its ratios scale the base they were fitted
    against. Its capacity, and a type the profile never measured, stay the file's."""
    declared = replace(DEVICE, vendor="amd", peak_tflops=DEVICE.peak_tflops * 3, compute_capability=9.0,
                       memory_bandwidth_gbps=(DEVICE.memory_bandwidth_gbps or 100) * 2, memory_gib=DEVICE.memory_gib * 2)
    other = replace(DEVICE, name="unprofiled")
    cluster = ClusterSpec("c", (declared, other), (Node("n", (("dev", 1), ("unprofiled", 1)), 100.0),), float("inf"))
    args = (np.array([0, 0, 0]), np.array([1, 2, 1]), np.array([2, 8, 4]), np.array([64, 128, 64]), np.array([0, 2, 1]))
    with pytest.warns(UserWarning, match="unprofiled"):
        learned = LearnedCostModel(SPEC, cluster, TRAINING, predictor)
    reference = LearnedCostModel(SPEC, CLUSTER, TRAINING, predictor)
    assert np.allclose(learned.layer_costs(*args).time_s, reference.layer_costs(*args).time_s)
    assert np.allclose(learned.head_time(*args[:4]), reference.head_time(*args[:4]))
    assert learned.analytical.cluster.device_type("dev").memory_gib == declared.memory_gib
    assert learned.analytical.cluster.device_type("unprofiled") == other
    assert LearnedCostModel(SPEC, ClusterSpec("c", (replace(DEVICE, efficiency=0.3),), CLUSTER.nodes, float("inf")),
                            TRAINING, predictor).layer_costs(*args).time_s == pytest.approx(
        reference.layer_costs(*args).time_s)
    # Whether the run may use fused attention stays the file's: without it a block that keeps
    # everything (the first query) keeps the scores too.
    no_flash = ClusterSpec("c", (replace(DEVICE, flash_attention=False),), CLUSTER.nodes, float("inf"))
    kept = LearnedCostModel(SPEC, no_flash, TRAINING, predictor).layer_costs(*args).activation_bytes
    assert kept[0] > reference.layer_costs(*args).activation_bytes[0]


def test_a_type_profiled_under_several_descriptions_is_fitted_on_the_one_most_records_carry():
    records = gpu_records()
    redetected = [replace(r, device={**r.device, "peak_tflops": r.device["peak_tflops"] * 1.1}) for r in records[:3]]
    with pytest.warns(UserWarning, match="device type dev carry 2 different device descriptions"):
        fitted = fit_predictor(redetected + records[3:], trials=2)
    assert fitted.meta["device_descriptors"]["dev"]["peak_tflops"] == DEVICE.peak_tflops
    assert fitted.meta["training"] == training_signature(redetected + records[3:])  # the profile as stored


def test_records_state_the_run_options_their_blocks_ran_with():
    """Blocks timed with dropout and torch's softmax: the learned targets are taken against the
    analytical model at those options (ratio 1 here), not at memx's defaults."""
    from memx_launch.profiling.features import training_rows
    from memx_launch.profiling.profiledb import Measurement

    options = {"dropout": True, "fused_softmax": False, "flash_attention": False}
    physics = AnalyticalCostModel(SPEC, CLUSTER, TrainingSpec(dtype="fp32", **options))
    records = []
    for r in synthetic_records():
        level = ("none", "selective", "full").index(r.recompute)
        t = physics.layer_costs([0], [1], [r.micro_batch_size], [r.seq_len], [level]).time_s[0]
        records.append(replace(r, time_s=float(t), run_options=options))
    assert np.allclose(training_rows(records).Y[:, 0], 0.0, atol=1e-9)
    assert not np.allclose(training_rows([replace(r, run_options={}) for r in records]).Y[:, 0], 0.0, atol=1e-3)
    with pytest.raises(ValueError, match="unknown run option"):
        Measurement.from_dict({**json.loads(records[0].to_json()), "run_options": {"turbo": True}})
    assert Measurement.from_dict(json.loads(records[0].to_json())) == records[0]


def test_memx_s_calibration_is_learned_against_memx_run_s_own_count():
    """memx's calibration runs its blocks as memx-run trains them (torch-op norms, q, k, v apart):
    its records say so, and a block measured at memx-run's count of its memory is learned at ratio
    1, so that memx-run's plans, priced at that count, take nothing twice. Against memx's default
    options (fused norms and linears, kernels issued ahead of the device) the same record was
    learned about 10% high in memory and several times over in time (memx-run's eager ops wait on
    the host at this small shape), which memx-run's plans then counted again."""
    from memx_launch.profiling.features import training_rows
    from memx_launch.profiling.kernel import CALIBRATED_AS, record_run_options

    assert record_run_options("none", "attention") == CALIBRATED_AS == {"setup": "memx-run"}
    assert record_run_options("full", "attention", {}) == {}  # the Lightning callback's, as it plans
    physics = AnalyticalCostModel(SPEC, CLUSTER, TrainingSpec(dtype="fp32", **CALIBRATED_AS))
    records = []
    for r in synthetic_records():
        query = ([0], [1], [r.micro_batch_size], [r.seq_len], [("none", "selective", "full").index(r.recompute)])
        cost = physics.layer_costs(*query)
        memory = r.num_blocks * cost.activation_bytes[0] + cost.working_bytes[0]
        records.append(replace(r, time_s=float(cost.time_s[0]), peak_memory_bytes=float(memory),
                               run_options=dict(CALIBRATED_AS)))
    assert np.allclose(training_rows(records).Y, 0.0, atol=1e-9)
    as_defaults = np.exp(training_rows([replace(r, run_options={}) for r in records]).Y)
    assert as_defaults[:, 1].min() > 1.05 and as_defaults[:, 0].min() > 2.0


def test_autocast_s_weight_copies_in_a_16_bit_record_are_not_learned_as_activations():
    """A block calibrated in bf16 runs under autocast and holds a 16-bit copy of its weights beside
    its activations, which memx's plans count as model states: a record measured at the count
    and the copies is learned at ratio 1 (its copies taken as activations, the probe's tiny blocks
    were learned 6-30% high, and every in-flight micro-batch of a plan paid for them again)."""
    from memx_launch.planning.model_states import weight_copy_bytes
    from memx_launch.profiling.features import training_rows
    from memx_launch.profiling.kernel import CALIBRATED_AS

    physics = AnalyticalCostModel(SPEC, CLUSTER, TrainingSpec(dtype="bf16", **CALIBRATED_AS))
    copies = float(weight_copy_bytes(SPEC, physics.training, 1)[0])
    assert copies == 2 * SPEC.layer_params
    records = []
    for r in synthetic_records():
        cost = physics.layer_costs([0], [1], [r.micro_batch_size], [r.seq_len], [LEVELS.index(r.recompute)])
        memory = r.num_blocks * (cost.activation_bytes[0] + copies) + cost.working_bytes[0]
        records.append(replace(r, dtype="bf16", time_s=float(cost.time_s[0]), peak_memory_bytes=float(memory),
                               run_options=dict(CALIBRATED_AS)))
    assert np.allclose(training_rows(records).Y[:, 1], 0.0, atol=1e-9)


def eager_gpu_records(host_s=1e-3, device_ratio=1.2):
    """An eager framework's GPU: a block takes the longer of the host's time to issue it (half as
    much again under full recompute) and the device's work (1.2 x the analytical); each record
    measured the host's share of the plain step too."""
    records = synthetic_records(mbs_values=(1, 2, 4, 8, 16, 32), seqs=(64, 128, 256, 512))
    times = eager_truth(np.ones(len(records)), [r.micro_batch_size for r in records], [r.seq_len for r in records],
                        [LEVELS.index(r.recompute) for r in records], host_s, device_ratio)
    return [replace(r, time_s=float(t), host_time_s=host_s) for r, t in zip(records, times)]


def eager_truth(tp, mbs, seq, recompute, host_s=1e-3, device_ratio=1.2):
    device_s = AnalyticalCostModel(SPEC, CLUSTER, TRAINING).layer_costs(np.zeros(len(tp), int), tp, mbs, seq, recompute)
    return np.maximum(device_ratio * device_s.time_s, host_s * np.where(np.asarray(recompute) == 2, 1.5, 1.0))


def test_a_types_measured_host_time_is_its_floor_and_the_trees_learn_the_work_above_it():
    """The median host time of a type's records becomes its profiled host_ms_per_layer: the base
    of its learned ratios, so a block no record measured is host-bound where the framework is,
    and a large one keeps the device's ratio. (With the default floor the trees carry the small
    blocks' ratio of 5 to TP 2-8 blocks no record measured: up to 3.5x too slow there.)"""
    import itertools

    records = eager_gpu_records()
    consistent, descriptors = one_descriptor_set(records)
    assert descriptors["dev"]["host_ms_per_layer"] == pytest.approx(1.0)
    assert all(r.device["host_ms_per_layer"] == pytest.approx(1.0) for r in consistent)
    fitted = fit_predictor(records, trials=2)
    assert fitted.meta["device_descriptors"]["dev"]["host_ms_per_layer"] == pytest.approx(1.0)
    # The records are TP 1, micro-batch 1-32, sequences 64-512: the grid reaches beyond on every axis.
    grid = np.array(list(itertools.product((1, 2, 4, 8), (1, 3, 8, 64), (64, 96, 1024, 2048), (0, 1, 2))), float)
    query = (np.zeros(len(grid), int), *grid.T)
    expected = eager_truth(*query[1:])
    assert (expected == 1e-3).any() and expected.max() > 10e-3
    ratio = LearnedCostModel(SPEC, CLUSTER, TRAINING, fitted).layer_costs(*query).time_s / expected
    assert np.all(np.abs(ratio - 1) < 0.2)
    unmeasured = fit_predictor([replace(r, host_time_s=None) for r in records], trials=2)
    assert (LearnedCostModel(SPEC, CLUSTER, TRAINING, unmeasured).layer_costs(*query).time_s / expected).max() > 2


def test_the_host_time_flag_speaks_for_the_types_the_profile_did_not_measure():
    """--host-ms-per-layer overrides every type's host time in the analytical model; the learned
    model keeps a profiled type's base as it was fitted and gives the flag to the others."""
    other = replace(DEVICE, name="other")
    stated = replace(DEVICE, host_ms_per_layer=2.0)
    small = (np.zeros(1, int), np.ones(1), np.ones(1), np.full(1, 64), np.zeros(1))
    on_file = ClusterSpec("c", (stated,), CLUSTER.nodes, float("inf"))
    assert AnalyticalCostModel(SPEC, on_file, TRAINING).layer_costs(*small).time_s[0] == pytest.approx(2e-3)
    flagged = replace(TRAINING, host_ms_per_layer=5.0)
    assert AnalyticalCostModel(SPEC, on_file, flagged).layer_costs(*small).time_s[0] == pytest.approx(5e-3)
    fitted = fit_predictor(eager_gpu_records(), trials=2)
    cluster = ClusterSpec("c", (DEVICE, other), (Node("n", (("dev", 1), ("other", 1)), 100.0),), float("inf"))
    with pytest.warns(UserWarning, match="other"):
        learned = LearnedCostModel(SPEC, cluster, flagged, fitted)
    assert learned.analytical.cluster.device_type("dev").host_ms_per_layer == pytest.approx(1.0)
    assert learned.analytical.cluster.device_type("other").host_ms_per_layer == 5.0
    assert learned.layer_costs(*small).time_s[0] == pytest.approx(1e-3, rel=0.15)
