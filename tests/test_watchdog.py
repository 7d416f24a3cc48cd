"""The step watchdog: a step far past its prediction becomes one line naming the rank, stage and
what it waits in, and a non-zero exit, instead of a silent hang."""

import os
import time

import pytest
import torch

from memx_launch.errors import ConfigError
from memx_launch.runtime.watchdog import STEP_TIMEOUT_EXIT_CODE, StepWatchdog, step_timeout_s
from ranks import free_port


def test_the_limit_is_20x_the_prediction_with_a_floor_and_an_override():
    assert step_timeout_s(3.75, {}) == 75.0
    assert step_timeout_s(0.01, {}) == 60.0  # a tiny model on a loaded machine must not trip it
    assert step_timeout_s(3.75, {"MEMX_STEP_TIMEOUT_S": "600"}) == 600.0
    with pytest.raises(ConfigError, match="MEMX_STEP_TIMEOUT_S: 'never' is not a plain number"):
        step_timeout_s(3.75, {"MEMX_STEP_TIMEOUT_S": "never"})
    with pytest.raises(ConfigError, match="MEMX_STEP_TIMEOUT_S: must be a positive number of seconds"):
        step_timeout_s(3.75, {"MEMX_STEP_TIMEOUT_S": "0"})


def test_a_step_past_its_limit_is_one_line_naming_rank_stage_and_compute(capsys):
    exits = []
    watchdog = StepWatchdog(3, 1, "slow-big", 0.01, limit_s=0.2, exit=exits.append)
    with watchdog.armed(7):
        time.sleep(1.0)  # a step stuck in its own work
    assert exits == [STEP_TIMEOUT_EXIT_CODE]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["memx: error: rank 3 (stage 1, slow-big) step 7 has run 0 s against 0.01 s predicted, "
                     "waiting in compute; if it is only slow, raise MEMX_STEP_TIMEOUT_S (now 0)"]


def test_steps_within_their_limit_pass_and_each_step_rearms():
    exits = []
    watchdog = StepWatchdog(0, 0, "cpu", 0.01, limit_s=0.6, exit=exits.append)
    for step in range(1, 4):
        with watchdog.armed(step):
            time.sleep(0.3)  # 0.9 s in all: only a deadline kept from an earlier step would fire
    time.sleep(0.8)  # nor does a disarmed watchdog fire later
    assert exits == []


def _blocked_worker(rank, port, limit_s):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from memx_launch.profiling.emulation import EmulatedDevice

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(120)  # never joins in time; the test stops it
    device = EmulatedDevice("fast-small", 1.0, slowdown=2.0)
    with device:  # the mode's first use imports torch._dynamo: seconds on a loaded machine
        torch.ones(1) + 1
    watchdog = StepWatchdog(0, 0, "fast-small", 0.05, limit_s=limit_s)  # the real exit: os._exit
    with watchdog.armed(2), device:
        pending = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)  # a TP all-reduce
        (pending + 1).sum()  # waits in its dispatch for rank 1


def test_a_rank_blocked_in_a_collective_exits_naming_it(capfd):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_blocked_worker, args=(rank, port, 2.0)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=90)
        assert procs[0].exitcode == STEP_TIMEOUT_EXIT_CODE
    finally:
        procs[1].kill()
        procs[1].join()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("memx:")]
    assert lines == ["memx: error: rank 0 (stage 0, fast-small) step 2 has run 2 s against 0.05 s predicted, "
                     "waiting in torch.distributed._functional_collectives.wait_tensor; if it is only slow, "
                     "raise MEMX_STEP_TIMEOUT_S (now 2)"]


def test_memx_run_says_which_worker_its_watchdog_stopped():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from memx_launch.runtime.agent import failure_line

    stopped = ProcessFailure(local_rank=2, pid=1, exitcode=STEP_TIMEOUT_EXIT_CODE, error_file="<N/A>")
    peer = ProcessFailure(local_rank=0, pid=2, exitcode=-15, error_file="<N/A>")  # stopped by the agent after it
    stopped.timestamp, peer.timestamp = 10, 11
    assert failure_line({0: peer, 2: stopped}) == (
        "memx-run: error: worker rank 2 failed with exit code 124, its step watchdog's; its line above says "
        "what it waited in")
