"""examples/train_hf.py and examples/train_own_model.py under the real memx-run (4 emulated
ranks, a fixed plan with an uneven split and mixed recompute) against the same script's
one-process reference."""

import json
import os
import re
import subprocess
import sys

import pytest

from memx_launch.planning.estimate import evaluate_layout
from memx_launch.profiling.metrics import load_measurements
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec
from test_replan_e2e import at_cpu_speed

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")
LOSS_ATOL = 1e-5
STEPS, BATCH = 3, 4
# script, model, (pp, dp), layers, recompute. The own block's script runs under memx-run in the
# calibrating test below; tests/test_adapters.py runs its blocks under a fixed PP x DP split.
CASES = {
    "hf-llama": ("train_hf.py", "hf-llama-tiny", (2, 2), [5, 3], ["full", "selective"]),
}


def _losses(stdout):
    return [float(m[1]) for m in re.finditer(r"^step \d+ \| loss ([0-9.]+)", stdout, re.M)]

def _assert_losses_match_the_reference(stdout: str, script: str, model: str, monkeypatch, capsys) -> None:
    """The memx-run losses against the same script run alone (--reference), in this process: its
    imports are this process's already (a new interpreter spent 4-8 s on them). The global random
    state it seeds is restored after it."""
    import runpy

    import torch

    monkeypatch.setattr(sys, "argv", [script, "--reference", "--model", model, "--steps", str(STEPS),
                                      "--global-batch-size", str(BATCH)])
    monkeypatch.syspath_prepend(EXAMPLES)  # the examples import each other
    capsys.readouterr()
    with torch.random.fork_rng(devices=[]), pytest.raises(SystemExit) as exited:
        runpy.run_path(script, run_name="__main__")
    assert exited.value.code in (0, None)
    got, want = _losses(stdout), _losses(capsys.readouterr().out)
    assert len(got) == len(want) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want)) < LOSS_ATOL, (got, want)



@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_user_model_under_memx_run_matches_the_one_process_reference(tmp_path, case, monkeypatch, capsys):
    script, model, (pp, dp), layers, recompute = CASES[case]
    script, model = os.path.join(EXAMPLES, script), os.path.join(EXAMPLES, "models", model)
    spec = get_model(model)
    plan = evaluate_layout(spec, ClusterSpec.from_yaml(CLUSTER),
                           TrainingSpec(global_batch_size=BATCH, seq_len=spec.seq_len, dtype="fp32"), tp=1, pp=pp,
                           dp=dp, micro_batch_size=1, layers_per_stage=layers, recompute=recompute,
                           references=(1, 1, 1))
    plan.save(str(tmp_path / "plan.json"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    run = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4",
                          "--cluster", at_cpu_speed(tmp_path), "--plan", str(tmp_path / "plan.json"), "--run-dir",
                          str(tmp_path / "run"), "--profile-db", str(tmp_path / "none.jsonl"), script,
                          "--model", model, "--steps", str(STEPS)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"pp={pp} dp={dp} mbs=1 fp32; layers {layers}, recompute {recompute}" in run.stdout
    _assert_losses_match_the_reference(run.stdout, script, model, monkeypatch, capsys)
    # memx-run's metrics file, written without the script asking: the printed steps, every stage measured
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert [round(m["loss"], 6) for m in lines] == _losses(run.stdout)
    assert all(len(m["stages"]) == pp and m["tokens_per_s"] > 0 for m in lines)
    assert all(0 < s["peak_memory_gib"] and 0 < s["predicted_peak_memory_gib"] for m in lines for s in m["stages"])
    # ... which memx evaluate reads back: the one plan generation, its fullest stage against the plan's
    columns = load_measurements(str(tmp_path / "run"))
    assert len(columns["config"]) == 1 and columns["predicted_time_s"][0] == lines[0]["predicted_step_time_s"]
    assert columns["measured_memory_bytes"][0] == pytest.approx(
        max(s["peak_memory_gib"] for m in lines for s in m["stages"]) * 2**30)
    # ... and memx-run's last line says the same
    ratio = columns["measured_time_s"][0] / columns["predicted_time_s"][0]
    assert re.search(rf"memx-run: measured against the plan: gen \d+: step \S+ s against \S+ s predicted "
                     rf"\({ratio:.2f}x\), fullest stage's peak \d\.\d\dx, stages' compute \d\.\d\d-\d\.\d\dx "
                     rf"\(memx evaluate", run.stderr), run.stderr[-2000:]
    assert "find_unused_parameters" not in run.stderr  # DDP (dp=2) says nothing per rank


@pytest.mark.slow
def test_memx_run_calibrates_the_scripts_own_block_and_plans_for_it(tmp_path, monkeypatch, capsys):
    script = os.path.join(EXAMPLES, "train_own_model.py")
    model = os.path.join(EXAMPLES, "models", "own-gpt-tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    run = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4",
                          "--cluster", at_cpu_speed(tmp_path), "--global-batch-size", str(BATCH), "--run-dir",
                          str(tmp_path / "run"),
                          "--model-builder", f"{script}:build", script, "--model", model, "--steps", str(STEPS)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-4000:]
    db = tmp_path / "runs" / "profiles.train_own_model.build.jsonl"
    records = [json.loads(line) for line in db.read_text().splitlines()]
    assert records and all(r["tp"] == 1 for r in records)
    assert "tp=1 " in run.stdout
    # Its one q, k, v linear is calibrated and planned as one (models/block_reading.py), not as the three
    # memx-run's setup assumes; its selective level recomputes the whole block (memx cannot reach its
    # attention core): priced so.
    assert all(r["run_options"] == {"setup": "memx-run", "fused_qkv": True, "selective_recompute": "block"}
               for r in records)
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["training"]["fused_qkv"] is True
    _assert_losses_match_the_reference(run.stdout, script, model, monkeypatch, capsys)


def _planned_in_the_job(tmp_path, folder: str):
    """examples/train_hf.py on ``examples/models/<folder>`` under memx-run, calibrated and planned in
    the job on the emulated cluster at the CPU's speed: (script, model, the finished run)."""
    script, model = os.path.join(EXAMPLES, "train_hf.py"), os.path.join(EXAMPLES, "models", folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    run = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4",
                          "--cluster", at_cpu_speed(tmp_path), "--global-batch-size", str(BATCH), "--run-dir",
                          str(tmp_path / "run"), "--profile-db", str(tmp_path / "profiles.jsonl"), script,
                          "--model", model, "--steps", str(STEPS)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-4000:]
    return script, model, run


@pytest.mark.slow
def test_memx_run_trains_gemma_4_s_per_layer_inputs_on_one_stage_over_both_device_types(tmp_path, monkeypatch,
                                                                                       capsys):
    """A Gemma 4 E model (per-layer inputs made from the token ids, its last layers reusing earlier
    layers' keys and values) under memx-run's own calibration and search: its block measured with
    a per-layer input of zeros from a config cut to its first layer, the search kept to one stage,
    whose DP replicas sit on both device types, and the losses the one-process reference's."""
    script, model, run = _planned_in_the_job(tmp_path, "hf-gemma4-tiny")
    assert re.search(r"search pipeline degrees +1 +\(blocks with per-layer inputs made from the token ids\)",
                     run.stdout)
    records = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert records and {r["device_type"] for r in records} == {"fast-small", "slow-big"}
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert len(plan["stages"]) == 1 and set(plan["stages"][0]["device_type"].split("+")) == {"fast-small", "slow-big"}
    _assert_losses_match_the_reference(run.stdout, script, model, monkeypatch, capsys)


@pytest.mark.slow
def test_memx_run_trains_a_mixture_with_dense_first_blocks_and_multi_token_prediction_in_its_config(
        tmp_path, monkeypatch, capsys):
    """GLM-4.5's layout (a dense first block, then expert blocks with a shared expert; one
    multi-token prediction module in its config, which Transformers does not build) under memx-run's
    own calibration and search (its first expert block measured: tests/test_adapters.py): the MTP
    module said and left out of the plan, and the losses the one-process reference's."""
    script, model, run = _planned_in_the_job(tmp_path, "hf-glm4-moe-tiny")
    assert re.search(r"multi-token prediction +its 1 module\(s\) not in the model trained", run.stdout)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["model_spec"]["mtp_layers"] == 0 and plan["model_spec"]["dense_layers"] == 1
    _assert_losses_match_the_reference(run.stdout, script, model, monkeypatch, capsys)
