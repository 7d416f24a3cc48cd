"""Spawning a few real torch.distributed processes for a test and collecting their results."""

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world_size: int, *args, timeout: float = 120) -> dict:
    """Run ``target(rank, port, *args, queue)`` in ``world_size`` spawned processes; each puts
    one ``(rank, result)`` on the queue. Returns ``{rank: result}`` once every process exited 0."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, queue)) for rank in range(world_size)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), results
    return results
