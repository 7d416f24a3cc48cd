"""memx-run restarts as torchrun does them: --max-restarts counts crash restarts only, the job
exits with the failing rank's code, torchrun's root-cause table is shown, the failing rank named."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DEVICE = """version: 1
name: one-cpu
device_types:
  cpu-a: {vendor: cpu, memory_gib: 0.2, peak_tflops: 0.03, memory_bandwidth_gbps: 5}
nodes:
  - {name: localhost, devices: {cpu-a: 1}, intra_node_gbps: 2}
emulation:
  slowdown: {cpu-a: 1}
"""
# Counts its runs (rank:generation) in a file next to it, then exits with the code it is given.
EXITING_SCRIPT = """import os, sys
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "attempts"), "a") as f:
    f.write(os.environ["RANK"] + ":" + os.environ["MEMX_GENERATION"] + "\\n")
sys.exit(int(sys.argv[sys.argv.index("--code") + 1]))
"""


def _memx_run(argv, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def job(tmp_path):
    (tmp_path / "cluster.yaml").write_text(ONE_DEVICE)
    (tmp_path / "exit.py").write_text(EXITING_SCRIPT)
    return tmp_path


def _plan(job):
    proc = _memx_run(["--nproc-per-node", "1", "--cluster", "cluster.yaml", "--dry-run", "--export-plan",
                      "plan.json", "exit.py", "--model", "llama-tiny"], job)
    assert proc.returncode == 0, proc.stderr
    return "plan.json"


def _attempts(job):
    path = job / "attempts"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("max_restarts, verbose, start", [(0, False, "forkserver"), (1, True, "spawn")])
def test_exit_code_and_attempts_are_the_crashing_rank_s(job, max_restarts, verbose, start):
    plan = _plan(job)
    proc = _memx_run(["--nproc-per-node", "1", "--cluster", "cluster.yaml", "--plan", plan, *["--verbose"] * verbose,
                      "--max-restarts", str(max_restarts), "--start-method", start, "--run-dir", "run", "exit.py",
                      "--model", "llama-tiny", "--code", "7"], job)
    assert proc.returncode == 7, proc.stderr
    assert _attempts(job) == [f"0:{generation}" for generation in range(max_restarts + 1)]
    # torchrun's summary and its log line only with --verbose
    assert ("Root Cause (first observed failure)" in proc.stderr) == verbose
    assert ("failed (exitcode: 7)" in proc.stderr) == verbose
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "memx-run: error: worker rank 0 failed with exit code 7"  # no traceback was printed


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_planning_restart_is_not_a_crash(job):
    """Without --plan the job calibrates and plans first, then restarts in place: with
    --max-restarts 0 the script still runs once, and the job ends with its code. Calibration
    time varies a lot between runs on a loaded 2-core machine (8 s to over 300 s seen), hence
    the long limit."""
    proc = _memx_run(["--nproc-per-node", "1", "--cluster", "cluster.yaml", "--max-restarts", "0",
                      "--profile-db", "profiles.jsonl", "--run-dir", "run", "exit.py", "--model", "llama-tiny",
                      "--code", "7"], job, timeout=900)
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert _attempts(job) == ["0:1"]  # the workers' second start, after the planned restart
    assert "planned restart" in proc.stderr


def _failure(code, timestamp, error_file="<N/A>"):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    f = ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file=str(error_file))
    f.timestamp = timestamp
    return f


def test_planned_restart_and_root_cause_ignore_the_workers_the_agent_stopped():
    from memx_launch.runtime.agent import _planned, root_cause

    failure = _failure

    # rank 2 ran out of memory and restarts for a re-plan, its peers follow, rank 0 was stopped first
    oom = {0: failure(-15, 10), 1: failure(75, 10), 2: failure(75, 10), 3: failure(75, 10)}
    assert _planned(oom)
    crash = {0: failure(-15, 10), 2: failure(7, 10), 3: failure(75, 10)}
    assert not _planned(crash) and root_cause(crash)[0] == 2
    assert not _planned({0: failure(-15, 10)})


def test_a_rank_killed_by_sigkill_is_the_root_cause_with_137():
    """Its peers fail in the same second (their collectives lose it); the agent SIGTERMs the rest,
    and SIGKILLs those still running 30 s later: the SIGKILLed rank is the one killed first."""
    from memx_launch.runtime.agent import exit_code, failure_line, root_cause

    killed = {0: _failure(1, 10), 1: _failure(-15, 10), 2: _failure(-9, 10), 3: _failure(1, 10)}
    assert root_cause(killed)[0] == 2 and exit_code(root_cause(killed)[1].exitcode) == 137
    assert failure_line(killed) == "memx-run: error: worker rank 2 was killed by SIGKILL (exit code 137)"
    # a rank SIGKILLed by the agent after its SIGTERM timeout is not the cause
    late = {0: _failure(7, 10), 1: _failure(-9, 41)}
    assert root_cause(late)[0] == 0 and failure_line(late) == "memx-run: error: worker rank 0 failed with exit code 7"


def test_an_error_every_rank_wrote_is_one_line_naming_the_ranks(tmp_path):
    import json

    from memx_launch.runtime.agent import EXCEPTION, MEMX_ERROR, error_record, failure_line

    def written(rank, message, kind, code):
        path = tmp_path / f"error{rank}.json"
        path.write_text(json.dumps(error_record(message, kind)))
        return _failure(code, 10, path)

    same = {r: written(r, "--model: llama-x is not in the catalog (fix: ...)", MEMX_ERROR, 2) for r in (0, 1, 3)}
    same[2] = _failure(-15, 10)  # stopped by the agent
    assert failure_line(same) == "memx-run: error: --model: llama-x is not in the catalog (fix: ...) (ranks 0, 1, 3)"
    crash = {0: _failure(-15, 10), 1: written(1, "RuntimeError: boom", EXCEPTION, 1)}
    assert failure_line(crash) == ("memx-run: error: worker rank 1 failed with exit code 1: RuntimeError: boom "
                                   "(traceback above)")


MEMX_ERROR_SCRIPT = """import memx_launch.runtime
from memx_launch.errors import ConfigError
memx_launch.runtime.from_env()
raise ConfigError("--steps", "must be positive, got 0", "e.g. --steps 10")
"""


@pytest.mark.slow
def test_a_memx_error_of_every_rank_is_one_line_for_the_job(tmp_path):
    from memx_launch.cli.main import main as memx

    (tmp_path / "cluster.yaml").write_text(ONE_DEVICE.replace("cpu-a: 1}", "cpu-a: 2}"))
    (tmp_path / "fail.py").write_text(MEMX_ERROR_SCRIPT)
    assert memx(["estimate", "--model", "llama-tiny", "--cluster", str(tmp_path / "cluster.yaml"), "--tp", "1", "--pp",
                 "2", "--dp", "1", "--micro-batch-size", "1", "--global-batch-size", "2", "--seq-len", "32",
                 "--dtype", "fp32", "--json", str(tmp_path / "plan.json")]) == 0
    proc = _memx_run(["--cluster", "cluster.yaml", "--plan", "plan.json", "--run-dir", "run", "fail.py", "--model",
                      "llama-tiny"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["memx-run: error: --steps: must be positive, got 0; e.g. --steps 10 (ranks 0, 1)"], proc.stderr
