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

The workers run memx's worker function, started by multiprocessing (torchrun's --start-method;
memx-run's default is a fork server): the fork server imports torch and its pipelining once and
forks every worker of every start from that state, where a new interpreter per worker imported
them again (seconds of CPU each, paid again at each planned restart). A worker is still its own
process with its own process groups.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import sys
import time

from memx_launch.runtime.restarts import PLANNED_RESTART_EXIT_CODE
from memx_launch.runtime.watchdog import STEP_TIMEOUT_EXIT_CODE


def _agent_class():
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class MemxAgent(LocalElasticAgent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.generation = 0
            self.alive_at: dict[int, int] = {}  # when each worker (by pid) was last seen running
            self.ended_at: dict[int, int] = {}  # when each worker ended, at the earliest

        def _monitor_workers(self, worker_group):
            # A worker found ended is timed when it was last seen running (one monitor interval,
            # 0.1 s, earlier), not when found: a peer failing because of it then never has an
            # earlier whole second than it.
            now = int(time.time())
            for process in self._pcontext._pc.processes:
                if process.exitcode is None:
                    self.alive_at[process.pid] = now
                else:
                    self.ended_at.setdefault(process.pid, self.alive_at.get(process.pid, now))
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                result.failures = self._failures(worker_group)
                if _planned(result.failures):
                    self._remaining_restarts += 1  # the agent takes one off for every restart it makes
            return result

        def _failures(self, worker_group) -> dict:
            """Every worker that did not end with 0, by global rank, each at the time it ended.
            Multiprocessing reports the first failure it saw, after it stopped the others: a
            planned restart is one when every rank ended so, the one line names each rank that
            failed the same way, and the root cause is the rank that failed first."""
            from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

            failures = {}
            for local_rank, process in enumerate(self._pcontext._pc.processes):
                if process.exitcode in (0, None):
                    continue
                failure = ProcessFailure(local_rank, process.pid, process.exitcode,
                                         self._pcontext.error_files[local_rank])
                if not os.path.isfile(failure.error_file):  # no time of its own: when the agent saw it end
                    failure.timestamp = self.ended_at.get(process.pid, failure.timestamp)
                failures[worker_group.workers[local_rank].global_rank] = failure
            return failures

        def _set_local_rank_env(self, worker_env, local_rank, spec):
            # What memx-run set for the job (MEMX_RUN_DIR, MEMX_PLAN, ...): a worker forked from a
            # fork server started before memx-run set them would not inherit them, as a spawned
            # one does; torchrun's own variables take precedence.
            super()._set_local_rank_env(worker_env, local_rank, spec)
            for name, value in os.environ.items():
                worker_env.setdefault(name, value)

        def _restart_workers(self, worker_group):
            self.generation += 1
            worker_group.spec.args = (str(self.generation), *worker_group.spec.args[1:])
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


WORKER_PRELOAD = ("torch", "torch.distributed.pipelining", "memx_launch.runtime.training")
"""What the fork server imports before it forks workers: what every worker imports to train."""


# memx-run's flags after which it starts no worker (a script's flag of the same name only leaves
# the fork server to start with the workers).
_NO_WORKERS = {"-h", "--help", "--version", "--dry-run", "--dry_run", "--print-config", "--print_config"}


def start_fork_server(argv: list[str]) -> bool:
    """Start the fork server now if memx-run's command line ``argv`` forks workers from one, so
    that its imports run while memx-run imports torch and checks its input (seconds each, on two
    cores at once); whether it started. The workers get memx-run's environment from the agent
    whenever the server started."""
    from multiprocessing import forkserver

    if (_NO_WORKERS.intersection(argv) or os.environ.get("PET_START_METHOD", "forkserver") != "forkserver"
            or any(a.startswith(("--start-method", "--start_method")) for a in argv)):
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    forkserver.ensure_running()
    return True


def run_agent(args, worker, worker_args: list[str], verbose: bool = False) -> int:
    """torch.distributed.run.run(args) with memx's agent, each worker process running
    ``worker(generation, *worker_args)``; the job's exit code. ``verbose``: also torchrun's
    root-cause table and its log line about the failure."""
    import torch.distributed.launcher.api as launcher_api
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_hide_signal_shutdown)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _hide_planned_restart if verbose else _hide_failure_logs)
    if not verbose:  # multiprocessing stops the other workers once one ended: memx-run says why
        logging.getLogger("torch.multiprocessing.spawn").addFilter(_hide_failure_logs)
    # torchrun's run() builds the agent and the launch by these module-level names (memx-run's
    # process is their only user): memx's agent, and the worker function instead of a command.
    originals = launcher_api.LocalElasticAgent, torchrun.elastic_launch
    launcher_api.LocalElasticAgent = _agent_class()
    torchrun.elastic_launch = functools.partial(_launch_worker, worker, worker_args)
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        if verbose:
            print(str(exc), file=sys.stderr)  # torchrun's root-cause table
        print(failure_line(exc.failures), file=sys.stderr)
        return exit_code(root_cause(exc.failures)[1].exitcode)
    finally:
        launcher_api.LocalElasticAgent, torchrun.elastic_launch = originals
        stop_fork_server()
    return 0


def stop_fork_server() -> None:
    """Once the workers are gone: the fork server would tear down its interpreter, torch and all
    (about 1 s), after memx-run is gone and holding memx-run's output open till then. It holds
    nothing to save."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # None: never started
    if pid:  # not reaped here: a later start in this process reaps it and starts another
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _launch_worker(worker, worker_args, config, entrypoint):
    """torchrun's ``elastic_launch(config, entrypoint)(*command_args)``, launching the worker
    function of the first generation instead of the command torchrun built."""
    from torch.distributed.launcher.api import elastic_launch

    return lambda *command_args: elastic_launch(config=config, entrypoint=worker)("0", *worker_args)


def _hide_signal_shutdown(record: logging.LogRecord) -> bool:
    """The agent's own lines about a stop signal: memx-run says it once, with how to resume."""
    message = record.getMessage()
    return not any(line in message for line in ("death signal, shutting down workers", "closing signal",
                                                "Closing process"))


def _hide_planned_restart(record: logging.LogRecord) -> bool:
    """The elastic agent logs every non-zero worker exit as a failure; a planned restart is not one."""
    return f"exitcode: {PLANNED_RESTART_EXIT_CODE})" not in record.getMessage()


def _hide_failure_logs(record: logging.LogRecord) -> bool:
    """Without --verbose: none of the agent's lines about failed workers (memx-run says it once)."""
    return not record.getMessage().startswith(("failed (exitcode:", "Terminating process"))
