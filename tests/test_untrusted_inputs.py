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
CPU_CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "cpu-emulated.yaml")


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


# ------------------------------------------------------------------ every file memx reads

def _readers(tmp_path):
    """Each reader memx has, given a path: what it raises for a file it must not read."""
    from memx_launch.planning.cases import read_cases
    from memx_launch.planning.replan import ReplanEvent
    from memx_launch.profiling.predictor import Predictor
    from memx_launch.runtime.checkpoint import latest_checkpoint
    from memx_launch.specs.config_file import _load

    def latest(path):
        os.makedirs(tmp_path / "ckpt", exist_ok=True)
        target = tmp_path / "ckpt" / "latest.json"
        if not os.path.lexists(target):
            os.symlink(path, target)
        return latest_checkpoint(str(tmp_path / "ckpt"))

    def predictor_meta(path):
        model = tmp_path / "p.ubj"
        model.write_bytes(b"{}")
        if not os.path.lexists(str(model) + ".meta.json"):
            os.symlink(path, str(model) + ".meta.json")
        return Predictor.load(str(model))

    return {
        "--config": lambda path: _load(build_parser(), path),
        "--cases": lambda path: list(read_cases(path)),
        "latest.json": latest,
        "predictor .meta.json": predictor_meta,
        "replan event": ReplanEvent.load,
    }


def _hostile_file(tmp_path, kind):
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo.jsonl")
        return str(tmp_path / "fifo.jsonl")
    if kind == "directory":
        os.mkdir(tmp_path / "dir.jsonl")
        return str(tmp_path / "dir.jsonl")
    if kind == "oversized":
        path = tmp_path / "big.jsonl"
        with open(path, "wb") as f:
            f.truncate(64 * 2**20)  # sparse: over every cap, no disk used
        return str(path)
    os.symlink("/dev/zero", tmp_path / "zero.jsonl")  # a name the reader expects, a device behind it
    return str(tmp_path / "zero.jsonl")


@FAST
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory", "oversized"])
@pytest.mark.parametrize("reader", ["--config", "--cases", "latest.json", "predictor .meta.json", "replan event"])
def test_no_reader_blocks_or_reads_without_bound(tmp_path, kind, reader):
    path = _hostile_file(tmp_path, kind)
    with pytest.raises(ConfigError, match="not a regular file|over the limit") as exc:
        _readers(tmp_path)[reader](path)
    assert "\n" not in str(exc.value)


@FAST
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory", "oversized"])
def test_a_stopped_record_that_is_no_file_is_ignored_not_waited_on(tmp_path, monkeypatch, kind):
    from memx_launch.runtime.runs import DEFAULT_RUNS_DIR, STOPPED_FILE, stopped_run_of

    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.join(DEFAULT_RUNS_DIR, "r1"))
    os.symlink(os.path.abspath(_hostile_file(tmp_path, kind)), os.path.join(DEFAULT_RUNS_DIR, "r1", STOPPED_FILE))
    assert stopped_run_of(["x"]) is None


@FAST
def test_a_yaml_alias_bomb_in_config_fails_fast_in_one_line(tmp_path, capsys):
    from memx_launch.cli import main

    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    lines += [f'{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]' for p, c in zip("abcdefgh", "bcdefghi")]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    code = main(["plan", "--config", str(tmp_path / "bomb.yaml"), "--model", "llama-tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--config" in err[0] and "anchors (&name) are not accepted" in err[0]


@FAST
@pytest.mark.parametrize("cell", ["\uff11", "\u00b2", "\u0663", "1" * 5000])
def test_a_cases_csv_cell_of_non_ascii_or_endless_digits_is_that_rows_error(tmp_path, capsys, cell):
    import json

    from memx_launch.cli import main

    (tmp_path / "c.csv").write_text(f"tp,pp,dp,micro_batch_size\n{cell},2,2,1\n")
    code = main(["estimate", "--cases", str(tmp_path / "c.csv"), "--model", "llama-tiny", "--cluster", CPU_CLUSTER,
                 "--global-batch-size", "8"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert code == 0 and row["error"].startswith("tp: ") and "is not a plain integer" in row["error"]
    assert len(row["error"]) < 200


@FAST
@pytest.mark.parametrize("text", ['{"step": 1}', '[1]', '{"step": 1, "step": 2}', "EVENT"])
def test_a_replan_event_memx_cannot_trust_is_one_error(tmp_path, text):
    import json

    from memx_launch.planning.replan import ReplanEvent

    event = {"step": 3, "reason": "oom", "rank": 0, "stage": 0, "device_type": "a", "message": "m",
             "observed_gib": ["lots"], "capacity_gib": [1.0]}
    (tmp_path / "event.json").write_text(json.dumps(event) if text == "EVENT" else text)
    with pytest.raises(ConfigError, match="^replan event") as exc:
        ReplanEvent.load(str(tmp_path / "event.json"))
    assert "\n" not in str(exc.value)


@FAST
@pytest.mark.parametrize("text, problem", [
    ('{"tp": 1, "tp": 2}\n', "duplicate key 'tp'"),
    ('{"tp": ' + "9" * 5000 + "}\n", "digits"),
    ('{"tp": NaN}\n', "NaN is not a number"),
])
def test_a_cases_line_memx_cannot_trust_is_that_rows_error(tmp_path, text, problem):
    from memx_launch.planning.cases import read_cases

    (tmp_path / "c.jsonl").write_text(text)
    (n, row), = read_cases(str(tmp_path / "c.jsonl"))
    assert isinstance(row, ConfigError) and problem in str(row)


# ------------------------------------------------------------------ names inside files

HF_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 256, "max_position_embeddings": 64, "hidden_act": "silu"}
TRAIN = os.path.join(os.path.dirname(__file__), "..", "examples", "train.py")


@pytest.mark.parametrize("name", ["../../../escaped", "/tmp/escaped", "..", "a/../../b\nc", ""])
def test_a_name_inside_a_model_config_never_places_the_run_directory(tmp_path, monkeypatch, name):
    import json

    from memx_launch.runtime.launcher import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "_name_or_path": name}))
    args = build_parser().parse_args(["--nproc-per-node", "1", "--dry-run", TRAIN, "--model", "config.json"])
    args.argv = None
    try:
        run_dir = resolve(args)["run_dir"]
    except ConfigError:  # a name memx refuses outright is as good
        return
    assert os.path.dirname(run_dir) == "runs"
    assert os.path.realpath(run_dir).startswith(str(tmp_path.resolve()) + os.sep)
    assert not os.path.basename(run_dir).startswith(".") and "\n" not in run_dir


# ------------------------------------------------------------------ the Lightning callback's profile_db

@pytest.mark.parametrize("kind", ["directory", "link to /dev/null", "fifo"])
def test_the_callback_renames_nothing_but_a_regular_file(tmp_path, kind):
    from memx_callbacks.memx import _set_aside

    db = tmp_path / "profile.jsonl"
    if kind == "directory":
        db.mkdir()
    elif kind == "fifo":
        os.mkfifo(db)
    else:
        os.symlink("/dev/null", db)
    with pytest.raises(ConfigError, match="^profile_db: .* is not a regular file") as exc:
        _set_aside(str(db))
    assert "\n" not in str(exc.value)
    assert os.path.lexists(db) and not os.path.lexists(str(db) + ".old")


def test_the_callback_never_replaces_a_kept_profile(tmp_path):
    from memx_callbacks.memx import _set_aside

    db = tmp_path / "profile.jsonl"
    for fit in ("the user's own records\n", "fit 1\n", "fit 2\n"):
        db.write_text(fit)
        _set_aside(str(db))
        assert not db.exists()
    kept = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert kept == {"profile.jsonl.old": "the user's own records\n", "profile.jsonl.old.1": "fit 1\n",
                    "profile.jsonl.old.2": "fit 2\n"}


OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list"}
PICKLING_MODULES = {"pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
MEMX_SOURCES = ("memx_launch", "callbacks", "examples", "benchmarks")


def _pickling_calls(tree) -> list[str]:
    """Where a module's syntax tree pickles: torch's object collectives, pickle-like modules,
    torch.load without weights_only=True, numpy loads with allow_pickle=True."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in PICKLING_MODULES]
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        keywords = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
        if name in OBJECT_COLLECTIVES:
            found.append(f"line {node.lineno}: {name}")
        if name == "load" and getattr(node.func.value if isinstance(node.func, ast.Attribute) else None, "id", "") \
                == "torch" and keywords.get("weights_only") is not True:
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        if keywords.get("allow_pickle") is True:
            found.append(f"line {node.lineno}: allow_pickle=True")
    return found


def test_the_scan_sees_each_way_of_pickling():
    import ast

    source = ("import pickle\nfrom torch.distributed import broadcast_object_list\n"
              "dist.send_object_list([m], dst=1)\ntorch.load(p)\ntorch.load(p, weights_only=True)\n"
              "np.load(p, allow_pickle=True)\n")
    assert _pickling_calls(ast.parse(source)) == [
        "line 1: imports pickle", "line 3: send_object_list", "line 4: torch.load without weights_only=True",
        "line 6: allow_pickle=True"]


def test_no_memx_code_path_pickles_on_the_wire_or_on_disk():
    """Nothing received from a rank or read from a file is unpickled: the pipeline stages' shape
    metadata and the callback's decision travel as JSON (runtime/messages.py); the rendezvous
    codec (runtime/rendezvous.py) replaces torch's pickle. The runtime's multi-rank tests count
    the unpickling that actually happens (tests/test_cross_vendor.py)."""
    import ast
    import glob

    root = os.path.join(os.path.dirname(__file__), "..")
    found = {}
    for folder in MEMX_SOURCES:
        for path in glob.glob(os.path.join(root, folder, "**", "*.py"), recursive=True):
            with open(path) as f:
                calls = _pickling_calls(ast.parse(f.read()))
            if calls:
                found[os.path.relpath(path, root)] = calls
    assert found == {}


def test_pipeline_shape_metadata_round_trips_as_json_and_crafted_metadata_is_refused():
    import json

    import torch
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, _TensorMeta

    from memx_launch.runtime.pipeline_stage import decode_meta, encode_meta

    activation = _TensorMeta.from_tensor(torch.zeros(2, 8, 16, dtype=torch.bfloat16, requires_grad=True))
    for meta in (_StageForwardMeta((activation,)), _StageBackwardMeta((None, activation))):
        assert decode_meta(json.loads(json.dumps(encode_meta(meta))), 1) == meta
    good = encode_meta(_StageForwardMeta((activation,)))
    for crafted in ({"direction": "sideways", "tensors": []}, [1, 2],
                    {**good, "tensors": [dict(good["tensors"][0], dtype="__class__")]},
                    {**good, "tensors": [dict(good["tensors"][0], shape=[-1, 8, 16])]},
                    {**good, "tensors": [dict(good["tensors"][0], shape=[2**70])]},
                    {**good, "tensors": [dict(good["tensors"][0], exploit="os.system")]},
                    {**good, "tensors": [None]}):
        with pytest.raises(ConfigError, match="^pipeline metadata: rank 3 sent") as exc:
            decode_meta(crafted, 3)
        assert "\n" not in str(exc.value)
