"""The run summary over generations (runtime/run_record.py): what the checkpoints carry, read
back checked, and the done: line it gives."""

import pytest

from memx_launch.errors import ConfigError
from memx_launch.runtime.run_record import RunRecord


def test_a_record_carried_through_a_checkpoint_continues_the_run():
    first = RunRecord()
    for loss, seconds in ((6.25, 1.5), (6.20, 1.0), (6.18, 1.0)):
        first.add(loss, seconds)
    resumed = RunRecord.from_dict(first.to_dict(), "memx.json")  # what the next generation reads
    resumed.resumed_at.append(4)
    for loss in (6.1, 6.05, 6.0):
        resumed.add(loss, 0.5)
    assert resumed.summary(6) == "6 steps in 5.0 s, loss 6.2500 -> 6.0000 (resumed at step 4)"
    assert RunRecord().summary(3) == "3 steps, none run here"
    assert RunRecord.from_dict(None, "memx.json") == RunRecord()  # a checkpoint written before records


@pytest.mark.parametrize("bad", [
    [], {"first_loss": 1.0}, {"first_loss": "1", "last_loss": 1.0, "steps_s": 1.0, "resumed_at": []},
    {"first_loss": 1.0, "last_loss": 1.0, "steps_s": -1.0, "resumed_at": []},
    {"first_loss": 1.0, "last_loss": float("nan"), "steps_s": 1.0, "resumed_at": []},
    {"first_loss": 1.0, "last_loss": 1.0, "steps_s": 1.0, "resumed_at": [True]},
    {"first_loss": 1.0, "last_loss": 1.0, "steps_s": 1.0, "resumed_at": [], "extra": 1}])
def test_a_tampered_record_is_one_line_naming_the_file(bad):
    with pytest.raises(ConfigError, match="ckpt/memx.json: data_state's memx.run is not a run record memx wrote"):
        RunRecord.from_dict(bad, "ckpt/memx.json")
