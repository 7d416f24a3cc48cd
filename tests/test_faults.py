"""Fault injection: parsing, ballast against an emulated capacity, a calibration kill that happens once."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from memx_launch.errors import ConfigError
from memx_launch.runtime.faults import BallastFault, Faults, KillCalibrationFault
from memx_launch.profiling.emulation import GIB, EmulatedDevice


def test_faults_from_env():
    faults = Faults.from_env({"MEMX_FAULT_BALLAST": "rank=1,step=5,gib=0.5",
                              "MEMX_FAULT_KILL_CALIBRATION": "rank=2", "MEMX_FAULT_MARKER_DIR": "/x"})
    assert (faults.ballast.rank, faults.ballast.step, faults.ballast.gib) == (1, 5, 0.5)
    assert (faults.kill_calibration.rank, faults.kill_calibration.after) == (2, 1)
    assert faults.kill_calibration.marker == "/x/kill-calibration-rank2"
    assert Faults.from_env({}) == Faults()


@pytest.mark.parametrize("text, field", [("rank=1,step=5", "missing gib"), ("rank=1,step=x,gib=1", "step"),
                                         ("rank1,step=5,gib=1", "cannot read"), ("rank=1,step=5,gib=0", "gib")])
def test_bad_ballast_names_the_field(text, field):
    with pytest.raises(ConfigError, match=field):
        BallastFault.from_text(text)


def test_ballast_counts_against_the_emulated_capacity_from_its_step_on():
    device = EmulatedDevice("small", memory_gib=0.01)
    fault = BallastFault(rank=1, step=5, gib=0.004)
    assert not fault.before_step(5, rank=0, emulated=device)      # other rank
    assert not fault.before_step(4, rank=1, emulated=device)      # too early
    assert fault.before_step(5, rank=1, emulated=device)
    assert device.live_bytes == int(0.004 * GIB)
    assert not fault.before_step(6, rank=1, emulated=device)      # held, not allocated twice
    assert device.live_bytes == int(0.004 * GIB)
    restarted = BallastFault(rank=1, step=5, gib=0.004)           # a resumed run past step 5 holds it again
    assert restarted.before_step(7, rank=1, emulated=EmulatedDevice("small", memory_gib=0.01))
    with pytest.raises(torch.OutOfMemoryError):
        BallastFault(rank=0, step=0, gib=0.02).before_step(0, rank=0, emulated=EmulatedDevice("small", memory_gib=0.01))


def test_calibration_kill_happens_once(tmp_path):
    code = ("from memx_launch.runtime.faults import Faults\n"
            "f = Faults.from_env().kill_calibration\n"
            "for done in range(1, 4):\n"
            "    f.after_sample(2, done)\n"
            "print('survived')\n")
    env = {**os.environ, "MEMX_FAULT_KILL_CALIBRATION": "rank=2,after=2", "MEMX_FAULT_MARKER_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL and "survived" not in first.stdout
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert second.returncode == 0 and "survived" in second.stdout
    other_rank = KillCalibrationFault(rank=3, marker_dir=str(tmp_path))
    other_rank.after_sample(2, 5)  # not its rank: nothing happens
