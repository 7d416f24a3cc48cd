"""`memx plan`, `memx estimate`, `memx export`: outputs, plan files, and every bad input."""

import argparse
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning.plan import Plan

ROOT = os.path.join(os.path.dirname(__file__), "..")
CLUSTERS = os.path.join(ROOT, "examples", "clusters")
PAPER = os.path.join(CLUSTERS, "paper-20gpu.yaml")
TABLE1 = os.path.join(CLUSTERS, "table1-2vendor.yaml")
MODEL_FOR = {"hetero-1024": "llama3-70b", "cpu-emulated": "llama-tiny", "cpu-two-vendors": "llama-tiny",
             "cpu-three-vendors": "llama-tiny",
             "cpu-emulated-ddp": os.path.join(os.path.dirname(CLUSTERS), "models", "lightning-gpt")}
PLAN_FIELDS = {"version", "model", "cluster", "tp", "pp", "dp", "micro_batch_size", "global_batch_size", "seq_len",
               "schedule", "virtual_stages", "stages", "predicted_iteration_time_s", "objective"}
STAGE_FIELDS = {"device_type", "ranks", "num_layers", "recompute", "predicted_peak_memory_gib",
                "predicted_stage_time_s"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err):
    lines = [line for line in err.splitlines() if line.startswith("memx: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("cluster", sorted(glob.glob(os.path.join(CLUSTERS, "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_plan_on_every_example_cluster_writes_a_complete_plan(tmp_path, capsys, cluster):
    name = os.path.splitext(os.path.basename(cluster))[0]
    out_json, out_png = tmp_path / "plan.json", tmp_path / "pareto.png"
    code, out, err = run(capsys, "plan", "--model", MODEL_FOR.get(name, "llama2-7b"), "--cluster", cluster,
                         "--top", "3", "--json", str(out_json), "--plot", str(out_png),
                         "--search-budget-s", "60")
    assert code == 0, err
    data = json.loads(out_json.read_text())
    assert PLAN_FIELDS <= set(data)
    assert {"phi", "profile", "weights"} <= set(data["objective"])
    for stage in data["stages"]:
        assert STAGE_FIELDS <= set(stage)
    plan = Plan.from_dict(data)
    assert plan.world_size == sum(len(s.ranks) for s in plan.stages)
    assert all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in plan.stages)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "why it won: phi=" in out and "T " in out and "M " in out and "V " in out
    assert "configurations enumerated" in err  # progress and statistics go to stderr
    if "emulated" in name:
        assert "EMULATED" in out


def test_plan_flags_reach_the_search(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--global-batch-size", "64",
                         "--seq-len", "2048", "--weights", "1,0,0", "--json", str(out_json), "--quiet")
    assert code == 0
    plan = json.loads(out_json.read_text())
    assert (plan["global_batch_size"], plan["seq_len"]) == (64, 2048)
    assert plan["objective"]["profile"] == "custom"
    assert plan["objective"]["weights"] == [1.0, 0.0, 0.0]
    assert "search:" in err and "groups" not in err  # --quiet drops progress lines, keeps the summary
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--objective", "throughput",
                       "--quiet")
    assert "profile 'throughput'" in out


def test_plan_says_what_the_winner_trades_against_the_fastest_plan(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--quiet", "--compare")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("against the fastest feasible plan"))
    # The trade is named with its signs (the pick may hold a little more peak memory for far less variance).
    assert re.search(r": \+[0-5]% time for [+-]\d+% peak memory, -\d+% memory variance \(--max-slowdown 5%\)$",
                     line), line
    assert "without --max-slowdown's bound the profile would pick" in out
    compared = out.split("compared in the same cost model:")[1].splitlines()
    times = {name: float(next(line for line in compared if line.startswith(name + "  "))[len(name):].split()[0])
             for name in ("memx", "memx unbounded", "time-only")}
    assert times["memx"] <= 1.05 * times["time-only"] < times["memx unbounded"]
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--quiet", "--objective", "default")
    assert "(no bound: --objective or --weights without --max-slowdown)" in out and "without --max-slowdown's" not in out
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--quiet", "--max-slowdown", "0")
    assert "the winner is the fastest feasible plan (--max-slowdown 0%)" in out


def test_bf16_on_a_device_without_it_is_planned_in_fp16_and_said_or_refused_when_asked(tmp_path, capsys):
    v100 = os.path.join(CLUSTERS, "v100-t4.yaml")
    out_json = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", v100, "--global-batch-size", "8",
                       "--quiet", "--json", str(out_json))
    assert code == 0
    assert ("precision: fp16, not the default bf16: no bf16 on v100-32gb (compute capability 7.0), "
            "t4-16gb (compute capability 7.5)") in out
    assert Plan.load(str(out_json)).training["dtype"] == "fp16"
    code, out, err = run(capsys, "plan", "--model", "llama2-7b", "--cluster", v100, "--dtype", "bf16", "--quiet")
    assert code == 2 and "--dtype: bf16, but there is no bf16 on v100-32gb" in one_error_line(err)
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--quiet")
    assert "precision:" not in out  # no compute capability under 8.0 declared there


def test_compare_on_the_table1_case(capsys):
    """Paper Table 1: compute-proportional overflows the 32 GB part, memory-proportional fits."""
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", TABLE1, "--compare", "--quiet")
    assert code == 0
    rows = {re.split(r"\s{2,}", line)[0]: line for line in out.split("compared in the same cost model:")[1].splitlines()
            if line and line.split()[0] in ("compute-proportional", "memory-proportional", "time-only", "memx")}
    assert set(rows) == {"compute-proportional", "memory-proportional", "time-only", "memx", "memx unbounded"}
    assert "yes," in rows["compute-proportional"] and "GiB over" in rows["compute-proportional"]
    assert rows["memory-proportional"].split()[4] == "no"
    assert rows["memx"].split()[4] == "no"


def test_estimate_of_a_plan_gives_the_plans_predictions(tmp_path, capsys):
    plan_json, est_json = tmp_path / "plan.json", tmp_path / "est.json"
    assert run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--json", str(plan_json),
               "--quiet")[0] == 0
    code, out, err = run(capsys, "estimate", "--plan", str(plan_json), "--cluster", PAPER, "--json", str(est_json))
    assert code == 0, err
    planned, estimated = Plan.load(str(plan_json)), Plan.load(str(est_json))
    assert estimated.predicted_iteration_time_s == pytest.approx(planned.predicted_iteration_time_s, rel=1e-9)
    assert estimated.objective.phi == pytest.approx(planned.objective.phi, rel=1e-9)
    for a, b in zip(planned.stages, estimated.stages):
        assert (a.device_type, a.ranks, a.num_layers, a.recompute) == (b.device_type, b.ranks, b.num_layers, b.recompute)
        assert b.predicted_peak_memory_gib == pytest.approx(a.predicted_peak_memory_gib, abs=1e-3)
        assert b.predicted_stage_time_s == pytest.approx(a.predicted_stage_time_s, rel=1e-9)
    assert "fits: every stage is under its capacity" in out


def test_estimate_reports_oom_by_how_much(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "1", "--pp", "2",
                       "--dp", "8", "--micro-batch-size", "1", "--global-batch-size", "64",
                       "--layers-per-stage", "21,11", "--recompute", "none,none")
    assert code == 3  # the layout does not fit
    stage0 = next(line for line in out.splitlines() if line.strip().startswith("0 "))
    assert "vendor-x-32gb" in stage0 and "OOM by" in stage0
    assert "OOM: stage 0 short" in out and "phi=" in out and "predicted iteration time" in out


def test_estimate_setup_flags_reach_the_plan(tmp_path, capsys):
    peaks = {}
    for setup, extra in (("ddp", []), ("megatron", ["--no-sequence-parallel", "--grad-dtype", "bf16"])):
        out_json = tmp_path / f"{setup}.json"
        code, _, _ = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "2", "--pp", "4",
                         "--dp", "2", "--micro-batch-size", "1", "--global-batch-size", "64", "--recompute", "full",
                         "--setup", setup, *extra, "--json", str(out_json))
        assert code == 0
        plan = Plan.load(str(out_json))
        assert plan.training["setup"] == setup
        peaks[setup] = max(s.predicted_peak_memory_gib for s in plan.stages)
    assert plan.training["sequence_parallel"] is False and plan.training["grad_dtype"] == "training"
    assert plan.training["distributed_optimizer"] is True
    assert peaks["megatron"] < peaks["ddp"]


def test_every_training_flag_of_plan_and_estimate_reaches_the_training_spec():
    # A flag parsed but not passed on would be ignored without a word (--shard-degree once was).
    import dataclasses

    from memx_launch.cli.common import RUN_FLAGS, SETUP_FLAGS
    from memx_launch.cli.main import build_parser
    from memx_launch.specs.training import TrainingSpec

    fields = {f.name for f in dataclasses.fields(TrainingSpec)}
    passed = set(RUN_FLAGS) | set(SETUP_FLAGS) | {"global_batch_size", "seq_len", "dtype", "optimizer", "setup"}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("plan", "estimate"):
        parsed = {action.dest for action in commands[command]._actions} & fields
        assert parsed and parsed <= passed, (command, sorted(parsed - passed))


def test_estimate_passes_the_shard_degree_on(tmp_path, capsys):
    cluster = tmp_path / "two-nodes.yaml"
    cluster.write_text("version: 1\nname: two-nodes\ninter_node_gbps: 25\ndevice_types:\n"
                       "  a100: {vendor: nvidia, memory_gib: 80, peak_tflops: 312}\nnodes:\n"
                       + "  - {devices: {a100: 8}, intra_node_gbps: 300}\n" * 2)
    peaks = {}
    for extra in ([], ["--shard-degree", "4"]):
        out_json = tmp_path / f"{len(extra)}.json"
        code, _, _ = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", str(cluster), "--tp", "1", "--pp",
                         "1", "--dp", "16", "--micro-batch-size", "1", "--global-batch-size", "32", "--recompute",
                         "full", "--setup", "fsdp2", *extra, "--json", str(out_json))
        assert code == 0
        plan = Plan.load(str(out_json))
        assert plan.training.get("shard_degree") == (4 if extra else None)
        peaks[len(extra)] = max(s.predicted_peak_memory_gib for s in plan.stages)
    assert peaks[2] > peaks[0]  # a rank keeps a quarter of the states, not a sixteenth


def test_estimate_per_stage_recompute_and_devices(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "1", "--pp", "2",
                       "--dp", "8", "--micro-batch-size", "1", "--global-batch-size", "64",
                       "--stage-devices", "vendor-y-64gb,vendor-x-32gb", "--recompute", "none,full",
                       "--layers-per-stage", "20,12")
    assert code == 3  # both stages over capacity
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("0 ", "1 ")]
    assert [r[1] for r in rows] == ["vendor-y-64gb", "vendor-x-32gb"]
    assert [r[4] for r in rows] == ["none", "full"]
    assert [r[3] for r in rows] == ["20", "12"]


def test_export_prints_megatron_env_and_torchrun(tmp_path, capsys):
    plan_json = tmp_path / "plan.json"
    run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--json", str(plan_json), "--quiet")
    code, out, _ = run(capsys, "export", "--plan", str(plan_json), "--cluster", PAPER)
    assert code == 0
    assert "--pipeline-model-parallel-layout" in out and "export MEMX_PLAN=" in out
    assert out.count("torchrun --nnodes 3") == 6


# --------------------------------------------------------------------------- bad input


def test_malformed_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nnodes: [\n")
    code, _, err = run(capsys, "plan", "--model", "llama2-7b", "--cluster", str(bad))
    assert code == 2
    assert "is not valid YAML at line" in one_error_line(err)


def test_unknown_key(tmp_path, capsys):
    text = open(PAPER).read().replace("inter_node_gbps: 28", "inter_node_bandwidth: 28")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    code, _, err = run(capsys, "plan", "--model", "llama2-7b", "--cluster", str(bad))
    assert code == 2
    assert "cluster.inter_node_bandwidth: unknown key" in one_error_line(err)


@pytest.mark.parametrize("value", ["0", "-32"])
def test_zero_or_negative_capacity(tmp_path, capsys, value):
    text = open(PAPER).read().replace("memory_gib: 32", f"memory_gib: {value}", 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    code, _, err = run(capsys, "plan", "--model", "llama2-7b", "--cluster", str(bad))
    assert code == 2
    line = one_error_line(err)
    assert "vendor-b-32gb.memory_gib: must be a positive number" in line and "real capacity" in line


def test_unknown_model_suggests_names(capsys):
    code, _, err = run(capsys, "plan", "--model", "llama-7b", "--cluster", PAPER)
    assert code == 2
    assert "did you mean" in one_error_line(err) and "llama2-7b" in err


def test_world_size_no_layout_fits(tmp_path, capsys):
    cluster = tmp_path / "odd.yaml"
    cluster.write_text("version: 1\ndevice_types:\n  a: {memory_gib: 8, peak_tflops: 10}\n"
                       "  b: {memory_gib: 8, peak_tflops: 20}\n"
                       "nodes:\n  - {devices: {a: 9}, intra_node_gbps: 10}\n"
                       "  - {devices: {b: 7}, intra_node_gbps: 10}\ninter_node_gbps: 5\n")
    code, _, err = run(capsys, "plan", "--model", "llama-tiny", "--cluster", str(cluster))
    assert code == 2
    assert "no TP x PP x DP layout fits 16 devices" in one_error_line(err)
    code, _, err = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", PAPER, "--tp", "2", "--pp", "2",
                       "--dp", "2", "--micro-batch-size", "1")
    assert code == 2
    assert "tp*pp*dp = 8 but the cluster has 20 devices" in one_error_line(err)


def test_batch_that_does_not_divide(capsys):
    code, _, err = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "1", "--pp", "2",
                       "--dp", "8", "--micro-batch-size", "2", "--global-batch-size", "20")
    assert code == 2
    line = one_error_line(err)
    assert "--global-batch-size: 20 is not divisible by dp*micro_batch_size=16" in line


def test_nothing_fits_lists_closest_candidates(capsys):
    code, _, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", os.path.join(CLUSTERS, "v100-t4.yaml"),
                       "--quiet")
    assert code == 3
    one_error_line(err)
    assert "closest candidates (GiB short per device):" in err
    shorts = [line for line in err.splitlines() if line.startswith("  ") and "short" in line and "GiB" in line]
    assert shorts


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    out_json.write_text("keep me")
    code, _, err = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--json", str(out_json))
    assert code == 2
    assert "already exists; pass --force" in one_error_line(err)
    assert out_json.read_text() == "keep me"
    code, _, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--json", str(out_json),
                     "--force", "--quiet")
    assert code == 0 and json.loads(out_json.read_text())["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary files left


@pytest.mark.parametrize("argv, match", [
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--weights", "1,2"], "--weights: expected three"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--top", "0"], "--top: must be between 1 and 10000"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--max-slowdown", "5"], "--max-slowdown: expected a share"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--topp", "3"], "--topp 3; did you mean --top? (see"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--plot", "p.svg"], "--plot: p.svg is not a .png"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--dp", "2"],  # estimate's flag, named so, not a typo
     "unrecognized arguments: --dp 2; --dp is a flag of memx estimate (see"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--tp", "3"], "--tp: 3 does not divide"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--schedules", "gpipe"], "--schedules: expected some of"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--pp", "3"], "--pp: no layout of 20 devices has pp"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--micro-batch-sizes", "0"], "--micro-batch-sizes: expected"),
    (["estimate", "--model", "llama2-7b", "--cluster", PAPER, "--tp", "1", "--pp", "5", "--dp", "4",
      "--micro-batch-size", "1", "--memory-headroom", "1.5"], "--memory-headroom: must be in [0, 1)"),
    (["estimate", "--cases", "c.csv", "--tp", "2"], "--tp: cannot be combined with --cases"),
    (["estimate", "--cases", "missing.csv"], "--cases: cannot read 'missing.csv'"),
    (["estimate", "--cases", "c.txt"], "--cases: c.txt is neither .csv nor .jsonl"),
    (["estimate", "--model", "llama2-7b", "--cluster", PAPER, "--tp", "1"], "--pp: missing"),
    (["estimate", "--plan", "nope.json", "--cluster", PAPER], "--plan: cannot read 'nope.json'"),
    (["estimate", "--model", "llama2-7b", "--cluster", PAPER, "--tp", "4", "--pp", "5", "--dp", "1",
      "--micro-batch-size", "1", "--global-batch-size", "20", "--recompute", "full,none"], "--recompute: 2 levels for pp=5"),
    (["plan", "--model", "llama2-7b", "--cluster", PAPER, "--profile-db", "missing.db"], "--profile-db: missing.db"),
])
def test_bad_flags_give_one_line(capsys, argv, match):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors go through the same one-line format
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert match in one_error_line(err)


def test_estimate_rejects_layout_flags_with_a_plan(tmp_path, capsys):
    plan_json = tmp_path / "plan.json"
    run(capsys, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--json", str(plan_json), "--quiet")
    code, _, err = run(capsys, "estimate", "--plan", str(plan_json), "--cluster", PAPER, "--tp", "2")
    assert code == 2
    assert "--tp: cannot be combined with --plan" in one_error_line(err)


def test_console_script_path_has_no_traceback_and_no_torch(tmp_path):
    """The real entry point: exit codes through sys.exit, and plan/estimate never import torch."""
    code = ("import sys; from memx_launch.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    ok = subprocess.run([sys.executable, "-c", code, "plan", "--model", "llama2-7b", "--cluster", PAPER, "--quiet",
                         "--plot", str(tmp_path / "p.png")], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "memx_launch.cli", "plan", "--model", "gpt5", "--cluster", PAPER],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("memx: error: --model: unknown model 'gpt5'")


def test_estimate_keeps_the_split_or_splits_evenly_and_says_so(tmp_path, capsys):
    base = ["estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "1", "--pp", "4", "--dp", "4",
            "--micro-batch-size", "1", "--global-batch-size", "64", "--recompute", "full", "--distributed-optimizer"]
    code, out, _ = run(capsys, *base, "--json", str(tmp_path / "even.json"))
    assert "even split, remainder on the first stages" in out
    assert [s.num_layers for s in Plan.load(str(tmp_path / "even.json")).stages] == [8, 8, 8, 8]
    # A split that a balancer would change (all but 3 layers on the first stage) is kept as given.
    code, out, _ = run(capsys, *base, "--layers-per-stage", "29,1,1,1", "--json", str(tmp_path / "given.json"))
    assert [s.num_layers for s in Plan.load(str(tmp_path / "given.json")).stages] == [29, 1, 1, 1]
    assert "even split" not in out and code == 3 and "OOM: stage 0 short" in out


def test_estimate_headroom_turns_a_fit_into_exit_3(capsys):
    base = ["estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "2", "--pp", "2", "--dp", "4",
            "--micro-batch-size", "1", "--global-batch-size", "64", "--recompute", "full",
            "--distributed-optimizer", "--stage-devices", "vendor-y-64gb,vendor-x-32gb"]
    code, out, _ = run(capsys, *base)
    assert code == 0 and "fits: every stage is under its capacity" in out
    peak = max(float(line.split()[5]) for line in out.splitlines() if line.strip()[:2] in ("0 ", "1 "))
    code, out, _ = run(capsys, *base, "--memory-headroom", "0.9")
    assert code == 3 and "less 90% headroom" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("0 ", "1 ")]
    assert max(float(r[5]) for r in rows) == peak  # the headroom changes the verdict, not the prediction


def test_estimate_fewer_micro_batches_than_stages(capsys):
    code, out, err = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "2", "--pp", "2",
                         "--dp", "4", "--micro-batch-size", "1", "--global-batch-size", "4", "--recompute", "full",
                         "--distributed-optimizer")
    assert code in (0, 3), err
    assert "fewer micro-batches than stages (1 < 2)" in out


def test_estimate_with_a_profile_db_uses_its_cost_model(tmp_path, capsys, monkeypatch):
    """--profile-db reaches the estimate; the learned model itself is tested in test_predictor."""
    from memx_launch.planning.costmodel import AnalyticalCostModel, LayerCost
    from memx_launch.profiling import predictor

    class TwiceAsSlow(AnalyticalCostModel):
        def layer_costs(self, *args):
            cost = super().layer_costs(*args)
            return LayerCost(cost.time_s * 2, cost.activation_bytes, cost.working_bytes)

    loaded = []
    monkeypatch.setattr(predictor, "load_cost_model", lambda path, *spec: loaded.append(path) or TwiceAsSlow(*spec))
    db = tmp_path / "profile.jsonl"
    db.write_text("")
    base = ["estimate", "--model", "llama2-7b", "--cluster", TABLE1, "--tp", "1", "--pp", "2", "--dp", "8",
            "--micro-batch-size", "1", "--global-batch-size", "64", "--recompute", "full", "--distributed-optimizer"]
    run(capsys, *base, "--json", str(tmp_path / "a.json"))
    run(capsys, *base, "--profile-db", str(db), "--json", str(tmp_path / "l.json"))
    assert loaded == [str(db)]
    analytical, learned = Plan.load(str(tmp_path / "a.json")), Plan.load(str(tmp_path / "l.json"))
    ratio = learned.stages[0].predicted_stage_time_s / analytical.stages[0].predicted_stage_time_s
    assert 1.9 < ratio <= 2.0  # the layers' time doubles; the embedding stays analytical
    # Which stages the host sets is the analytical model's word: a profile DB's ratios carry the host.
    slow_host = [*base, "--host-ms-per-layer", "900"]
    assert "host bound: stage 0" in run(capsys, *slow_host)[1]
    assert "host bound" not in run(capsys, *slow_host, "--profile-db", str(db))[1]


def test_every_setup_and_run_flag_is_documented_in_the_readme_and_docs_setups():
    from memx_launch.cli.common import RUN_FLAGS, SETUP_FLAGS

    root = os.path.join(os.path.dirname(__file__), "..")
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    setups = open(os.path.join(root, "docs", "setups.md"), encoding="utf-8").read()
    for name in SETUP_FLAGS + RUN_FLAGS:
        flag = "--" + name.replace("_", "-")
        named = re.compile(re.escape(flag) + r"(?![\w-])")  # --flash-attention is not --flash-attention-version
        assert named.search(readme) and named.search(setups), flag


def test_plan_for_memx_run_searches_what_memx_run_runs(tmp_path, capsys):
    """GPT-2's blocks have no TP plan of memx's and a mixture's experts stay whole under memx-run:
    memx plan --setup memx-run keeps to TP 1 and EP 1, as memx-run's own search does, so that
    memx-run --plan takes its plan."""
    from memx_launch.planning.runtime_support import check_runnable

    cluster = os.path.join(CLUSTERS, "cpu-emulated.yaml")
    models = os.path.join(ROOT, "examples", "models")
    for name in ("hf-gpt2-tiny", "hf-mixtral-tiny"):
        out_json = tmp_path / f"{name}.json"
        code, _, _ = run(capsys, "plan", "--model", os.path.join(models, name), "--cluster", cluster,
                         "--setup", "memx-run", "--quiet", "--json", str(out_json))
        assert code == 0
        plan = Plan.load(str(out_json))
        assert max(plan.stage_tps) == 1 and plan.training.get("expert_parallel", 1) == 1
        assert plan.num_microbatches >= plan.pp
        check_runnable(plan)
        # Another setup searches TP (and EP) for other frameworks.
        code, out, _ = run(capsys, "plan", "--model", os.path.join(models, name), "--cluster", cluster, "--quiet")
        assert code == 0 and "tp=2" in out
    code, _, err = run(capsys, "plan", "--model", os.path.join(models, "hf-gpt2-tiny"), "--cluster", cluster,
                       "--setup", "memx-run", "--tp", "2")
    assert code == 2 and "leaves out TP 1" in one_error_line(err)


def test_plan_for_memx_run_keeps_gemma_4_s_per_layer_inputs_on_one_stage(tmp_path, capsys):
    """Gemma 4's E models take per-layer inputs made from the token ids, which only memx-run's first
    stage has: memx plan --setup memx-run searches one stage over every device type (its DP
    replicas on both of the emulated cluster's), as memx-run's own search does; memx-run refuses a
    plan of more stages before it starts its workers."""
    from memx_launch.planning.runtime_support import check_runnable

    cluster = os.path.join(CLUSTERS, "cpu-emulated.yaml")
    gemma4 = os.path.join(ROOT, "examples", "models", "hf-gemma4-tiny")
    out_json = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "--model", gemma4, "--cluster", cluster, "--setup", "memx-run", "--quiet",
                     "--json", str(out_json))
    assert code == 0
    plan = check_runnable(Plan.load(str(out_json)))
    assert plan.pp == 1 and set(plan.stages[0].device_type.split("+")) == {"fast-small", "slow-big"}
    code, _, _ = run(capsys, "plan", "--model", gemma4, "--cluster", cluster, "--quiet", "--json",
                     str(tmp_path / "megatron.json"))
    split = Plan.load(str(tmp_path / "megatron.json"))
    assert code == 0 and split.pp > 1  # another framework's plan splits it
    with pytest.raises(ConfigError, match="per-layer inputs made from the token ids.*--pp 1"):
        check_runnable(split)
    code, _, err = run(capsys, "plan", "--model", gemma4, "--cluster", cluster, "--setup", "memx-run", "--pp", "2")
    assert code == 2 and "leaves out PP 1" in one_error_line(err)
