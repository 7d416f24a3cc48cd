"""The emulated slowdown charges compute, never time blocked waiting for a peer (issue 22: TP
plans hung when all-reduce waits were timed as compute and slept a multiple of)."""

import os
import time

import torch

from memx_launch.profiling.emulation import EmulatedDevice
from ranks import spawn_ranks

PEER_DELAY_S = 1.0


def _wait_worker(rank, port, queue):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:
            time.sleep(PEER_DELAY_S)  # rank 0's all-reduce result arrives this much later
        device = EmulatedDevice("slow", memory_gib=1.0, slowdown=3.0)
        with device:
            # DTensor's TP returns such pending results: the wait runs in the next operator's dispatch
            pending = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
            start = time.perf_counter()
            total = (pending * 2).sum().item()
            wall = time.perf_counter() - start
        queue.put((rank, (total, wall, device.compute_s, device.slept_s)))
    finally:
        dist.destroy_process_group()


def test_a_wait_for_a_collective_result_is_not_charged_as_compute():
    total, wall, compute_s, slept_s = spawn_ranks(_wait_worker, 2, timeout=120)[0]
    assert total == 16.0  # the all-reduce's result, waited for
    assert wall > 0.5 * PEER_DELAY_S  # rank 0 did wait for its peer...
    assert compute_s < 0.2 * PEER_DELAY_S and slept_s < 0.4 * PEER_DELAY_S  # ...and was not charged for it
