"""Output files: checked before the work, umask permissions, nothing left behind on failure or
on SIGTERM, and only regular files are ever replaced."""

import os
import signal
import subprocess
import sys
import time

import pytest

from memx_launch.errors import ConfigError
from memx_launch.files import atomic_output, check_output_path, write_json_atomic

CPU_CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "cpu-emulated.yaml")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomic(str(tmp_path / "out.json"), {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == mode


def test_force_keeps_the_replaced_files_mode(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    path.chmod(0o640)
    write_json_atomic(str(path), {"a": 1}, overwrite=True)
    assert path.stat().st_mode & 0o777 == 0o640 and path.read_text().startswith("{")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("keep")
    with pytest.raises(RuntimeError):
        with atomic_output(str(path), overwrite=True) as tmp:
            with open(tmp, "w") as f:
                f.write("half")
            raise RuntimeError("disk full")
    assert path.read_text() == "keep" and os.listdir(tmp_path) == ["out.json"]


@pytest.mark.parametrize("target, force, problem", [
    ("{d}", True, "is a directory"),
    ("/dev/null", True, "under /dev"),
    ("/proc/self/x.json", True, "under /proc"),
    ("/sys/x.json", True, "under /sys"),
    ("{d}/file.txt/x.json", True, "not a directory"),
    ("{d}/file.txt", False, "already exists"),
    ("{d}/link", True, "under /dev"),
    ("{d}/fifo", True, "not a regular file"),
])
def test_output_paths_memx_must_not_write_are_refused(tmp_path, target, force, problem):
    (tmp_path / "file.txt").write_text("keep")
    os.symlink("/dev/null", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match=problem):
        check_output_path(target.replace("{d}", str(tmp_path)), "--json", force)
    assert (tmp_path / "file.txt").read_text() == "keep"


def test_sigterm_stops_memx_with_one_line_and_143(tmp_path):
    db = tmp_path / "profile.jsonl"
    db.write_text("")
    proc = subprocess.Popen([sys.executable, "-m", "memx_launch.cli", "profile", "--model", "llama-small", "--device",
                             "cpu", "--quiet", "--out", str(db)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline().startswith("profiling ")  # measuring now
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["memx: terminated; no output file was written"]
    assert os.listdir(tmp_path) == ["profile.jsonl"] and db.read_text() == ""


def test_sigterm_that_lands_in_a_weakref_callback_still_stops_memx():
    """Python prints and drops what a weakref callback raises (the emulated device releases every freed
    tensor in one), so the SIGTERM handler's exit, raised there, would be lost and the command run on: an
    alarm raises it again, silently, until it unwinds."""
    script = """
import os, signal, time, weakref
from memx_launch.cli.main import _terminate
signal.signal(signal.SIGTERM, _terminate)
class Tracked: pass
def released(_ref):
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(1000))  # the handler runs here, inside the callback, and its exit is dropped
tracked = Tracked()
ref = weakref.ref(tracked, released)
try:
    del tracked
    time.sleep(5)
    print("ran on")
except SystemExit as exc:
    print("exit", exc.code)
"""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["exit", "143"] and done.stderr == ""
    assert time.monotonic() - start < 4


def test_temporaries_left_by_a_killed_write_are_removed_by_the_next_one(tmp_path):
    stale, fresh = tmp_path / ".memx-abcd1234.tmp", tmp_path / ".memx-efgh5678.tmp"
    for path in (stale, fresh):
        path.write_text("half")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))  # two hours old: its writer is gone
    write_json_atomic(str(tmp_path / "out.json"), {"a": 1})
    assert not stale.exists() and fresh.exists()  # a fresh one may be another writer's


def test_a_write_that_fails_after_the_work_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    (tmp_path / "plan.json").write_text("the previous plan")

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(ConfigError, match=r"^--json: cannot write .*plan.json \(No space left on device\); no output "
                                          r"file was written") as exc:
        write_json_atomic(str(tmp_path / "plan.json"), {"tp": 1}, overwrite=True, flag="--json")
    assert "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["plan.json"] and (tmp_path / "plan.json").read_text() == "the previous plan"


def test_memx_plan_under_a_file_size_limit_is_one_line_and_writes_nothing(tmp_path):
    import resource

    def small_files():  # ulimit -f: a write past 1 KiB fails with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    proc = subprocess.run([sys.executable, "-m", "memx_launch.cli", "plan", "--model", "llama-tiny", "--cluster",
                           CPU_CLUSTER, "--quiet", "--json", str(tmp_path / "plan.json")], cwd=tmp_path,
                          capture_output=True, text=True, preexec_fn=small_files, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("memx: error: --json: cannot write") and "no output file was written" in lines[-1]
    assert os.listdir(tmp_path) == []
