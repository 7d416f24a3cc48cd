"""memx-run's elastic agent: torchrun's own, except that a planned restart (the failing workers
exited with PLANNED_RESTART_EXIT_CODE, the plan was made or re-made, and the others were stopped
by the agent) is not a crash, so
``--max-restarts`` counts crash restarts only, exactly as torchrun counts them. The agent numbers
every start of the workers (MEMX_GENERATION), planned or not, for the workers' per-generation
files and store keys.

When the job fails, torchrun's root-cause summary is shown, the rank named is the first that
failed (torchrun's root cause) and the job's exit code is that rank's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from memx_launch.runtime.restarts import GENERATION_VAR, PLANNED_RESTART_EXIT_CODE
from memx_launch.runtime.watchdog import STEP_TIMEOUT_EXIT_CODE


def _agent_class():
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class MemxAgent(LocalElasticAgent):
        generation = 0

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and _planned(result.failures):
                self._remaining_restarts += 1  # the agent takes one off for every restart it makes
            return result

        def _restart_workers(self, worker_group):
            self.generation += 1
            os.environ[GENERATION_VAR] = str(self.generation)  # the workers inherit the agent's environment
            super()._restart_workers(worker_group)

    return MemxAgent


# Once one worker fails the agent stops the others (SIGTERM, then SIGKILL): they are listed too.
STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)


def _planned(failures) -> bool:
    codes = {f.exitcode for f in failures.values()}
    return PLANNED_RESTART_EXIT_CODE in codes and codes <= {PLANNED_RESTART_EXIT_CODE, *STOPPED_BY_AGENT}


def root_cause(failures) -> tuple[int, object]:
    """The first failure (torchrun's root cause), not counting workers the agent stopped after it
    (timestamps are whole seconds: a stopped worker can tie with the one that failed)."""
    own = {r: f for r, f in failures.items() if f.exitcode not in STOPPED_BY_AGENT} or failures
    rank = min(own, key=lambda r: own[r].timestamp)
    return rank, own[rank]


def exit_code(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: a signal N as 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def failure_line(rank: int, exitcode: int) -> str:
    """memx-run's last line about the worker that failed first."""
    if exitcode == STEP_TIMEOUT_EXIT_CODE:
        return (f"memx-run: error: worker rank {rank} failed with exit code {exitcode}, its step watchdog's; "
                "its line above says what it waited in")
    how = f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"failed with exit code {exitcode}"
    return f"memx-run: error: worker rank {rank} {how}; see its traceback above"


def run_agent(args) -> int:
    """torch.distributed.run.run(args) with memx's agent; the job's exit code."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ[GENERATION_VAR] = "0"
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_hide_planned_restart)
    # launch_agent builds the agent by this module-level name; memx-run's process is the only user.
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _agent_class()
    try:
        run(args)
    except ChildFailedError as exc:
        print(str(exc), file=sys.stderr)  # torchrun's root-cause table
        rank, failure = root_cause(exc.failures)
        print(failure_line(rank, failure.exitcode), file=sys.stderr)
        return exit_code(failure.exitcode)
    finally:
        launcher_api.LocalElasticAgent = original
    return 0


def _hide_planned_restart(record: logging.LogRecord) -> bool:
    """The elastic agent logs every non-zero worker exit as a failure; a planned restart is not one."""
    return f"exitcode: {PLANNED_RESTART_EXIT_CODE})" not in record.getMessage()
