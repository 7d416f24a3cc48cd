"""`memx estimate --cases`: one JSON line per row, every row on its own, the columns it reads."""

import json
import os
import shutil

import numpy as np
import pytest

from memx_launch.cli import main
from memx_launch.planning.cases import CaseRunner, read_cases
from memx_launch.planning.estimate import LayoutScorer, evaluate_layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
TABLE1 = os.path.join(CLUSTERS, "table1-2vendor.yaml")


def _cases(tmp_path, text, name="cases.csv"):
    """A cases file next to a copy of the Table 1 cluster, which rows name by a relative path."""
    shutil.copy(TABLE1, tmp_path / "t1.yaml")
    path = tmp_path / name
    path.write_text(text)
    return path


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_rows_match_single_estimates_and_bad_rows_stay_alone(tmp_path, capsys):
    path = _cases(tmp_path, "id,model,cluster,tp,pp,dp,micro_batch_size,global_batch_size,layers_per_stage,"
                            "recompute,stage_devices,stage_tp\n"
                            "fit,llama2-7b,t4.yaml,,,,,,,,,\n"   # unreadable cluster: this row only
                            "ok,llama2-7b,t1.yaml,2,2,4,1,64,16/16,full:every2|full,vendor-y-64gb|vendor-x-32gb,2|2\n"
                            "oom,llama2-7b,t1.yaml,1,2,8,1,64,21/11,none,,\n"
                            "bad,llama2-7b,t1.yaml,,2,4,1,64,,full,,4|2\n"
                            "few,llama2-7b,t1.yaml,1,2,8,1,8,,full,,\n"
                            "het,llama2-7b,t1.yaml,,3,2,1,64,,full,,4|2|2\n"
                            "mixed,llama2-7b,t1.yaml,4,2,2,1,64,,full,vendor-x-32gb+vendor-y-64gb|vendor-x-32gb"
                            "+vendor-y-64gb,\n")
    code, rows, err = _run(capsys, "estimate", "--cases", str(path))
    assert code == 0, err
    assert [r["row"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["id"] for r in rows] == ["fit", "ok", "oom", "bad", "few", "het", "mixed"]
    assert rows[0]["error"].startswith("cluster: cannot read")
    assert rows[3]["error"] == ("stage_tp/dp: sum(stage_tp)*dp = 24 but the cluster has 16 devices; "
                                "choose degrees whose devices add up to the world size")
    assert "7 rows: 3 fit, 2 do not fit, 2 error" in err

    cluster = ClusterSpec.from_yaml(TABLE1)
    model = get_model("llama2-7b")
    for row, kwargs in ((rows[1], dict(tp=2, dp=4, layers_per_stage=[16, 16], recompute=["full:every2", "full"],
                                       stage_devices=["vendor-y-64gb", "vendor-x-32gb"])),
                        (rows[2], dict(tp=1, dp=8, layers_per_stage=[21, 11], recompute="none"))):
        plan = evaluate_layout(model, cluster, TrainingSpec(global_batch_size=64, seq_len=model.seq_len), pp=2,
                               micro_batch_size=1, references=(1, 1, 1), **kwargs)
        peaks = [s.predicted_peak_memory_gib for s in plan.stages]
        assert row["stage_peak_memory_gib"] == pytest.approx(peaks)
        assert row["peak_memory_gib"] == pytest.approx(max(peaks))
        assert row["iteration_time_s"] == pytest.approx(plan.predicted_iteration_time_s)
        over = [max(0.0, p - s.memory_capacity_gib) for p, s in zip(peaks, plan.stages)]
        assert row["short_gib"] == pytest.approx(over, abs=1e-6)
        assert row["fits"] == (max(over) == 0) and row["split"] == "given"
        assert "phi" not in row  # not asked for (--phi): no reference search ran
    assert rows[1]["fits"] and not rows[2]["fits"] and rows[2]["short_gib"][0] > 0
    # Fewer micro-batches (1) than stages (2) is estimated, with the even split said.
    assert rows[4]["num_microbatches"] == 1 and rows[4]["split"] == "even"
    assert rows[4]["layers_per_stage"] == [16, 16]
    # Per-stage TP and a stage spread over two device types give the estimate the flags give.
    for row, kwargs in ((rows[5], dict(tp=None, stage_tp=[4, 2, 2], pp=3, dp=2)),
                        (rows[6], dict(tp=4, pp=2, dp=2, stage_devices=["vendor-x-32gb+vendor-y-64gb"] * 2))):
        plan = evaluate_layout(model, cluster, TrainingSpec(global_batch_size=64, seq_len=model.seq_len),
                               micro_batch_size=1, recompute="full", references=(1, 1, 1), **kwargs)
        assert row["stage_peak_memory_gib"] == pytest.approx([s.predicted_peak_memory_gib for s in plan.stages])
        assert row["iteration_time_s"] == pytest.approx(plan.predicted_iteration_time_s) and row["fits"]


def test_jsonl_flag_defaults_out_file_and_headroom(tmp_path, capsys):
    lines = [{"tp": 1, "pp": 2, "dp": 8, "micro_batch_size": 1, "layers_per_stage": [16, 16], "recompute": "full"},
             {"tp": 1, "pp": 2, "dp": 8, "micro_batch_size": 1, "recompute": "full", "global_batch_size": 8,
              "dtype": "fp32"},
             "not an object", {"tp": 1, "pp": 2, "dp": 8, "micro_batch_size": 1, "colour": "red"},
             {"tp": 1, "pp": 2, "dp": 8, "micro_batch_size": 1, "distributed_optimizer": "maybe"}]
    path = _cases(tmp_path, "\n".join(json.dumps(x) for x in lines) + "\n\n{broken\n", "cases.jsonl")
    out = tmp_path / "out.jsonl"
    base = ["estimate", "--cases", str(path), "--model", "llama2-7b", "--cluster", TABLE1, "--global-batch-size", "64"]
    code, printed, err = _run(capsys, *base, "--out", str(out))
    assert code == 0 and printed == [] and "written to" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    assert "fits" in rows[0] and rows[1]["num_microbatches"] == 1
    # the dtype cell reaches the training spec: fp32 model states differ from bf16 mixed precision
    assert rows[1]["stage_peak_memory_gib"][1] != pytest.approx(rows[0]["stage_peak_memory_gib"][1], rel=1e-3)
    assert rows[2]["error"].startswith("line 3: not a JSON object")
    assert rows[3]["error"].startswith("colour: unknown column")
    assert rows[4]["error"] == "distributed_optimizer: expected true or false, got 'maybe'"
    assert rows[5]["error"].startswith("line 7: this line is not valid JSON")
    # The output is never overwritten without --force; with a headroom, less fits.
    code, _, err = _run(capsys, *base, "--out", str(out))
    assert code == 2 and "--out: " in err and "already exists" in err
    code, _, _ = _run(capsys, *base, "--out", str(out), "--force", "--memory-headroom", "0.5")
    tight = [json.loads(line) for line in out.read_text().splitlines()]
    assert tight[0]["stage_peak_memory_gib"] == rows[0]["stage_peak_memory_gib"]
    assert sum(tight[0]["short_gib"]) > sum(rows[0]["short_gib"])


def test_training_columns_follow_trainingspec_fields(tmp_path):
    """A column naming a TrainingSpec field goes there by name and changes the estimate; an empty
    cell is the default."""
    runner = CaseRunner(str(tmp_path), {"model": "llama2-7b", "cluster": TABLE1})
    layout = {"tp": "1", "pp": "2", "dp": "8", "micro_batch_size": "1", "global_batch_size": "64",
              "recompute": "full"}
    plain = runner.estimate(dict(layout))
    sharded = runner.estimate({**layout, "distributed_optimizer": "true"})
    assert sharded["stage_peak_memory_gib"][0] < plain["stage_peak_memory_gib"][0]
    for column, value in (("setup", "megatron"), ("flash_attention", "false")):
        result = runner.estimate({**layout, column: value})
        assert result["stage_peak_memory_gib"] != plain["stage_peak_memory_gib"], column
        assert "error" not in runner.estimate({**layout, column: ""})  # empty cell = default
    # Sequence parallelism splits activations over TP, so it needs a row with TP > 1.
    tp2 = {**layout, "tp": "2", "dp": "4"}
    assert runner.estimate({**tp2, "sequence_parallel": "true"})["stage_peak_memory_gib"][0] < \
        runner.estimate(tp2)["stage_peak_memory_gib"][0]


def test_what_one_scorer_keeps_between_rows_never_changes_a_row():
    """A scorer keeps a layout's level-free inputs, cost tables and collectives' candidates from
    row to row; rows asked in any order, alternating layouts, micro-batches and a stage spread
    over two device types, give what a fresh scorer gives each alone, to the last bit."""
    model, cluster = get_model("llama2-7b"), ClusterSpec.from_yaml(TABLE1)
    training = TrainingSpec(global_batch_size=64, seq_len=model.seq_len, distributed_optimizer=True)
    rows = [dict(tp=1, pp=2, dp=8, micro_batch_size=1, recompute="none"),
            dict(tp=1, pp=2, dp=8, micro_batch_size=2, recompute="full"),
            dict(tp=2, pp=2, dp=4, micro_batch_size=2, recompute="full", layers_per_stage=[20, 12]),
            dict(tp=2, pp=2, dp=4, micro_batch_size=1, recompute="none", layers_per_stage=[12, 20]),
            dict(tp=4, pp=2, dp=2, micro_batch_size=1, recompute="selective",
                 stage_devices=["vendor-y-64gb+vendor-x-32gb", "vendor-x-32gb+vendor-y-64gb"])]
    shared = LayoutScorer(model, cluster, training)
    for row in rows + rows[::-1]:
        kept, _ = shared.score(**row)
        alone, _ = LayoutScorer(model, cluster, training).score(**row)
        assert np.array_equal(kept.memory, alone.memory) and np.array_equal(kept.T, alone.T)
        assert np.array_equal(kept.stage_time, alone.stage_time) and np.array_equal(kept.layers, alone.layers)


def test_many_rows_reuse_parsed_inputs_and_search_for_phi_only_when_asked(tmp_path, monkeypatch):
    """Rows of one model, cluster and training share the parsed cluster and scorer; Phi's
    reference search runs once for them with ``phi``, never without."""
    from memx_launch.planning import cases

    rows = [{"tp": 1, "pp": 2, "dp": 8, "micro_batch_size": 1, "layers_per_stage": [16 + k, 16 - k]}
            for k in range(8)]
    defaults = {"model": "llama2-7b", "cluster": TABLE1, "global_batch_size": 64}
    searches, search = [], cases.default_references
    monkeypatch.setattr(cases, "default_references", lambda *a: searches.append(a) or search(*a))
    runner = CaseRunner(str(tmp_path), defaults)
    results = [runner.estimate(r) for r in rows]
    assert all("error" not in r and "phi" not in r for r in results) and searches == []
    assert len(runner._clusters) == 1 and len(runner._scorers) == 1
    peaks0 = [r["stage_peak_memory_gib"][0] for r in results]
    assert peaks0 == sorted(peaks0)  # more layers on stage 0, more memory there

    with_phi = CaseRunner(str(tmp_path), defaults, phi=True)
    scored = [with_phi.estimate(r) for r in rows]
    assert len(searches) == 1 and all(r["phi"] > 0 for r in scored)
    # Phi as memx estimate gives it for the same layout, the rest as without --phi.
    model, cluster = get_model("llama2-7b"), ClusterSpec.from_yaml(TABLE1)
    plan = evaluate_layout(model, cluster, TrainingSpec(global_batch_size=64, seq_len=model.seq_len), tp=1, pp=2,
                           dp=8, micro_batch_size=1, layers_per_stage=[16, 16])
    assert scored[0]["phi"] == pytest.approx(plan.objective.phi)
    assert [{k: v for k, v in r.items() if k != "phi"} for r in scored] == results


def test_a_row_names_every_column_memx_cannot_express(tmp_path, capsys):
    path = _cases(tmp_path, "id,tp,pp,dp,cp_comm_type,context_parallel,recompute,lora-rank\n"
                            "a,1,2,8,true,2,full,16\n"
                            "b,1,2,8,,,full,\n")
    code, rows, err = _run(capsys, "estimate", "--cases", str(path), "--model", "llama2-7b", "--cluster", TABLE1)
    assert code == 0, err
    assert rows[0] == {"row": 1, "id": "a", "error": "cp_comm_type, context_parallel, lora-rank: unknown columns; "
                                                      "use the columns listed in docs/estimate.md"}
    assert "error" not in rows[1]  # empty cells ask for nothing
    # --phi scores Phi; --weights without --phi would change nothing, and --phi needs --cases.
    assert "phi" in _run(capsys, "estimate", "--cases", str(path), "--model", "llama2-7b", "--cluster", TABLE1,
                         "--phi")[1][1]
    code, _, err = _run(capsys, "estimate", "--cases", str(path), "--weights", "1,0,0")
    assert code == 2 and "--weights: only changes Phi" in err
    code, _, err = _run(capsys, "estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "1", "--pp", "2",
                        "--dp", "8", "--micro-batch-size", "1", "--phi")
    assert code == 2 and "--phi: only with --cases" in err


def test_a_profile_of_several_models_is_fitted_once(tmp_path, capsys, monkeypatch):
    """Rows of two models on a profile DB holding both: one predictor fit for the file (not one
    per model, each overwriting the other's cache), and none on the next run; the file is read
    once per run, however many setups its rows ask."""
    from memx_launch.profiling import predictor
    from memx_launch.profiling.profiledb import ProfileDB
    from tests.test_predictor import synthetic_records

    (tmp_path / "c.yaml").write_text(
        "version: 1\nname: c\ndevice_types:\n  dev: {vendor: nvidia, memory_gib: 16, peak_tflops: 50, "
        "memory_bandwidth_gbps: 900}\nnodes:\n  - {name: n, devices: {dev: 4}, intra_node_gbps: 100}\n"
        "inter_node_gbps: 100\n")
    db = str(tmp_path / "profile.jsonl")  # the records' device is c.yaml's "dev"
    ProfileDB(db).append(synthetic_records(mbs_values=(1, 4), seqs=(32, 128))
                         + synthetic_records(mbs_values=(1, 4), seqs=(32, 128), spec=get_model("llama-small")))
    path = _cases(tmp_path, "model,tp,pp,dp,micro_batch_size,seq_len,dtype\n"
                            "llama-tiny,1,2,2,1,64,fp32\nllama-small,1,2,2,1,64,fp32\nllama-tiny,2,2,1,2,64,fp32\n")
    fits, fit = [], predictor.fit_predictor
    monkeypatch.setattr(predictor, "fit_predictor", lambda *a, **k: fits.append(1) or fit(*a, **{**k, "trials": 2}))
    reads, read = [], ProfileDB.read
    monkeypatch.setattr(ProfileDB, "read", lambda self: reads.append(1) or read(self))
    argv = ["estimate", "--cases", str(path), "--cluster", str(tmp_path / "c.yaml"), "--global-batch-size", "8",
            "--profile-db", db]
    code, rows, err = _run(capsys, *argv)
    assert code == 0 and fits == [1] and not [r for r in rows if "error" in r], (rows, err)
    assert rows[0]["stage_peak_memory_gib"] != rows[1]["stage_peak_memory_gib"]  # each model its own
    assert reads == [1]  # two setups (the models), one read
    code, again, _ = _run(capsys, *argv)
    assert code == 0 and fits == [1] and again == rows and reads == [1, 1]
    # A model the profile holds no record of is its rows' error; the other rows still run.
    (tmp_path / "more.csv").write_text(path.read_text() + "tinyllama-1.1b,1,2,2,1,64,fp32\n")
    code, more, _ = _run(capsys, *argv[:2], str(tmp_path / "more.csv"), *argv[3:])
    assert code == 0 and more[:3] == rows and "holds measurements of" in more[3]["error"]


def test_csv_with_too_many_cells_is_that_rows_error(tmp_path):
    path = _cases(tmp_path, "tp,pp\n1,2\n1,2,3\n")
    rows = list(read_cases(str(path)))
    assert rows[0] == (1, {"tp": "1", "pp": "2"})
    assert "more cells than the header" in str(rows[1][1])


def test_example_cases_file_runs_with_paths_relative_to_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the cluster column is found from the file's folder, not the working one
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "cases", "table1-layouts.csv")
    code, rows, err = _run(capsys, "estimate", "--cases", example)
    assert code == 0 and len(rows) == 5 and not [r for r in rows if "error" in r], rows
    by_id = {r["id"]: r for r in rows}
    # Paper Table 1: the compute-proportional split overflows the 32 GB part, the memory one fits.
    assert not by_id["compute-split"]["fits"] and by_id["memory-split"]["fits"]
    assert by_id["one-microbatch"]["num_microbatches"] == 1


def test_interleaved_rows_need_whole_rounds_of_micro_batches(tmp_path):
    runner = CaseRunner(str(tmp_path), {"model": "llama2-7b", "cluster": TABLE1})
    row = {"tp": 2, "pp": 2, "dp": 4, "micro_batch_size": 1, "schedule": "interleaved", "virtual_stages": 2,
           "recompute": "full", "distributed_optimizer": True}
    assert "error" not in runner.estimate({**row, "global_batch_size": 16})
    assert runner.estimate({**row, "global_batch_size": 4})["error"].startswith(
        "global_batch_size: 1 micro-batches for the interleaved schedule on pp=2")
    assert runner.estimate({k: v for k, v in row.items() if k != "virtual_stages"})["error"].startswith(
        "virtual_stages: missing")


def test_training_flags_fill_the_empty_cells_of_every_row(tmp_path, capsys):
    # Every training flag, as the README says (--setup here), not only the batch size and the dtype.
    path = _cases(tmp_path, "id,tp,pp,dp,micro_batch_size,setup\n"
                            "flag,1,2,8,1,\ncolumn,1,2,8,1,zero3\nown,1,2,8,1,ddp\n")
    code, rows, err = _run(capsys, "estimate", "--cases", str(path), "--model", "llama2-7b", "--cluster", TABLE1,
                           "--global-batch-size", "64", "--setup", "zero3")
    assert code == 0, err
    by_id = {r["id"]: r for r in rows}
    assert by_id["flag"] == {**by_id["column"], "id": "flag", "row": 1}  # the flag filled the empty cell
    assert by_id["own"]["peak_memory_gib"] != by_id["flag"]["peak_memory_gib"]  # a cell wins over the flag
