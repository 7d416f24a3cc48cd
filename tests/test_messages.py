"""Rank-to-rank messages are JSON in uint8 tensors: values of different sizes arrive intact and
nothing is unpickled."""

import os

import pytest

from ranks import spawn_ranks


def _worker(rank, port, queue):
    import pickle

    import torch.distributed as dist

    from memx_launch.runtime.messages import all_gather_json, broadcast_json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import torch.distributed.distributed_c10d as c10d

        loads = []
        real_loads, real_unpickler = pickle.loads, c10d._unpickler
        # Any unpickling is seen: pickle.loads, and the Unpickler torch's object collectives use.
        pickle.loads = lambda *a, **k: loads.append(1) or real_loads(*a, **k)
        c10d._unpickler = lambda *a, **k: loads.append(1) or real_unpickler(*a, **k)
        mine = {"rank": rank, "text": "ünïcode" * (1 + 50 * rank), "values": [1.5, None, True]}
        gathered = all_gather_json(mine)
        plan = broadcast_json({"tp": 2, "stages": [[0, 1]]} if rank == 0 else None, src=0)
        pickle.loads, c10d._unpickler = real_loads, real_unpickler
        queue.put((rank, dict(gathered=gathered, plan=plan, unpickled=len(loads))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_json_messages_arrive_intact_on_every_rank():
    results = spawn_ranks(_worker, 2)
    for r in (0, 1):
        assert [g["rank"] for g in results[r]["gathered"]] == [0, 1]
        assert results[r]["gathered"][1]["text"] == "ünïcode" * 51
        assert results[r]["gathered"][0]["values"] == [1.5, None, True]
        assert results[r]["plan"] == {"tp": 2, "stages": [[0, 1]]}
        assert results[r]["unpickled"] == 0
