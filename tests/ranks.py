"""Spawning a few real torch.distributed processes for a test and collecting their results.

Ranks start from a fork server (multiprocessing's "forkserver"): one clean process, started once
per test session, that imports torch, its pipelining and memx's runtime, and forks each rank from
that state. A rank is still its own process with its own process group; only the imports are
shared. Spawning instead re-imported them in every rank: four ranks on two cores took 14 s to
start, more than most of these tests take to train."""

import importlib.util
import os
import random
import signal
import socket
import sys
import tempfile

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed.pipelining", "memx_launch.runtime.training",
           "memx_launch.runtime.communication", "memx_launch.models.adapters"]
# The Hugging Face tests' models (the [hf] extra): transformers imports each model's module on first
# use, 2-3 s of CPU that every rank paid again.
OPTIONAL_PRELOAD = ["transformers", "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                    "transformers.models.gpt2.modeling_gpt2"]


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range. A port the kernel hands out
    (a bind to port 0, any outgoing connection) can be handed out again, to the ranks of the other
    test process, before this test's rank 0 binds it; one it never hands out cannot."""
    low = _ephemeral_ports_start()
    draw = random.Random()  # not the tests' seeded global generator
    for _ in range(100):
        port = draw.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
        return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def finished(run, last_line: str) -> bool:
    """Whether a one-rank script run directly (not under memx-run) finished: exit 0, or the abort
    of pytorch/pytorch#179291 after it printed ``last_line``: torch.distributed's threads may end
    a process in its C++ teardown, after Python is done ("terminate called without an active
    exception"), which memx-run's workers avoid by ending with os._exit (runtime/process_exit.py)."""
    aborted = run.returncode == -signal.SIGABRT and run.stderr.rstrip().endswith(
        "terminate called without an active exception")
    return run.returncode == 0 or (aborted and last_line in run.stdout)


def one_rank_env(plan_path) -> dict:
    """The environment of a script run as a job of one rank under ``plan_path`` (what memx-run
    would set), without the MEMX_* variables of the test's own environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    # MEMX_STEP_TIMEOUT_S: test plans predict no time (the watchdog's floor); a loaded machine is slow, not hung
    env.update(MEMX_PLAN=str(plan_path), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), MEMX_STEP_TIMEOUT_S="600")
    return env


def rank_context():
    """The multiprocessing context that starts ranks (the fork server's modules set on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + [m for m in OPTIONAL_PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return ctx


def _in_environment(environ, log_path, target, *args):
    # The fork server's environment and output are those it started with: a rank gets the test's
    # own environment, as a spawned process would, and writes to a log the test prints.
    os.environ.clear()
    os.environ.update(environ)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    target(*args)


def spawn_ranks(target, world_size: int, *args, timeout: float = 120) -> dict:
    """Run ``target(rank, port, *args, queue)`` in ``world_size`` processes; each puts one
    ``(rank, result)`` on the queue. Returns ``{rank: result}`` once every process exited 0; what
    the ranks printed goes to the test's stderr (pytest shows it when the test fails)."""
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    with tempfile.NamedTemporaryFile("r", prefix="ranks-", suffix=".log") as log:
        # All ranks on this host, as torchrun would say: each then takes its share of the cores
        # (communication.init_distributed), not all of them (oversubscribed, they ran 3x slower).
        environ = dict(os.environ, LOCAL_WORLD_SIZE=str(world_size))
        procs = [ctx.Process(target=_in_environment, args=(environ, log.name, target, rank, port, *args, queue))
                 for rank in range(world_size)]
        try:
            for p in procs:
                p.start()
            results = dict(queue.get(timeout=timeout) for _ in procs)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            sys.stderr.write(log.read())
    assert all(p.exitcode == 0 for p in procs), results
    return results
