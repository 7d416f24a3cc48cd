"""Stopping and resuming through memx-run: SIGINT/SIGTERM -> every rank finishes its step, a
checkpoint of the completed steps, one line, exit 130/143; the same command continues with no
step lost or repeated (the losses of an uninterrupted run)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_replan_e2e import LOSS_ATOL, TRAIN, _plan_file, at_cpu_speed, losses, one_process_losses

STEPS = 8


def _argv(tmp_path, run_dir, plan, steps=STEPS):
    """memx-run's command line; run_dir None: memx-run's default (runs/<model>-<time>-<pid>)."""
    return [sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4", "--max-restarts", "0",
            "--cluster", at_cpu_speed(tmp_path), "--plan", str(plan), "--global-batch-size", "4",
            *(["--run-dir", str(run_dir)] if run_dir else []), "--profile-db", str(tmp_path / "no-profile.jsonl"),
            TRAIN, "--model", "llama-tiny", "--steps", str(steps), "--synthetic"]


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}


def _run_until(argv, tmp_path, name, step, signum):
    """Run ``argv`` until rank 0 printed ``step``, then send ``signum`` to memx-run."""
    out_path, err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + 150
        while not re.search(rf"^step {step} \|", out_path.read_text(), re.M):
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signum)
        rc = proc.wait(timeout=120)
    return rc, out_path.read_text(), err_path.read_text()


@pytest.mark.slow
def test_sigint_then_sigterm_checkpoint_the_completed_steps_and_the_same_command_continues(tmp_path):
    """Stopped by SIGINT (130), the very same command (memx-run's default run directory) continues
    the run and is stopped by SIGTERM (143), then --run-dir continues it to the end: every step
    once, with the losses of an uninterrupted run."""
    plan = _plan_file(tmp_path)
    argv = _argv(tmp_path, None, plan, steps=1000)
    rc, out, err = _run_until(argv, tmp_path, "first", 2, signal.SIGINT)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stop_lines = [line for line in err.splitlines() if "memx-run:" in line and "SIGINT" in line]
    assert len(stop_lines) == 1 and "--resume" in stop_lines[0], err[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()  # memx-run's default run directory
    first = losses(out)
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert latest == first[-1][0]  # the step in flight finished and was kept

    rc, out, err = _run_until(argv, tmp_path, "second", latest + 1, signal.SIGTERM)
    assert rc == 143 and "Traceback" not in err, err[-3000:]
    second = losses(out)
    assert second[0][0] == latest + 1 and f"resumed after step {latest}" in err
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert latest == second[-1][0]

    resumed = subprocess.run(_argv(tmp_path, run_dir, plan), cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = first + second + losses(resumed.stdout)
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))  # none lost, none repeated
    expected = one_process_losses()
    for step, loss in steps:
        assert loss == pytest.approx(expected[step], abs=LOSS_ATOL), step


@pytest.mark.slow
def test_after_kill_9_of_a_rank_resume_reruns_the_steps_after_the_last_checkpoint(tmp_path):
    import psutil

    plan = _plan_file(tmp_path)
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    env = {**_env(), "MEMX_CHECKPOINT_EVERY": "2"}
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(_argv(tmp_path, tmp_path / "run", plan, steps=1000), cwd=tmp_path, env=env,
                                stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + 150
        while "step 5 |" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("memx-rank")]
        assert len(workers) == 4
        killed = int(workers[-1].name().removeprefix("memx-rank"))
        workers[-1].kill()  # SIGKILL: nothing can be saved at that moment
        assert proc.wait(timeout=120) == 137  # as torchrun reports it, not its peers' failures
    assert err_path.read_text().strip().splitlines()[-1] == (
        f"memx-run: error: worker rank {killed} was killed by SIGKILL (exit code 137)"), err_path.read_text()[-3000:]
    printed = [s for s, _ in losses(out_path.read_text())]
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"]
    assert latest % 2 == 0 and printed[-1] - latest <= 2  # at most MEMX_CHECKPOINT_EVERY steps to redo

    resumed = subprocess.run(_argv(tmp_path, tmp_path / "run", plan), cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(resumed.stdout)
    assert [s for s, _ in after] == list(range(latest + 1, STEPS + 1))
    reference = one_process_losses()
    for step, loss in after:
        assert loss == pytest.approx(reference[step], abs=LOSS_ATOL), step


TWO_DEVICES = """version: 1
name: two-cpu
device_types:
  cpu-a: {vendor: cpu, memory_gib: 0.2, peak_tflops: 0.03, memory_bandwidth_gbps: 5}
nodes:
  - {name: localhost, devices: {cpu-a: 2}, intra_node_gbps: 2}
emulation:
  slowdown: {cpu-a: 1}
"""


@pytest.mark.slow
def test_workers_stop_with_a_checkpoint_when_memx_run_is_killed_and_sighup_stops_like_sigterm(tmp_path):
    """kill -9 of memx-run: its workers notice (their parent is gone) and stop at the next step
    boundary with a checkpoint and stopped.json, instead of training on unsupervised; the same
    command continues, and SIGHUP stops it as SIGTERM does (129), no step lost."""
    import psutil

    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.catalog import get_model
    from memx_launch.specs.training import TrainingSpec

    cluster = tmp_path / "two.yaml"
    cluster.write_text(TWO_DEVICES)
    plan = tmp_path / "plan.json"
    evaluate_layout(get_model("llama-tiny"), ClusterSpec.from_yaml(str(cluster)),
                    TrainingSpec(global_batch_size=2, seq_len=64, dtype="fp32"), tp=1, pp=2, dp=1, micro_batch_size=1,
                    layers_per_stage=[4, 4], recompute=["none"] * 2, references=(1, 1, 1)).save(str(plan))
    argv = [*_argv(tmp_path, tmp_path / "run", plan, steps=1000)]
    argv[argv.index("4")] = "2"  # --nproc-per-node
    argv[argv.index("--cluster") + 1] = str(cluster)
    argv[argv.index("--global-batch-size") + 1] = "2"
    out_path, err_path = tmp_path / "first.out", tmp_path / "first.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + 150
        while "step 2 |" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("memx-rank")]
        assert len(workers) == 2
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs(workers, timeout=60)
        for p in alive:
            p.kill()
        assert not alive, err_path.read_text()[-3000:]
    out, err = out_path.read_text(), err_path.read_text()
    printed = [s for s, _ in losses(out)]
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"]
    assert latest == printed[-1], err[-3000:]  # nothing trained after the checkpoint
    assert re.search(rf"memx-run \(pid {proc.pid}\) is gone: stopped after step {latest} with its checkpoint", err)
    assert json.loads((tmp_path / "run" / "stopped.json").read_text())["argv"] == argv[3:]

    rc, out, err = _run_until(argv, tmp_path, "second", latest + 1, signal.SIGHUP)
    assert rc == 129, err[-3000:]
    assert f"resumed after step {latest}" in err and losses(out)[0][0] == latest + 1
    assert "Traceback" not in err and "memx-run: stopped by SIGHUP: checkpoint" in err, err[-3000:]
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"] == losses(out)[-1][0]
