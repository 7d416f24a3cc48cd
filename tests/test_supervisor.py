"""Re-plans of one run directory are serialised: two ranks out of memory at once write one plan. A
stop because memx-run is gone is said by rank 0 whichever rank saw it first."""

import json
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from memx_launch.runtime import supervisor as supervisor_module
from memx_launch.runtime.runs import COMMAND_VAR, LAUNCHER_PID_VAR, STOPPED_FILE
from memx_launch.runtime.supervisor import REPLANS_FILE, Supervisor, _replan_lock


def test_the_replan_lock_holds_off_a_second_writer(tmp_path):
    entered = []

    def second():
        with _replan_lock(str(tmp_path)):
            entered.append(time.monotonic())

    with _replan_lock(str(tmp_path)):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        assert not entered  # still waiting for the first
        released = time.monotonic()
    thread.join(timeout=5)
    assert entered and entered[0] >= released


def test_a_second_rank_out_of_memory_takes_the_first_ranks_replan(tmp_path):
    first = {"generation": 2, "step": 7, "reason": "oom", "rank": 1, "stage": 0, "action": "move_layers",
             "restart": True}
    (tmp_path / REPLANS_FILE).write_text(json.dumps([first]))
    supervisor = Supervisor.__new__(Supervisor)  # only what _decide reads before re-planning
    supervisor.run_dir, supervisor.generation, supervisor.rank, supervisor.max_replans = str(tmp_path), 2, 3, 3
    supervisor.environ = {}
    assert supervisor._decide(SimpleNamespace(step=7, reason="oom", rank=3, stage=1)) == first
    assert json.loads((tmp_path / REPLANS_FILE).read_text()) == [first]  # one record, not two


def test_rank_0_says_memx_run_is_gone_when_another_rank_saw_it_first(tmp_path, monkeypatch, caplog):
    """The stop is agreed from every rank's watcher: when another rank saw memx-run gone first,
    rank 0 (whose own watcher has not looked again yet) still says so and records the stop."""
    monkeypatch.setattr(supervisor_module, "dist", SimpleNamespace(barrier=lambda: None, get_rank=lambda: 0,
                                                        destroy_process_group=lambda: None))

    def stop(launcher):
        supervisor = Supervisor.__new__(Supervisor)  # only what stop_at_signal reads
        supervisor.runtime, supervisor.run_dir = SimpleNamespace(step_count=3), str(tmp_path)
        supervisor._checkpoint_saved = lambda step: True
        supervisor.environ = {COMMAND_VAR: json.dumps(["memx-run", "train.py"]), LAUNCHER_PID_VAR: str(launcher.pid)}
        supervisor.stop_signal, supervisor.launcher_gone = signal.SIGHUP, False
        supervisor._launcher = psutil.Process(launcher.pid)
        return supervisor

    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as running:
        alive = stop(running)
        with pytest.raises(SystemExit) as exited:
            alive.stop_at_signal()
        assert exited.value.code == 129 and "is gone" not in caplog.text
        assert not (tmp_path / STOPPED_FILE).exists()  # memx-run, alive, records the stop itself
        gone = stop(running)
        running.kill()
    with pytest.raises(SystemExit):
        gone.stop_at_signal()
    assert f"memx-run (pid {running.pid}) is gone: stopped after step 3" in caplog.text
    assert json.loads((tmp_path / STOPPED_FILE).read_text())["signal"] == "memx-run gone"
