"""benchmarks/real_runs.py: its metrics, and a run on the development data where it is present;
benchmarks/predictor_accuracy.py: it predicts on the base its records are learned against."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import common, real_runs  # noqa: E402


def test_metrics_of_the_benchmark():
    assert common.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert common.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(common.spearman([1, 2], [1, 2]))
    assert common.mape([110, 90], [100, 100]) == pytest.approx(10.0)
    rows = [{"real": "ok", "fits": True}, {"real": "OOM", "fits": True}, {"real": "OOM", "fits": False},
            {"real": "ok", "fits": False}, {"real": "kernel n/a", "fits": True}]
    summary = common.fit_summary(rows)
    assert summary["runs"] == 4 and summary["accuracy_pct"] == 50.0
    assert summary["false_fit_pct_of_real_ooms"] == 50.0 and summary["false_oom_pct_of_real_oks"] == 50.0
    groups = real_runs.group_summary([
        {"group": "g", "real": "ok", "fits": True, "time_s": 1.0, "real_time_s": 2.2, "layout": "a"},
        {"group": "g", "real": "ok", "fits": True, "time_s": 2.0, "real_time_s": 2.0, "layout": "b"},
        {"group": "g", "real": "OOM", "fits": False, "time_s": 0.5, "real_time_s": None, "layout": "c"},
    ], lambda r: r["group"])
    assert groups["g"]["memx_pick"]["layout"] == "a" and groups["g"]["regret_pct"] == pytest.approx(10.0)
    assert common.no_nan({"x": [float("nan"), 1.0]}) == {"x": [None, 1.0]}


def test_every_development_run_gets_a_prediction():
    try:
        shared = real_runs.shared_dir()
    except SystemExit:
        pytest.skip("shared/peer-data is not beside this checkout")
    rows = real_runs.hagemann(shared)
    assert len(rows) == 422 and not [r for r in rows if "error" in r]
    assert all(r["peak_gib"] > 0 and r["time_s"] > 0 for r in rows)
    plans = real_runs.sailor(shared)
    assert len(plans) == 15 and all("time_s" in r for r in plans)


def test_calibrated_sailor_plans_go_through_the_learned_model():
    try:
        shared = real_runs.shared_dir()
    except SystemExit:
        pytest.skip("shared/peer-data is not beside this checkout")
    rows, fitted = real_runs.sailor_calibrated(shared, trials=2)
    plain = real_runs.sailor(shared)
    assert len(rows) == 15 and all("time_s" in r for r in rows)
    # The learned model changes the times (blocks, embedding, head), not the analytical memory.
    assert any(abs(a["time_s"] / b["time_s"] - 1) > 0.05 for a, b in zip(rows, plain))
    assert [r["peak_gib"] for r in rows] == [r["peak_gib"] for r in plain]
    parts = fitted["parts_fixed_ms_and_scale_of_analytical"]
    assert parts["head"]["GH-96"]["fixed_ms"] > 0 and 0 < fitted["efficiency_measured"] <= 1


def test_block_activations_against_the_bytes_sailors_blocks_allocated():
    """benchmarks/layer_activations.py where shared/peer-data is present: GPT-Neo's block keeps
    what memx counts at every TP degree, and OPT's part that TP splits is its ReLU MLP's (a GELU
    MLP's count is an f-wide tensor more)."""
    from benchmarks import layer_activations

    try:
        info = layer_activations.measured_blocks(real_runs.shared_dir())
    except SystemExit:
        pytest.skip("shared/peer-data is not beside this checkout")
    neo = layer_activations.compare("GPT-Neo-2.7", info["GPT-Neo-2.7"])
    assert [r["memx_over_measured"] == pytest.approx(1.0, abs=0.01) for r in neo["by_tp"]] == [True] * 3
    for opt in ("OPT-350", "OPT-30"):
        parts = layer_activations.compare(opt, info[opt])["fp32_sbh_tensors"]
        assert parts["memx"]["split"] == pytest.approx(parts["measured"]["split"], rel=0.01), opt


@pytest.mark.parametrize("gpu", ["RTX-3090", "A100-40"])  # a PCIe type and an NVLink type
def test_predictor_benchmark_predicts_on_the_base_its_records_are_learned_against(gpu):
    """The learned ratio multiplies the analytical base it was fitted on: the base of a record's
    own profiled cluster (features.profiled_cluster, at the TP link the record carries) and the
    base the benchmark predicts that record on agree. When the records carried the datasheet
    link, a PCIe type's prediction base was a third above its training base at TP 8."""
    from benchmarks.predictor_accuracy import analytical_records, block_record
    from memx_launch.planning.costmodel import AnalyticalCostModel
    from memx_launch.profiling.features import profiled_cluster
    from memx_launch.specs.cluster import DeviceType
    from memx_launch.specs.training import TrainingSpec

    for tp in (1, 2, 4, 8):
        r = block_record(gpu, "OPT-350", tp, 2, 0.01, "test")
        trained_on = AnalyticalCostModel(r.shape_spec(), profiled_cluster(r, DeviceType(name=gpu, **r.device)),
                                         TrainingSpec(dtype=r.dtype, seq_len=r.seq_len))
        base = trained_on.layer_costs([0], [tp], [2], [r.seq_len], [0]).time_s[0]
        assert analytical_records([r])[0] == pytest.approx(base, rel=1e-12), tp
