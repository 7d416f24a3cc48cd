"""benchmarks/published_throughput.py: the published tables as data and memx's step time on them."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import published_throughput as pt  # noqa: E402
from benchmarks.common import GPUS  # noqa: E402


def test_narayanan_step_time_follows_the_paper_s_flop_count():
    # Table 1's 1T row: 163 TFLOP/s per GPU on 3,072 GPUs. Eq. 3 (full recompute, with the
    # attention and vocabulary terms) lands within 2% of the paper's own shortcut, Eq. 4: 8 FLOPs
    # per parameter (1,008B) and token, 3,072 sequences of 2,048 tokens a step.
    flops = pt.narayanan_flops(3072, 2048, 128, 25600, 51200)
    assert flops / (3072 * 163e12) == pytest.approx(8 * 1008e9 * 3072 * 2048 / (3072 * 163e12), rel=0.02)
    # A layout per micro-batch size and schedule; interleaving only with v dividing the layers per stage.
    assert list(pt.narayanan_layouts(layers=105, pp=35)) == [
        (mbs, schedule, v) for mbs in (1, 2, 4, 8) for schedule, v in (("1f1b", 1), ("interleaved", 3))]
    assert list(pt.narayanan_layouts(layers=24, pp=1)) == [(mbs, "1f1b", 1) for mbs in (1, 2, 4, 8)]


def test_every_published_row_gets_a_prediction_and_the_layouts_are_consistent():
    rows = pt.mpt()
    assert len(rows) == 191 and not [r for r in rows if "error" in r]
    # Every published run ran, and memx says each one fits.
    assert all(r["fits"] for r in rows)
    narayanan = pt.narayanan()
    assert len(narayanan) == 10 and all(r["time_s"] > 0 and r["fits"] for r in narayanan)


def test_hopper_s_default_efficiency_reproduces_mpt_s_a100_over_h100_step_time():
    """docs/clusters.md: Hopper's default efficiency (0.58 of H100's peak) is what reproduces the
    MPT table's A100/H100 step-time ratio on its matmul-bound layouts (the same layout on both)."""
    rows = pt.mpt()
    ratio = pt.a100_over_h100(rows)
    assert ratio["pairs"] == 17
    assert ratio["predicted_median"] == pytest.approx(ratio["measured_median"], rel=0.05)
    # Attention-bound pairs, at the kernels' published shares of H100's peak: each within 6%.
    long = pt.a100_over_h100(rows, (16384, 65536))
    assert long["pairs"] == 12 and all(0.94 <= r <= 1.06 for r in long["measured_over_predicted"])


def test_torchtitan_rows_are_asked_as_they_ran():
    rows = pt.torchtitan()
    assert len(rows) == 28 and not [r for r in rows if "error" in r]
    # Tokens per step: the local batch on every FSDP rank (a CP, TP or PP group shares one), no accumulation.
    cp8 = next(r for r in rows if "cp8" in r["layout"])
    assert (cp8["tokens"], cp8["seq_len"]) == (262144, 262144)
    pp = next(r for r in rows if "pp8 1f1b b32" in r["layout"])
    assert "fsdp8 cp1 tp8" in pp["layout"] and pp["tokens"] == 32 * 8 * 8192
    ratios = {r["what"]: r for r in pt.torchtitan_ratios(rows)}
    assert len(ratios) == 15 and all(r["predicted"] > 0 for r in ratios.values())
    # torchtitan's default split of Llama 3.1 405B's 126 layers: 8 stages of 15-16, or 16 of 7-8 (two a rank).
    assert pt.torchtitan_stage_layers(126, 8, 1) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert pt.torchtitan_stage_layers(126, 8, 2) == [7 + 8, 8 + 8, 8 + 8, 8 + 8, 8 + 8, 8 + 8, 8 + 8, 8 + 7]
    assert pt.torchtitan_stage_layers(32, 4, 1) == [8, 8, 8, 8]
    # Never faster than 6 FLOPs per parameter and token at the peak (FP8's, twice it, for Float8 rows).
    from memx_launch.specs.catalog import get_model
    for r in rows:
        peak = GPUS[r["gpu"]][0]["peak_tflops"] * 1e12 * (2 if "float8" in r["layout"] else 1)
        assert r["time_s"] >= 6 * get_model(r["model"]).total_params * r["tokens"] / (r["gpus"] * peak)


def test_the_h100_rows_power_limit_slows_them_by_at_most_the_clock_it_takes():
    from memx_launch.specs.efficiency import power_limited_clock_share

    capped = {r["layout"]: r["time_s"] for r in pt.torchtitan() if r["gpu"] == "h100_96gb"}
    rated = {r["layout"]: r["time_s"] for r in pt.torchtitan(rated_power=True) if r["gpu"] == "h100_96gb"}
    assert len(capped) == 18 and capped.keys() == rated.keys()
    for layout, seconds in capped.items():  # compute slows by the clock; HBM, links and the host do not
        assert 1.02 < seconds / rated[layout] <= 1 / power_limited_clock_share(500, 700) + 1e-9


def test_no_prediction_beats_the_peak_flops_of_the_layout():
    # 6 FLOPs per parameter and token (8 with recomputation) at the datasheet peak bound the step time.
    for r in pt.mpt():
        layers, hidden, _ = pt.MPT_SHAPES[r["model"].removeprefix("mpt-")]
        flops = (8 if r["recompute"] == "full" else 6) * 12 * layers * hidden ** 2 * r["tokens"]
        assert r["time_s"] >= flops / (r["gpus"] * GPUS[r["group"]][0]["peak_tflops"] * 1e12)


def test_automodel_rows_are_transcribed_consistently_and_all_expressible():
    import csv

    from benchmarks import automodel_throughput as at
    with open(at.DATA) as f:
        table = list(csv.DictReader(f))
    for d in table:
        # The published step time, tokens per second per GPU and global batch agree (the rounding's 0.5%),
        # and the local batch is micro-batches of the FSDP ranks' accumulation.
        tokens = int(d["global_batch_size"]) * int(d["seq_len"])
        assert tokens / (float(d["step_time_s"]) * int(d["gpus"])) == pytest.approx(float(d["tokens_per_s_per_gpu"]),
                                                                                     rel=0.005)
        assert int(d["global_batch_size"]) % (int(d["fsdp"]) * int(d["local_batch_size"])) == 0
    rows = at.automodel_rows()
    assert len(rows) == len(table) and not [r for r in rows if "error" in r]
    # Only DeepSeek-V3 on 1,024 GPUs shards its experts (EP 64 of a stage's 256 ranks); elsewhere EP is
    # as wide as the stage and each expert is whole on its rank.
    assert [r["expert_data_parallel"] for r in rows] == [4 if r["gpus"] == 1024 else 1 for r in rows]
    # The runs' consecutive routing never sends a token to more ranks or nodes than random routing would.
    assert all(r[f"{units}_per_token"]["consecutive"] <= r[f"{units}_per_token"]["random"]
               for r in rows for units in ("ranks", "nodes"))
    assert at.even_split(61, 4) == [16, 15, 15, 15] and at.even_split(61, 8) == [8] * 5 + [7] * 3
