import json
import os
import warnings
from dataclasses import replace

import numpy as np
import pytest

from memx_launch.profiling.interpolation import augment_measurements, classify_trend, monotone_in_micro_batch
from memx_launch.planning.costmodel import AnalyticalCostModel
from memx_launch.errors import ConfigError
from memx_launch.profiling.prediction_cache import CachedCostModel, PredictionCache, pack_keys, unpack_keys
from memx_launch.profiling.features import FEATURE_NAMES
from memx_launch.profiling.predictor import PREDICTOR_FORMAT, LearnedCostModel, Predictor, fit_predictor, sidecar_path
from memx_launch.profiling.profiledb import Measurement, ProfileDB
from memx_launch.specs.catalog import MODEL_CATALOG
from memx_launch.specs.cluster import ClusterSpec, DeviceType, Emulation, Node
from memx_launch.specs.training import TrainingSpec

SPEC = MODEL_CATALOG["llama-tiny"]
DEVICE = DeviceType(name="dev", vendor="nvidia", memory_gib=16, peak_tflops=50, memory_bandwidth_gbps=900)
CLUSTER = ClusterSpec("c", (DEVICE,), (Node("n", (("dev", 4),), 100.0),), float("inf"))
TRAINING = TrainingSpec(dtype="fp32")
LEVELS = ("none", "selective", "full")


def true_ratio(mbs):
    """What the synthetic 'hardware' does beyond the formulas: poor efficiency at small batches."""
    return 1.5 * (1 + 0.5 / mbs), 1.1


def synthetic_records(mbs_values=(1, 2, 4, 8, 16), seqs=(32, 64, 128), spec=SPEC):
    cost = AnalyticalCostModel(spec, CLUSTER, TRAINING)
    out = []
    for b in mbs_values:
        for s in seqs:
            for r, level in enumerate(LEVELS):
                c = cost.layer_costs([0], [1], [b], [s], [r])
                t_ratio, m_ratio = true_ratio(b)
                out.append(Measurement(
                    device_type="dev", device={k: v for k, v in vars(DEVICE).items() if k != "name"},
                    model=spec.name, model_signature=spec.signature(), block_shape=spec.to_dict(), tp=1,
                    micro_batch_size=b, seq_len=s, recompute=level, dtype="fp32", num_blocks=1, feasible=True,
                    time_s=float(c.time_s[0] * t_ratio),
                    peak_memory_bytes=float((c.activation_bytes[0] + c.working_bytes[0]) * m_ratio)))
    return out


@pytest.fixture(scope="module")
def fitted():
    return fit_predictor(synthetic_records(), trials=3)


def test_learned_model_recovers_the_residual_and_extrapolates(fitted):
    model = LearnedCostModel(SPEC, CLUSTER, TRAINING, fitted)
    base = AnalyticalCostModel(SPEC, CLUSTER, TRAINING)
    mbs = np.array([3, 6, 12, 64])  # 64 is far outside the sampled 1..16
    got, ref = model.layer_costs(0, 1, mbs, 96, 0), base.layer_costs(0, 1, mbs, 96, 0)
    expected = ref.time_s * np.array([true_ratio(b)[0] for b in mbs])
    assert np.allclose(got.time_s, expected, rtol=0.15)
    assert np.allclose(got.activation_bytes, ref.activation_bytes * 1.1, rtol=0.05)
    assert fitted.meta["feature_importance"] and fitted.meta["hyperparameters"]


def test_learned_attention_is_scaled_as_the_learned_block(fitted):
    """Context parallelism prices its ring with the attention kernel's time: the learned model's is
    the analytical one at the block's learned ratio."""
    model = CachedCostModel(LearnedCostModel(SPEC, CLUSTER, TRAINING, fitted), PredictionCache())
    base = AnalyticalCostModel(SPEC, CLUSTER, TRAINING)
    ratio = model.layer_costs(0, 1, 4, 64, 0).time_s / base.layer_costs(0, 1, 4, 64, 0).time_s
    for learned, analytical in zip(model.attention_seconds(0, 1, 4, 64), base.attention_seconds(0, 1, 4, 64)):
        assert learned == pytest.approx(ratio * analytical, rel=1e-9)
    assert ratio == pytest.approx(true_ratio(4)[0], rel=0.15)


def test_a_mixture_s_dense_blocks_take_the_time_ratio_learned_for_its_expert_block():
    """A profile times a mixture's expert block (memx-run calibrates its first one); its dense blocks,
    priced beside it, take that block's learned time ratio at the same point (what the profile
    measured of the device), their memory their own count."""
    moe = replace(SPEC, name="moe-tiny", num_experts=4, experts_per_token=2,
                  expert_ffn_hidden_size=SPEC.ffn_hidden_size // 2, dense_layers=1)
    learned = LearnedCostModel(moe, CLUSTER, TRAINING, fit_predictor(synthetic_records(spec=moe), trials=1))
    analytical = AnalyticalCostModel(moe, CLUSTER, TRAINING)
    mbs = np.array([1, 4, 16])
    ratio = learned.layer_costs(0, 1, mbs, 64, 0).time_s / analytical.layer_costs(0, 1, mbs, 64, 0).time_s
    assert np.all(ratio > 1.3)  # the synthetic device is slower than the analytical model: 1.5-2.25x
    dense, counted = (m.other_kinds[0].layer_costs(0, 1, mbs, 64, 0) for m in (learned, analytical))
    assert np.allclose(dense.time_s, counted.time_s * ratio, rtol=1e-9)
    assert np.array_equal(dense.activation_bytes, counted.activation_bytes)
    assert np.array_equal(dense.working_bytes, counted.working_bytes)


def test_saved_predictor_loads_and_predicts_the_same(tmp_path, fitted):
    path = str(tmp_path / "p.ubj")
    fitted.save(path)
    loaded = Predictor.load(path)
    X = np.random.default_rng(0).random((5, len(fitted.meta["feature_names"])))
    names, models = ["dev"] * 5, [SPEC.signature()] * 5
    assert np.allclose(loaded.predict_log_ratios(X, names, models), fitted.predict_log_ratios(X, names, models))


def test_predictor_of_another_version_is_a_clear_error(tmp_path, fitted):
    path = str(tmp_path / "p.ubj")
    fitted.save(path)
    with open(sidecar_path(path)) as f:
        meta = json.load(f)
    meta["format_version"] = 0
    with open(sidecar_path(path), "w") as f:
        json.dump(meta, f)
    with pytest.raises(ConfigError, match=f"format version 0, this memx reads {PREDICTOR_FORMAT}; re-train"):
        Predictor.load(path)


def test_adding_device_types_never_moves_a_profiled_types_predictions(tmp_path):
    from dataclasses import replace

    from memx_launch.profiling.predictor import MIN_OWN_RECORDS, own_model_types

    own = synthetic_records(mbs_values=(1, 4, 16), seqs=(32, 128))
    # Another type, slower and with another trend, profiled alongside it.
    others = [replace(r, device_type="other", device={**r.device, "peak_tflops": 20.0},
                      time_s=r.time_s * (4.0 if r.micro_batch_size > 2 else 1.2)) for r in own]
    alone = fit_predictor(own, trials=1)
    together = fit_predictor(own + others, trials=1)
    assert set(together.own_boosters) == {"dev", "other"} and len(own) >= MIN_OWN_RECORDS
    query = (0, np.array([1, 1, 1, 1]), np.array([1, 3, 8, 32]), np.array([32, 64, 128, 512]), np.array([0, 1, 2, 0]))
    a, b = (LearnedCostModel(SPEC, CLUSTER, TRAINING, p).layer_costs(*query) for p in (alone, together))
    assert np.array_equal(a.time_s, b.time_s) and np.array_equal(a.activation_bytes, b.activation_bytes)
    # A type with fewer samples leans on the fleet's trees: it gets none of its own.
    assert own_model_types(own + others[:MIN_OWN_RECORDS - 1]) == {"dev"}
    # Each type's trees are saved in a file of their own, vouched for by the sidecar.
    together.save(str(tmp_path / "p.ubj"))
    loaded = Predictor.load(str(tmp_path / "p.ubj"))
    X = np.random.default_rng(0).random((4, len(FEATURE_NAMES)))
    names, models = ["dev", "other", "new", "dev"], [SPEC.signature()] * 4
    assert np.allclose(loaded.predict_log_ratios(X, names, models), together.predict_log_ratios(X, names, models))
    assert sorted(os.listdir(tmp_path)) == ["p.type0.ubj", "p.type1.ubj", "p.ubj", "p.ubj.meta.json"]


def test_emulated_samples_are_learned_against_the_estimate_the_plan_uses():
    # A CPU stand-in named for a GPU vendor, at its CPU's own speed (slowdown 1): its plans are
    # estimated as a CPU's (no tiles, waves or launches), so its samples must be learned so too.
    emulated = ClusterSpec("e", (DEVICE,), (Node("n", (("dev", 4),), 100.0),), float("inf"), Emulation((("dev", 1.0),)))
    cost = AnalyticalCostModel(SPEC, emulated, TRAINING)
    records = [replace(r, emulated=True, time_s=2.0 * float(cost.layer_costs(
        [0], [1], [r.micro_batch_size], [r.seq_len], [LEVELS.index(r.recompute)]).time_s[0]))
        for r in synthetic_records(mbs_values=(1, 4, 16), seqs=(32, 128))]
    learned = LearnedCostModel(SPEC, emulated, TRAINING, fit_predictor(records, trials=1))
    mbs = np.array([2, 8])
    assert np.allclose(learned.layer_costs(0, 1, mbs, 64, 0).time_s, 2.0 * cost.layer_costs(0, 1, mbs, 64, 0).time_s,
                       rtol=0.15)


@pytest.mark.parametrize("link_gbps", [16.0, 300.0], ids=["pcie", "nvlink"])
def test_a_tp_record_is_learned_against_the_base_its_plan_is_priced_on(link_gbps):
    # The record carries the link its TP group ran over (tp_links.tp_link); the one-device
    # cluster it is learned on must price TP as the plan's node does, PCIe's staging through the
    # host and its per-step latencies included, or the learned ratio multiplies another base.
    from memx_launch.planning.tp_links import tp_link
    from memx_launch.profiling.features import profiled_cluster

    plan = ClusterSpec("p", (DEVICE,), (Node("n", (("dev", 8),), link_gbps, numa_domains=2, cross_numa_gbps=link_gbps / 2),),
                       float("inf"))
    planned = AnalyticalCostModel(SPEC, plan, TRAINING)
    for tp in (2, 4, 8):
        link = tp_link(plan, "dev", tp)
        assert link.over_pcie == (link_gbps == 16.0)
        record = replace(synthetic_records(mbs_values=(2,), seqs=(64,))[0], tp=tp, tp_link_gbps=link.gbps,
                         tp_over_pcie=link.over_pcie)
        learned_on = AnalyticalCostModel(SPEC, profiled_cluster(record, DEVICE), TRAINING)
        base = learned_on.layer_costs([0], [tp], [2], [64], [0]).time_s[0]
        assert base == pytest.approx(planned.layer_costs([0], [tp], [2], [64], [0]).time_s[0], rel=1e-12), tp


def test_unseen_device_type_warns_and_still_predicts(fitted):
    other = DeviceType(name="other", vendor="amd", memory_gib=64, peak_tflops=100)
    cluster = ClusterSpec("c", (DEVICE, other), (Node("n", (("dev", 2), ("other", 2)), 100.0),), float("inf"))
    with pytest.warns(UserWarning, match="no measurement of device type"):
        model = LearnedCostModel(SPEC, cluster, TRAINING, fitted)
    assert np.all(model.layer_costs([0, 1], 1, 2, 64, 0).time_s > 0)


def test_an_unprofiled_pair_predicts_the_same_however_its_peak_is_described(fitted):
    """A type never profiled: descriptions of one sustained rate (peak x efficiency, the fp32
    peak, TF32) give one prediction. A model never profiled on a profiled type: the type's
    profiled descriptors are the base, whatever the file says."""
    other = MODEL_CATALOG["llama-small"]
    query = (0, 1, np.array([1, 4, 16]), 256, np.array([0, 1, 2]))

    def predict(model, training=TRAINING, **device):
        d = DeviceType(name=device.pop("name", "new"), vendor="nvidia", memory_gib=80, memory_bandwidth_gbps=2000,
                       **device)
        cluster = ClusterSpec("c", (d,), (Node("n", ((d.name, 4),), 100.0),), float("inf"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "new" has no measurement
            return LearnedCostModel(model, cluster, training, fitted).layer_costs(*query).time_s

    same_rate = [predict(SPEC, peak_tflops=400, efficiency=0.5), predict(SPEC, peak_tflops=200, efficiency=1.0),
                 predict(SPEC, peak_tflops=266.67, peak_tflops_fp32=200, efficiency=1.0),
                 predict(SPEC, TrainingSpec(dtype="fp32", tf32=True), peak_tflops=800, peak_tflops_fp32=19.5,
                         efficiency=0.5)]  # TF32: half the 16-bit peak
    assert all(np.allclose(t, same_rate[0], rtol=1e-9) for t in same_rate)
    profiled = [predict(other, name="dev", peak_tflops=p, efficiency=e) for p, e in ((50, None), (500, 0.2))]
    assert np.array_equal(*profiled)


def test_cache_matches_inner_and_counts(fitted):
    inner = LearnedCostModel(SPEC, CLUSTER, TRAINING, fitted)
    cached = CachedCostModel(inner)
    device, tp, mbs, seq, rc = np.zeros(6, int), np.ones(6, int), np.array([1, 2, 1, 2, 4, 4]), 64, np.array([0, 1, 0, 1, 2, 2])
    first = cached.layer_costs(device, tp, mbs, seq, rc)
    assert np.allclose(first.time_s, inner.layer_costs(device, tp, mbs, seq, rc).time_s)
    assert cached.cache.misses == 3 and cached.cache.hits == 0
    again = cached.layer_costs(device[:2], tp[:2], mbs[:2], 64, rc[:2])
    assert np.allclose(again.time_s, first.time_s[:2])
    assert cached.cache.hits == 2 and cached.cache.misses == 3


def test_cache_is_invalidated_by_a_new_context(fitted):
    store = PredictionCache()
    CachedCostModel(LearnedCostModel(SPEC, CLUSTER, TRAINING, fitted), store).layer_costs(0, 1, 2, 64, 0)
    assert len(store) == 1
    CachedCostModel(LearnedCostModel(SPEC, CLUSTER, TrainingSpec(dtype="fp32", global_batch_size=64), fitted), store)
    assert len(store) == 0 and store.invalidations == 1


def test_key_packing_round_trips_and_rejects_out_of_range():
    fields = [np.array([0, 3]), np.array([1, 8]), np.array([1, 512]), np.array([128, 131072]), np.array([0, 2])]
    assert all(np.array_equal(a, b) for a, b in zip(unpack_keys(pack_keys(*fields)), fields))
    with pytest.raises(ConfigError, match="tp"):
        pack_keys(0, 1 << 13, 1, 1, 0)


def test_validator_classes_and_rules():
    x = np.array([1.0, 4.0, 8.0])
    assert classify_trend(x, 2 * x + 1)[0] == "linear"
    assert classify_trend(x, np.array([1.0, 1.01, 1.02]))[0] == "constant"
    assert classify_trend(x, x**2.5)[0] == "superlinear"
    assert classify_trend(x, np.array([3.0, 1.0, 4.0]))[0] == "non-monotone"
    # Times linear in the micro-batch (llama-tiny's own GEMMs are wave-quantized, flat-then-step).
    records = [replace(r, time_s=1e-3 * (1 + r.micro_batch_size))
               for r in synthetic_records(mbs_values=(1, 4, 16), seqs=(64,))]
    aug = augment_measurements(records)
    assert {c.parameter for c in aug.checks} == {"micro_batch_size"}
    assert aug.points and all(p.micro_batch_size in (2, 8) for p in aug.points)
    assert "points" in aug.summary()


def test_load_cost_model_fits_once_then_reuses(tmp_path, monkeypatch):
    from memx_launch.profiling import predictor as predictor_module

    path = str(tmp_path / "profile.jsonl")
    ProfileDB(path).append(synthetic_records(mbs_values=(1, 4, 16), seqs=(32, 128)))
    model = predictor_module.load_cost_model(path, SPEC, CLUSTER, TRAINING, trials=2)
    assert isinstance(model, CachedCostModel) and model.layer_costs(0, 1, 2, 64, 0).time_s.shape == ()
    # The cache keeps the profiled descriptors: a file declaring the type otherwise predicts the same.
    declared = ClusterSpec("c", (DeviceType(name="dev", vendor="nvidia", memory_gib=16, peak_tflops=500,
                                            efficiency=0.2),), CLUSTER.nodes, float("inf"))
    refit = predictor_module.fit_predictor
    monkeypatch.setattr(predictor_module, "fit_predictor", lambda *a, **k: pytest.fail("refitted"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached = predictor_module.load_cost_model(path, SPEC, declared, TRAINING, trials=2)
    assert cached.layer_costs(0, 1, 2, 64, 0).time_s == pytest.approx(model.layer_costs(0, 1, 2, 64, 0).time_s)
    # A cache of an older format is fitted again, not an error.
    with open(sidecar_path(os.path.splitext(path)[0] + ".predictor.ubj")) as f:
        meta = json.load(f)
    meta["format_version"] = PREDICTOR_FORMAT - 1
    with open(sidecar_path(os.path.splitext(path)[0] + ".predictor.ubj"), "w") as f:
        json.dump(meta, f)
    fits = []
    monkeypatch.setattr(predictor_module, "fit_predictor", lambda *a, **k: fits.append(1) or refit(*a, **k))
    predictor_module.load_cost_model(path, SPEC, CLUSTER, TRAINING, trials=2)
    assert fits == [1]


def test_a_damaged_predictor_cache_never_reaches_xgboost_and_is_refitted(tmp_path, monkeypatch, capsys):
    from memx_launch.profiling import predictor as predictor_module

    path = str(tmp_path / "profile.jsonl")
    ProfileDB(path).append(synthetic_records(mbs_values=(1, 4, 16), seqs=(32, 128)))
    predictor_module.load_cost_model(path, SPEC, CLUSTER, TRAINING, trials=2)
    cache = os.path.splitext(path)[0] + ".predictor.ubj"
    data = bytearray(open(cache, "rb").read())
    for i in (len(data) // 3, 2 * len(data) // 3):  # two bytes changed: the crash of issue 23
        data[i] ^= 0xFF
    with open(cache, "wb") as f:
        f.write(data)
    monkeypatch.setattr("xgboost.Booster.load_model", lambda *a: pytest.fail("a damaged file reached XGBoost"))
    with pytest.raises(ConfigError, match="does not match the sha256 in its .meta.json"):
        Predictor.load(cache)
    monkeypatch.undo()
    refit, fits = predictor_module.fit_predictor, []
    monkeypatch.setattr(predictor_module, "fit_predictor", lambda *a, **k: fits.append(1) or refit(*a, **k))
    capsys.readouterr()
    model = predictor_module.load_cost_model(path, SPEC, CLUSTER, TRAINING, trials=2)
    assert fits == [1] and model.layer_costs(0, 1, 2, 64, 0).time_s > 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "sha256" in warning[0] and "fitting it again" in warning[0]
    Predictor.load(cache)  # the refit's cache is whole again


def test_offsets_follow_each_measured_tp_degree_and_interpolate_between():
    from memx_launch.profiling.features import TP_COLUMN, Offsets, training_rows

    cluster = ClusterSpec("c", (DEVICE,), (Node("n", (("dev", 8),), 100.0),), float("inf"))
    cost = AnalyticalCostModel(SPEC, cluster, TRAINING)
    # A slow link beyond pairs: the measured/analytical ratio is 1.2 at TP 1 and 4.8 at TP 4.
    ratio = {1: 1.2, 4: 4.8}
    records = [Measurement(
        device_type="dev", device={k: v for k, v in vars(DEVICE).items() if k != "name"}, model=SPEC.name,
        model_signature=SPEC.signature(), block_shape=SPEC.to_dict(), tp=tp, micro_batch_size=b, seq_len=64,
        recompute="none", dtype="fp32", num_blocks=1, feasible=True, tp_link_gbps=100.0,
        time_s=float(cost.layer_costs([0], [tp], [b], [64], [0]).time_s[0] * ratio[tp]))
        for tp in (1, 4) for b in (1, 2, 4)]
    offsets = Offsets.fit(training_rows(records))
    X = np.zeros((5, TP_COLUMN + 1))
    X[:, TP_COLUMN] = [1, 2, 4, 8, 1]
    got = np.exp(offsets.margin(X, ["dev"] * 4 + ["other"], [SPEC.signature()] * 5)[:, 0])
    # Exact at measured degrees, geometric mean halfway in log2 TP, flat beyond; a type never
    # measured gets the global median.
    assert np.allclose(got[:4], [1.2, (1.2 * 4.8) ** 0.5, 4.8, 4.8], rtol=1e-6)
    assert got[4] == pytest.approx(np.exp(offsets.overall[0]))


def test_a_time_above_a_larger_micro_batch_s_is_capped_before_learning():
    """More samples through the same block are no less work: a micro-batch timed above a larger
    one on its line (a warm-up) is capped at the least larger time, embedding and head alike;
    another line (TP 2) and times that grow are untouched, and the fit counts the caps."""
    line = [r for r in synthetic_records(mbs_values=(1, 2, 4), seqs=(64,)) if r.recompute == "none"]
    warm = [replace(r, time_s=block, embedding_time_s=embedding, head_time_s=head)
            for r, (block, embedding, head) in zip(line, [(3.0, 0.1, 0.5), (2.0, 0.2, 0.2), (4.0, 0.3, 0.3)])]
    other = [replace(r, tp=2, time_s=float(r.micro_batch_size)) for r in line]
    capped, count = monotone_in_micro_batch(warm + other)
    assert count == 2  # micro-batch 1's block and head times; its embedding time grew with the batch
    assert (capped[0].time_s, capped[0].embedding_time_s, capped[0].head_time_s) == (2.0, 0.1, 0.2)
    assert capped[1:] == (warm + other)[1:]
    assert fit_predictor(warm + other, trials=2).meta["rows"]["times_capped"] == 2
    repeat = replace(warm[1], time_s=2.5)  # micro-batch 2 measured again, slower: no larger one to cap it
    assert monotone_in_micro_batch(warm + [repeat])[0][-1].time_s == 2.5
