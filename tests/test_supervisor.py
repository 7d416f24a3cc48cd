"""Re-plans of one run directory are serialised: two ranks out of memory at once write one plan."""

import json
import threading
import time
from types import SimpleNamespace

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
