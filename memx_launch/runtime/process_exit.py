"""Ending a memx process without interpreter finalization."""

from __future__ import annotations

import atexit
import os
import sys


def run_exit_handlers() -> None:
    """The script's and memx's exit handlers, then the streams flushed: what finalization would
    have done that a process ending by ``os._exit`` still needs."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def end_process(code: int) -> None:
    """Exit with ``code`` as multiprocessing ends a forked worker: exit handlers run, but the
    interpreter is not finalized, where torch.distributed's threads (gloo's, the rendezvous
    store's) may still run and abort the process (SIGABRT, "terminate called without an active
    exception"; pytorch/pytorch#179291): a worker after a clean run, about once in ten 4-rank
    runs, and memx-run after its checkpointed stop by a signal, once in five full test runs on 2
    cores."""
    run_exit_handlers()
    os._exit(code)
