"""memx-run's rendezvous: nothing a peer writes to the store is unpickled, each job has a secret
run id, and a one-node job's stores listen on loopback only.

torch's dynamic rendezvous (``--rdzv-backend c10d``, etcd) keeps its state in the store as a
pickle, and torch's TCPStore has no authentication: a host that reaches the port and writes a
state under the run's key would run code in memx-run. memx-run replaces that pickle with JSON
read through a schema (:class:`StateCodec`), draws a random run id when ``--rdzv-id`` is not
given on one node (torchrun's default is the guessable ``none``; several nodes must agree on
one, so there it is required), and runs a one-node job on its own
backend whose stores are bound to 127.0.0.1 (torch binds every interface; a socket bound here is
handed to the store as ``master_listen_fd``). Static rendezvous stays the default between nodes.
"""

from __future__ import annotations

import datetime
import json
import secrets
import socket
import struct
import sys
from typing import Any

from memx_launch.errors import ConfigError
from memx_launch.specs.inputs import parse_json

LOCAL_BACKEND = "memx-local"
LOOPBACK = "127.0.0.1"
DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id default
MAX_STATE_BYTES = 4 * 2**20
"""A state of 1,024 nodes is about 200 KB."""


def configure(args) -> None:
    """Set torchrun's rendezvous arguments for the job: a one-node job with static rendezvous and
    no endpoint gets the loopback backend; a dynamic backend without --rdzv-id gets a random run
    id on one node and is refused on several (each node would draw its own and never meet)."""
    one_node = str(args.nnodes).split(":")[-1] == "1"
    if one_node and args.rdzv_endpoint == "" and args.rdzv_backend == "static":
        args.rdzv_backend, args.rdzv_endpoint, args.local_addr = LOCAL_BACKEND, f"{LOOPBACK}:0", LOOPBACK
    if args.rdzv_backend != "static" and args.rdzv_id == DEFAULT_RUN_ID:
        if not one_node:
            raise ConfigError("--rdzv-id", f"not given for a {args.rdzv_backend} rendezvous of {args.nnodes} nodes",
                              "pass the same secret id on every node, e.g. --rdzv-id $(openssl rand -hex 16)")
        args.rdzv_id = secrets.token_hex(16)
    install()


STORE_ANSWER_S = 10.0
"""How long a store may take to answer a ping before memx-run calls the port taken by another program."""
# torch's TCPStore protocol (torch/csrc/distributed/c10d/TCPStore.cpp): a client validates with
# this magic number, then pings with a nonce that the store sends back.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE


def check_endpoint(args, answer_s: float = STORE_ANSWER_S) -> None:
    """Before the agent starts: the store this node joins (node 0's for static rendezvous,
    --rdzv-endpoint's for c10d) answers, or is not up yet (torch waits for it, and memx-run says
    so). A program that accepts connections there but is no store would get minutes of silence
    (torch's rendezvous timeout): refused in one line instead."""
    if args.rdzv_backend == "static" and args.node_rank != 0 and not args.rdzv_endpoint:
        if not store_answers(args.master_addr, args.master_port, "--master-port", answer_s):
            print(f"memx-run: node 0's store at {args.master_addr}:{args.master_port} is not up yet: waiting for it "
                  "(up to --rdzv-conf timeout=S, torch's default 600 s)", file=sys.stderr, flush=True)
    elif args.rdzv_backend == "c10d" and args.rdzv_endpoint:  # nothing there yet: the node that hosts it starts it
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if port.isdigit():
            store_answers(host, int(port), "--rdzv-endpoint", answer_s)


def store_answers(host: str, port: int, flag: str, answer_s: float = STORE_ANSWER_S) -> bool:
    """True when a torch store answers at host:port, False when nothing listens there; a
    ConfigError when something accepts connections but does not answer as a store."""
    try:
        conn = socket.create_connection((host, port), timeout=answer_s)
    except OSError:
        return False
    nonce = secrets.randbits(32)
    with conn:
        answer = b""
        try:
            conn.sendall(struct.pack("<BIBI", _VALIDATE, _MAGIC, _PING, nonce))
            while len(answer) < 4:
                chunk = conn.recv(4 - len(answer))
                if not chunk:
                    break
                answer += chunk
        except OSError:  # a timeout included
            pass
    if answer != struct.pack("<I", nonce):
        raise ConfigError(flag, f"{host}:{port} accepts connections but did not answer as a torch store within "
                          f"{answer_s:g} s: another program listens there", f"stop that program or pass a free port "
                          f"(the same {flag} on every node)")
    return True


def install() -> None:
    """JSON instead of pickle in torch's dynamic rendezvous (its only use of pickle), and the
    loopback backend registered; memx-run's process is the only user."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, rendezvous_handler_registry

    dynamic_rendezvous.pickle = StateCodec
    rendezvous_handler_registry.register(LOCAL_BACKEND, _create_local_handler)


class StateCodec:
    """Stands in for the ``pickle`` module inside torch's dynamic_rendezvous: ``dumps`` and
    ``loads`` of its ``_RendezvousState`` as JSON; anything else read from the store is refused."""

    PickleError = ValueError  # dynamic_rendezvous reports a refused state as a corrupt one

    @staticmethod
    def dumps(state) -> bytes:
        return json.dumps({
            "round": state.round, "complete": state.complete, "closed": state.closed,
            "deadline": state.deadline.isoformat() if state.deadline else None,
            "participants": [[_node(n), rank] for n, rank in state.participants.items()],
            "wait_list": [_node(n) for n in state.wait_list],
            "redundancy_list": [_node(n) for n in state.redundancy_list],
            "last_heartbeats": [[_node(n), t.isoformat()] for n, t in state.last_heartbeats.items()],
        }).encode()

    @staticmethod
    def loads(data: bytes):
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"a rendezvous state of {len(data)} bytes")
        raw = parse_json(data.decode("utf-8"), "rendezvous state", "the store")
        fields = {"round", "complete", "closed", "deadline", "participants", "wait_list",
                  "redundancy_list", "last_heartbeats"}
        if not isinstance(raw, dict) or set(raw) != fields:
            raise ValueError("the rendezvous state does not have memx's fields")
        state = _RendezvousState()
        state.round = _typed(raw["round"], int)
        state.complete = _typed(raw["complete"], bool)
        state.closed = _typed(raw["closed"], bool)
        state.deadline = None if raw["deadline"] is None else _time(raw["deadline"])
        state.participants = {_node_of(n): _typed(r, int) for n, r in _pairs(raw["participants"])}
        state.wait_list = {_node_of(n) for n in _typed(raw["wait_list"], list)}
        state.redundancy_list = {_node_of(n) for n in _typed(raw["redundancy_list"], list)}
        state.last_heartbeats = {_node_of(n): _time(t) for n, t in _pairs(raw["last_heartbeats"])}
        return state


def _node(node) -> list:
    return [node.addr, node.pid, node.local_id]


def _typed(value: Any, kind: type) -> Any:
    # bool is an int subclass: a round of true is as wrong as a pid of "1"
    if type(value) is not kind:
        raise ValueError(f"the rendezvous state holds {type(value).__name__} where {kind.__name__} belongs")
    return value


def _pairs(value: Any) -> list:
    for pair in _typed(value, list):
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("the rendezvous state holds a malformed entry")
    return value


def _node_of(value: Any):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    if type(value) is not list or len(value) != 3:
        raise ValueError("the rendezvous state holds a malformed node")
    return _NodeDesc(_typed(value[0], str), _typed(value[1], int), _typed(value[2], int))


def _time(value: Any) -> datetime.datetime:
    when = datetime.datetime.fromisoformat(_typed(value, str))
    if when.tzinfo is None:  # torch compares with datetime.now(timezone.utc)
        raise ValueError("the rendezvous state holds a time without a time zone")
    return when


def _loopback_store(port: int = 0, timeout_s: float = 60.0):
    """A TCPStore server listening on 127.0.0.1 only."""
    from torch.distributed import TCPStore

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen()
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the listening socket from here
    return TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=fd,
                    wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def _create_local_handler(params):
    """torch's c10d rendezvous for one node, both of its stores (the rendezvous's and the one the
    workers share) on loopback."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LocalBackend(C10dRendezvousBackend):
        name = LOCAL_BACKEND  # torch checks that a handler's backend carries the requested name

    store = _loopback_store(timeout_s=params.get_as_int("read_timeout", 60))
    handler = create_handler(store, LocalBackend(store, params.run_id), params)
    handler._create_tcp_store_server = lambda _addr, _port: _loopback_store()
    return handler
