"""memx-run's elastic agent: torchrun's own, except that a planned restart (the failing workers
exited with PLANNED_RESTART_EXIT_CODE, the plan was made or re-made, and the others were stopped
by the agent) is not a crash, so
``--max-restarts`` counts crash restarts only, exactly as torchrun counts them. The agent numbers
every start of the workers (MEMX_GENERATION), planned or not, for the workers' per-generation
files and store keys.

When the job fails, memx-run says it in one line: the error a worker wrote to its error file
(torchrun's TORCHELASTIC_ERROR_FILE, JSON; worker.py writes it), once for every rank that wrote
the same, or how the first rank to fail ended. The job's exit code is that rank's, as a shell
reports it (137 for a rank killed by SIGKILL). torchrun's root-cause table and its log lines about
the failure are shown with ``--verbose``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

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


# Once one worker fails the agent stops the others: SIGTERM, and SIGKILL for those still running
# 30 s later (their failures are taken that much later than the first one).
STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)

# What a worker writes to its error file (worker.py); torchrun reads "message" and "timestamp".
MEMX_ERROR = "memx_error"
"""A memx error: its one line is the message; the worker printed nothing."""
EXCEPTION = "exception"
"""Any other exception: the message is its last line; the worker printed its traceback."""


def error_record(message: str, kind: str) -> dict:
    return {"message": message, "timestamp": int(time.time()), "memx": kind}


def _planned(failures) -> bool:
    codes = {f.exitcode for f in failures.values()}
    return PLANNED_RESTART_EXIT_CODE in codes and codes <= {PLANNED_RESTART_EXIT_CODE, *STOPPED_BY_AGENT}


def root_cause(failures) -> tuple[int, object]:
    """The first failure (torchrun's root cause), not counting workers the agent stopped with
    SIGTERM after it. Timestamps are whole seconds: of failures in the same second, a rank killed
    by a signal comes first (its peers fail because it is gone), then the lowest rank."""
    own = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    rank = min(own, key=lambda r: (own[r].timestamp, own[r].exitcode >= 0, r))
    return rank, own[rank]


def exit_code(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: a signal N as 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def failure_line(failures) -> str:
    """memx-run's one line about a failed job: the first failure, with every rank that failed
    the same way."""
    rank, first = root_cause(failures)
    kind = first.error_file_data.get("memx")
    if kind == MEMX_ERROR:
        same = sorted(r for r, f in failures.items() if f.error_file_data.get("memx") == MEMX_ERROR
                      and f.message == first.message)
        return f"memx-run: error: {first.message} ({_ranks(same)})"
    code = exit_code(first.exitcode)
    if first.exitcode == STEP_TIMEOUT_EXIT_CODE:
        return (f"memx-run: error: worker rank {rank} failed with exit code {code}, its step watchdog's; "
                "its line above says what it waited in")
    if first.exitcode < 0:
        return f"memx-run: error: worker rank {rank} was killed by {first.signal_name()} (exit code {code})"
    if kind == EXCEPTION:
        return f"memx-run: error: worker rank {rank} failed with exit code {code}: {first.message} (traceback above)"
    return f"memx-run: error: worker rank {rank} failed with exit code {code}"


def run_agent(args, verbose: bool = False) -> int:
    """torch.distributed.run.run(args) with memx's agent; the job's exit code. ``verbose``: also
    torchrun's root-cause table and its log line about the failure."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ[GENERATION_VAR] = "0"
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _hide_planned_restart if verbose else _hide_failure_logs)
    # launch_agent builds the agent by this module-level name; memx-run's process is the only user.
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _agent_class()
    try:
        run(args)
    except ChildFailedError as exc:
        if verbose:
            print(str(exc), file=sys.stderr)  # torchrun's root-cause table
        print(failure_line(exc.failures), file=sys.stderr)
        return exit_code(root_cause(exc.failures)[1].exitcode)
    finally:
        launcher_api.LocalElasticAgent = original
    return 0


def _hide_planned_restart(record: logging.LogRecord) -> bool:
    """The elastic agent logs every non-zero worker exit as a failure; a planned restart is not one."""
    return f"exitcode: {PLANNED_RESTART_EXIT_CODE})" not in record.getMessage()


def _hide_failure_logs(record: logging.LogRecord) -> bool:
    """Without --verbose: none of the agent's lines about failed workers (memx-run says it once)."""
    return not record.getMessage().startswith("failed (exitcode:")
