"""`memx profile import`: per-layer tables measured elsewhere (memx's schema, Sailor's, Aceso's)
become ProfileDB records a predictor fits on."""

import json

import pytest

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning.tp_links import TpLink
from memx_launch.profiling.profile_import import TABLE_COLUMNS, import_profile
from memx_launch.profiling.profiledb import ProfileDB
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model

MODEL = get_model("opt-350m")
CLUSTER = {"version": 1, "device_types": {"GH-96": {"vendor": "nvidia", "memory_gib": 96, "peak_tflops": 989,
                                                    "peak_tflops_fp32": 67, "compute_capability": 9.0}},
           "nodes": [{"devices": {"GH-96": 4}, "intra_node_gbps": 450}]}


def _device():
    return ClusterSpec.from_dict(CLUSTER).device_type("GH-96")


def _sailor(tmp_path):
    """Sailor's layout: profile[mbs][tp][unit] = [forward, backward, optimizer]; 26 units."""
    units = lambda scale: {str(u): [0.001 * scale, 0.002 * scale, 0.0] for u in range(26)}  # noqa: E731
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"1": {"1": units(1), "2": units(0.6)}, "2": {"1": units(2)}}))
    return path


def test_sailor_profile_gives_block_embedding_and_head_times(tmp_path):
    records = import_profile(str(_sailor(tmp_path)), "sailor", MODEL, _device(), dtype="fp32",
                             tp_link=lambda tp: TpLink(450.0, False))
    by_config = {(r.micro_batch_size, r.tp): r for r in records}
    assert set(by_config) == {(1, 1), (1, 2), (2, 1)}
    r = by_config[(1, 2)]
    assert (r.time_s, r.embedding_time_s, r.head_time_s) == pytest.approx((0.0018, 0.0018, 0.0018))
    assert r.tp_link_gbps == 450.0 and by_config[(1, 1)].tp_link_gbps is None
    assert r.device["peak_tflops_fp32"] == 67 and r.dtype == "fp32" and r.model_signature == MODEL.signature()


def test_aceso_csv_keeps_the_default_kernels(tmp_path):
    path = tmp_path / "A100-40.csv"
    path.write_text("mbs,tp,algo,fwd,bwd,fwd+bwd\n1,1,0,0.01,0.02,0.03\n1,1,1,0.5,0.5,1.0\n2,2,0,0.02,0.03,0.05\n")
    records = import_profile(str(path), "aceso", MODEL, _device(), dtype="fp32")
    assert [(r.micro_batch_size, r.tp, r.time_s) for r in records] == [(1, 1, pytest.approx(0.03)),
                                                                       (2, 2, pytest.approx(0.05))]


def test_memx_table_csv_and_jsonl_with_memory_and_out_of_memory_rows(tmp_path):
    csv_path = tmp_path / "mine.csv"
    csv_path.write_text("tp,micro_batch_size,seq_len,forward_s,backward_s,peak_memory_bytes,feasible,recompute\n"
                        "1,4,1024,0.01,0.02,3e9,,selective\n1,64,1024,,,,false,none\n")
    jsonl_path = tmp_path / "mine.jsonl"
    jsonl_path.write_text('{"tp": 2, "micro_batch_size": 4, "time_s": 0.02, "dtype": "bf16"}\n')
    ok, oom = import_profile(str(csv_path), "table", MODEL, _device(), dtype="bf16")
    assert (ok.time_s, ok.peak_memory_bytes, ok.recompute, ok.seq_len) == (pytest.approx(0.03), 3e9, "selective", 1024)
    assert not oom.feasible and oom.time_s is None
    (row,) = import_profile(str(jsonl_path), "table", MODEL, _device(), dtype=None)
    assert (row.tp, row.dtype, row.seq_len) == (2, "bf16", MODEL.seq_len)
    assert set(TABLE_COLUMNS) >= {"tp", "micro_batch_size", "time_s", "peak_memory_bytes"}


@pytest.mark.parametrize("text, error", [
    ("tp,micro_batch_size,time_s,fp8\n1,1,0.1,yes\n", "row 1: fp8: unknown column"),
    ("tp,micro_batch_size,time_s\n0,1,0.1\n", "row 1: tp: '0' is not a positive integer"),
    ("tp,micro_batch_size\n1,1\n", "row 1: time_s: a feasible row needs a positive time"),
    ("tp,micro_batch_size,forward_s\n1,1,0.1\n", "row 1: forward_s, backward_s: only one"),
    ("tp,micro_batch_size,time_s\n1,1,-2\n", "row 1: time_s: '-2' is not a non-negative number"),
])
def test_a_bad_cell_is_one_line_naming_row_and_column(tmp_path, text, error):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        import_profile(str(path), "table", MODEL, _device(), dtype="bf16")


def test_a_peer_table_without_a_precision_asks_for_dtype(tmp_path):
    with pytest.raises(ConfigError, match="dtype: the table does not say.*pass --dtype"):
        import_profile(str(_sailor(tmp_path)), "sailor", MODEL, _device(), dtype=None)


def test_cli_appends_records_a_predictor_reads(tmp_path, capsys):
    cluster = tmp_path / "gh.yaml"
    cluster.write_text(json.dumps(CLUSTER))
    out = tmp_path / "db.jsonl"
    argv = ["profile", "import", str(_sailor(tmp_path)), "--format", "sailor", "--model", "opt-350m",
            "--cluster", str(cluster), "--dtype", "fp32", "--out", str(out)]
    assert main(argv + ["--tf32"]) == 0
    assert "appended 3 measurements of opt-350m on GH-96" in capsys.readouterr().out
    records = ProfileDB(str(out)).read()
    assert len(records) == 3 and {r.source for r in records} == {"import:sailor"}
    assert {r.tp_link_gbps for r in records if r.tp == 2} == {450.0}
    assert all(r.run_options == {"tf32": True} for r in records)
    # How the blocks ran goes with them: their learned ratios are taken against it.
    assert main(argv + ["--out", str(tmp_path / "ran.jsonl"), "--tf32", "--no-flash-attention", "--no-fused-softmax",
                        "--dropout", "--eager-block"]) == 0
    ran = ProfileDB(str(tmp_path / "ran.jsonl")).read()
    assert all(r.run_options == {"tf32": True, "flash_attention": False, "fused_softmax": False, "dropout": True,
                                 "eager_block": True} for r in ran)
    assert main(argv + ["--device-type", "H100"]) == 2
    assert "--device-type: 'H100' is not a device type" in capsys.readouterr().err


def test_a_block_faster_than_its_matmuls_allow_is_refused_with_the_likely_cause(tmp_path):
    """Several public Sailor profiles time fp32 blocks faster than the fp32 peak allows (their
    matmuls ran as TF32): never faster than compute allows, so the import asks for --tf32."""
    path = tmp_path / "mine.csv"
    # OPT-350's block at 8 x 2,048 tokens: 1.44 TFLOP forward and backward, 21.5 ms at 67 TFLOPS.
    path.write_text("tp,micro_batch_size,time_s\n1,8,0.010\n")
    with pytest.raises(ConfigError, match=r"row 1: time_s: 10 ms is faster than the block's matmuls allow at "
                                          r"GH-96's fp32 peak of 67 TFLOPS \(at least 21.5 ms\); pass --tf32"):
        import_profile(str(path), "table", MODEL, _device(), dtype="fp32")
    (record,) = import_profile(str(path), "table", MODEL, _device(), dtype="fp32", run_options={"tf32": True})
    assert record.time_s == 0.010 and record.run_options == {"tf32": True}  # 2.9 ms at TF32's 494.5 TFLOPS
    path.write_text("tp,micro_batch_size,time_s\n1,8,0.002\n")
    with pytest.raises(ConfigError, match=r"fp32 \(TF32\) peak of 494.5 TFLOPS \(at least 2.9\d* ms\); check --dtype"):
        import_profile(str(path), "table", MODEL, _device(), dtype="fp32", run_options={"tf32": True})
    # Unfused attention multiplies the whole s x s square: 0.21 TFLOP more, 24.6 ms at least.
    path.write_text("tp,micro_batch_size,time_s\n1,8,0.023\n")
    (fused,) = import_profile(str(path), "table", MODEL, _device(), dtype="fp32")
    assert fused.time_s == 0.023  # 21.5 ms at least with fused attention's causal half
    with pytest.raises(ConfigError, match=r"at least 24.6 ms"):
        import_profile(str(path), "table", MODEL, _device(), dtype="fp32", run_options={"flash_attention": False})


def test_a_table_says_the_hosts_time_to_issue_a_block(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("tp,micro_batch_size,time_s,host_time_s\n1,1,0.004,0.003\n")
    (record,) = import_profile(str(path), "table", MODEL, _device(), dtype="bf16")
    assert record.host_time_s == 0.003


def test_the_public_profiles_refused_as_fp32_are_those_the_results_file_names():
    """benchmarks/peer_profile_bounds.py on the peers' tables, where shared/peer-data is present."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import peer_profile_bounds, real_runs

    try:
        peer = os.path.join(real_runs.shared_dir(), "peer-data", "sailor")
    except SystemExit:
        pytest.skip("shared/peer-data is not beside this checkout")
    with open(peer_profile_bounds.OUT) as f:
        committed = json.load(f)
    refused = {r["table"]: r for r in committed["tables"] if r["fp32_import"] != "ok"}
    assert "sailor GPT-Neo-2.7/A100-40" in refused and "sailor OPT-350/GH-96" not in refused
    for table in ("sailor GPT-Neo-2.7/A100-40", "sailor OPT-350/GH-96"):
        fmt, rest = table.split(" ")
        model_dir, gpu = rest.split("/")
        again = peer_profile_bounds.table_bounds(os.path.join(peer, "profiles", model_dir, gpu, "profile.json"),
                                                 fmt, model_dir, gpu)
        assert again == next(r for r in committed["tables"] if r["table"] == table)
    assert all(r["tf32_import"] == "ok" for r in refused.values())
