"""What reaches memx from outside its own code: the network (the rendezvous store), files it reads
(FIFOs, devices, directories, huge or crafted files), names inside those files, the Lightning
callback's arguments and the predictor cache. Each is refused in one line or handled, fast.
"""

from __future__ import annotations

import datetime
import os
import pickle

import pytest

from memx_launch.errors import ConfigError
from memx_launch.runtime import rendezvous
from memx_launch.runtime.launcher import build_parser

FAST = pytest.mark.timeout(5)


class _Exploit:
    ran = False

    def __reduce__(self):
        return (setattr, (_Exploit, "ran", True))


def _torchrun_args(*flags: str):
    return build_parser().parse_args([*flags, "train.py"])


def test_a_dynamic_rendezvous_gets_a_secret_run_id(monkeypatch):
    monkeypatch.setattr(rendezvous, "install", lambda: None)
    ids = []
    for _ in range(2):
        args = _torchrun_args("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400")
        rendezvous.configure(args)
        assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "localhost:29400"
        ids.append(args.rdzv_id)
    assert ids[0] != ids[1] and all(len(i) == 32 and i != "none" for i in ids)


def test_several_nodes_of_a_dynamic_rendezvous_must_name_their_run_id(monkeypatch):
    monkeypatch.setattr(rendezvous, "install", lambda: None)
    args = _torchrun_args("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0")
    with pytest.raises(ConfigError, match="--rdzv-id: not given.*openssl rand"):
        rendezvous.configure(args)
    args = _torchrun_args("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "job7", "--rdzv-endpoint", "n0")
    rendezvous.configure(args)
    assert args.rdzv_id == "job7"
    args = _torchrun_args("--nnodes", "2", "--master-addr", "n0")
    rendezvous.configure(args)
    assert (args.rdzv_backend, args.rdzv_id) == ("static", "none")  # static reads no state from the store


def test_a_one_node_job_rendezvous_on_loopback_with_a_secret_id(monkeypatch):
    monkeypatch.setattr(rendezvous, "install", lambda: None)
    args = _torchrun_args("--nproc-per-node", "2")
    rendezvous.configure(args)
    assert args.rdzv_backend == rendezvous.LOCAL_BACKEND
    assert args.rdzv_endpoint.startswith("127.0.0.1:") and args.local_addr == "127.0.0.1"
    assert len(args.rdzv_id) == 32


@FAST
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_one_node_store_listens_on_loopback_only():
    store = rendezvous._loopback_store(timeout_s=2)
    store.set("k", "v")
    assert store.get("k") == b"v"
    with open("/proc/net/tcp") as f:
        listening = [line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"]
    assert f"0100007F:{store.port:04X}" in listening
    assert not any(entry.endswith(f":{store.port:04X}") and entry != f"0100007F:{store.port:04X}"
                   for entry in listening)


def _state():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    a, b = _NodeDesc("n0", 11, 0), _NodeDesc("n1", 12, 1)
    now = datetime.datetime.now(datetime.timezone.utc)
    state.round, state.complete, state.deadline = 3, True, now
    state.participants, state.wait_list, state.last_heartbeats = {a: 0, b: 1}, {b}, {a: now, b: now}
    return state


def test_the_rendezvous_state_travels_as_json_and_round_trips():
    state = _state()
    data = rendezvous.StateCodec.dumps(state)
    assert data.startswith(b"{")
    back = rendezvous.StateCodec.loads(data)
    assert vars(back) == vars(state)


@pytest.mark.parametrize("payload", [
    pickle.dumps(_Exploit()),
    b'{"round": 1}',
    rendezvous.StateCodec.dumps(_state()).replace(b'"round": 3', b'"round": true'),
    rendezvous.StateCodec.dumps(_state()).replace(b'"round": 3', b'"round": ' + b"9" * 5000),
], ids=["pickle", "fields-missing", "bool-round", "huge-int"])
def test_a_state_written_by_a_peer_is_refused_not_unpickled(payload):
    with pytest.raises(ValueError):
        rendezvous.StateCodec.loads(payload)
    assert not _Exploit.ran


def test_torchs_dynamic_rendezvous_reads_the_store_through_the_codec():
    from torch.distributed.elastic.rendezvous import (
        RendezvousStateError,
        dynamic_rendezvous,
        rendezvous_handler_registry,
    )

    rendezvous.install()
    assert dynamic_rendezvous.pickle is rendezvous.StateCodec
    assert rendezvous_handler_registry._registry[rendezvous.LOCAL_BACKEND] is rendezvous._create_local_handler

    class Backend:
        name = "planted"

        def get_state(self):
            return pickle.dumps(_Exploit()), b"token"

    settings = dynamic_rendezvous.RendezvousSettings(
        "job", 1, 1, dynamic_rendezvous.RendezvousTimeout(), keep_alive_interval=datetime.timedelta(seconds=5),
        keep_alive_max_attempt=3)
    holder = dynamic_rendezvous._BackendRendezvousStateHolder(Backend(), settings, cache_duration=0)
    with pytest.raises(RendezvousStateError):
        holder.sync()
    assert not _Exploit.ran
