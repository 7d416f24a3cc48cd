"""ProfileDB: calibration measurements on disk, one JSON record per line, append-only.

Each record is self-contained: the device type's descriptors, the block shape that was run,
the configuration, the measured time and memory, and the software versions. Records are
keyed by (device type, model signature, software versions); many ranks append to one file
(whole lines under an exclusive lock, then fsync) or write their own files that
:func:`merge_profiles` joins. A corrupt line is skipped with a warning, never fatal.
No torch import here: the planner reads profiles anywhere.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Iterable

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.files import atomic_output, check_output_path
from memx_launch.specs.checks import require_name, require_number, require_type
from memx_launch.specs.inputs import parse_json, read_text
from memx_launch.specs.model import MAX_DIMENSION, ModelSpec

MAX_PROFILE_BYTES = 1 * 2**30

PROFILE_FORMAT = 1


class ProfileWarning(UserWarning):
    """A ProfileDB record could not be used (corrupt or of another format)."""


@dataclass(frozen=True)
class Measurement:
    """One calibration sample: k transformer blocks, forward + backward, on one device type."""

    device_type: str
    device: dict
    """The device type's descriptors (vendor, memory_gib, peak_tflops, memory_bandwidth_gbps,
    efficiency, flash_attention) so that a record alone rebuilds its analytical estimate."""
    model: str
    model_signature: str
    """Signature of the model this profile is for (what the planner asks for)."""
    block_shape: dict
    """ModelSpec fields of the blocks actually run (differs from the model's in ablations
    over shape parameters such as num_kv_heads)."""
    tp: int
    micro_batch_size: int
    seq_len: int
    recompute: str
    dtype: str
    num_blocks: int
    feasible: bool
    """False when the sample ran out of memory: it marks the feasibility boundary."""
    time_s: float | None = None
    """Median seconds of forward + backward of one block (emulated slowdown applied)."""
    time_spread_s: float | None = None
    """Interquartile range of the per-block repeats."""
    host_time_s: float | None = None
    """GPUs: median seconds the host took to issue one block's forward + backward (the calls
    return before the device finishes); None on CPUs, where ops run inline."""
    peak_memory_bytes: float | None = None
    """Peak bytes allocated above the resting state (weights, grads, input) over the
    forward + backward of all ``num_blocks`` blocks."""
    peak_reserved_bytes: float | None = None
    """GPUs: the caching allocator's peak reserve above the resting state over the same
    step (allocated plus its slack); None on CPUs."""
    context_bytes: float | None = None
    """GPUs: device memory the process holds outside the caching allocator (CUDA context with
    its kernel modules, communication buffers): used minus reserved, read once per record."""
    embedding_time_s: float | None = None
    """Forward + backward of the embedding at this configuration, where the profile timed it."""
    head_time_s: float | None = None
    """Forward + backward of the final norm, output layer and loss, where the profile timed it."""
    run_options: dict = field(default_factory=dict)
    """TrainingSpec options the blocks ran with that change their cost (flash_attention,
    fused_softmax, dropout, ...); empty: memx's defaults. The learned ratio is taken against
    the analytical model at these options, so a plan at other options keeps the physics of
    the difference."""
    tp_link_gbps: float | None = None
    """Bandwidth the TP group reached on the cluster it ran on (``tp_links.tp_link_gbps``: on a
    PCIe node, staged through the host), the figure the learned ratio's base is taken at
    (None for tp=1)."""
    tp_over_pcie: bool = False
    """The TP group talked over PCIe through the host (``tp_links.tp_over_pcie``): the base is
    taken with PCIe's per-step latencies, as the plan's prediction is."""
    emulation_slowdown: float = 1.0
    emulated: bool = False
    software: dict = field(default_factory=dict)
    """Versions that change kernels: torch, CUDA, memx."""
    source: str = "memx-profile"
    format: int = PROFILE_FORMAT

    @property
    def key(self) -> tuple:
        """Identity of a sample; later duplicates replace earlier ones on merge."""
        return (self.device_type, self.model_signature, json.dumps(self.block_shape, sort_keys=True),
                self.tp, self.micro_batch_size, self.seq_len, self.recompute, self.dtype,
                json.dumps(self.software, sort_keys=True))

    def shape_spec(self) -> ModelSpec:
        return ModelSpec(**self.block_shape)

    def to_json(self) -> str:
        # Its fields hold numbers, text and flat dicts: dumped as they are (asdict's deep copy
        # of every record made the profile's signature a second per few thousand records).
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this memx reads {PROFILE_FORMAT}")
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls)
                   if f.name not in data and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        _check_record(data)
        from memx_launch.specs.training import TrainingSpec

        options = {f.name for f in fields(TrainingSpec)}
        unknown = sorted(set(data.get("run_options") or {}) - options)
        if unknown:
            raise ValueError(f"unknown run option(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def _check_record(data: dict) -> None:
    """Types and ranges of a record (ValueError: the line is skipped as corrupt)."""
    for key in ("device_type", "model", "model_signature", "recompute", "dtype"):
        require_type(data[key], str, key)
        require_name(data[key], key)
    for key in ("device", "block_shape"):
        require_type(data[key], dict, key)
    for key in ("tp", "micro_batch_size", "seq_len", "num_blocks"):
        require_number(data[key], key, lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
    require_type(data["feasible"], bool, "feasible")
    require_type(data.get("tp_over_pcie", False), bool, "tp_over_pcie")
    for key in ("time_s", "time_spread_s", "host_time_s", "peak_memory_bytes", "peak_reserved_bytes", "tp_link_gbps",
                "emulation_slowdown", "context_bytes", "embedding_time_s", "head_time_s"):
        if data.get(key) is not None:
            require_number(data[key], key, lo=0)
    if data.get("run_options") is not None:
        require_type(data["run_options"], dict, "run_options")
    ModelSpec.from_dict(data["block_shape"], "block_shape")


BRIDGE_KIND = "bridge"


@dataclass(frozen=True)
class BridgeMeasurement:
    """One measured bridge message between two communication domains: ``nbytes`` sent one way
    between host buffers over ``backend`` (half a ping-pong's round trip), the median of its
    repeats. Several sizes per pair let :func:`fit_bridge` fit latency and bandwidth; the
    staging copies are priced apart (``cluster.bridge``'s host_copy_gbps)."""

    domains: tuple[str, str]
    backend: str
    nbytes: int
    seconds: float
    ranks: tuple[int, int] | None = None
    """The two global ranks that exchanged (None: not recorded)."""
    software: dict = field(default_factory=dict)
    kind: str = BRIDGE_KIND
    """What tells a bridge line from a layer sample in the same file."""
    format: int = PROFILE_FORMAT

    @property
    def pair(self) -> tuple[str, str]:
        """The domains in one order (a measurement either way serves both directions)."""
        return tuple(sorted(self.domains))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "BridgeMeasurement":
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this memx reads {PROFILE_FORMAT}")
        domains = data.get("domains")
        if not (isinstance(domains, list) and len(domains) == 2):
            raise ValueError("domains must be two names")
        for name in (*domains, data.get("backend")):
            require_type(name, str, "domains/backend")
            require_name(name, "domains/backend")
        require_number(data.get("nbytes"), "nbytes", lo=0, lo_open=True, integer=True)
        require_number(data.get("seconds"), "seconds", lo=0, lo_open=True)
        ranks = data.get("ranks")
        if ranks is not None:
            if not (isinstance(ranks, list) and len(ranks) == 2):
                raise ValueError("ranks must be two ranks")
            for r in ranks:
                require_number(r, "ranks", lo=0, integer=True)
        require_type(data.get("software", {}), dict, "software")
        return cls(tuple(domains), data["backend"], data["nbytes"], data["seconds"],
                   None if ranks is None else tuple(ranks), dict(data.get("software", {})))


def fit_bridge(points: Iterable[BridgeMeasurement]) -> tuple[float, float]:
    """(latency_s, gbps) of seconds = latency_s + nbytes / (gbps * 1e9) through the points,
    least squares on relative error (small and large messages count alike). ValueError unless
    the points span two sizes and time grows with size."""
    points = list(points)
    sizes = np.array([p.nbytes for p in points], dtype=np.float64)
    seconds = np.array([p.seconds for p in points], dtype=np.float64)
    if len(np.unique(sizes)) < 2:
        raise ValueError("bridge measurements of at least two message sizes are needed")
    slope, intercept = np.polyfit(sizes, seconds, 1, w=1.0 / seconds)
    if slope <= 0:
        raise ValueError("bridge time does not grow with the message size")
    return max(float(intercept), 0.0), float(1.0 / (slope * 1e9))


def fitted_bridges(measurements: Iterable[BridgeMeasurement], backend: str) -> dict:
    """Per pair of domains measured over ``backend``, its fitted (latency_s, gbps); a pair
    whose points cannot be fitted is left out with a :class:`ProfileWarning`."""
    by_pair: dict[tuple[str, str], list[BridgeMeasurement]] = {}
    for m in measurements:
        if m.backend == backend:
            by_pair.setdefault(m.pair, []).append(m)
    out = {}
    for pair, points in by_pair.items():
        try:
            out[pair] = fit_bridge(points)
        except ValueError as exc:
            warnings.warn(f"bridge {pair[0]}<->{pair[1]}: measurements not used ({exc})", ProfileWarning,
                          stacklevel=2)
    return out


class ProfileDB:
    """One JSONL file of :class:`Measurement` records and :class:`BridgeMeasurement` lines
    (``"kind": "bridge"``)."""

    def __init__(self, path: str):
        self.path = path

    def check_appendable(self, flag: str = "--out") -> None:
        """Before measuring: a regular file (or a new one) that memx may append to."""
        check_output_path(self.path, flag, force=True)
        if os.path.exists(self.path) and not os.access(self.path, os.W_OK):
            raise ConfigError(flag, f"cannot write to {self.path}", "choose a file you can write to")

    def append(self, measurements: Iterable[Measurement | BridgeMeasurement]) -> int:
        """Append whole lines under an exclusive lock, then fsync; safe for concurrent ranks. A
        write that fails (a full disk) is cut back off, so that no torn record is left; a torn
        last line left by a crash gets its own line, so that the next record is not glued onto it."""
        payload = "".join(m.to_json() + "\n" for m in measurements).encode()
        if not payload:
            return 0
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # O_NOFOLLOW: a link put in place of the profile never redirects the append into another file
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                payload = b"\n" + payload
            try:
                written = 0
                while written < len(payload):
                    written += os.write(fd, payload[written:])
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)  # closing releases the lock
        return payload.count(b"\n") - payload.startswith(b"\n")

    def append_or_keep(self, measurements: list[Measurement]) -> int:
        """append(); when that fails after measuring, the measurements go to a new file in the
        temporary directory and the error says where."""
        try:
            return self.append(measurements)
        except OSError as exc:
            fd, rescue = tempfile.mkstemp(prefix="memx-profile-", suffix=".jsonl")
            with os.fdopen(fd, "w") as f:
                f.writelines(m.to_json() + "\n" for m in measurements)
            raise ConfigError("--out", f"cannot append to {self.path} ({exc.strerror}); the measurements are kept "
                              f"in {rescue}", f"append that file to the profile: cat {rescue} >> {self.path}") from None

    def append_bridge(self, measurements: Iterable[BridgeMeasurement]) -> int:
        """Append bridge measurements (:meth:`append`'s locking); returns the lines written."""
        return self.append(measurements)

    def read(self) -> list[Measurement]:
        """All valid layer samples; bridge lines are :meth:`bridge_measurements`'; corrupt or
        foreign lines are skipped with a :class:`ProfileWarning`."""
        return [r for r in self._records() if isinstance(r, Measurement)]

    def bridge_measurements(self) -> list[BridgeMeasurement]:
        """All valid bridge measurements, in file order."""
        return [r for r in self._records() if isinstance(r, BridgeMeasurement)]

    def _records(self) -> list:
        text = read_text(self.path, "--profile-db", MAX_PROFILE_BYTES,
                         "run memx profile --model NAME --out FILE first")
        out = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = parse_json(line, "record", self.path)
                kind = BridgeMeasurement if isinstance(data, dict) and data.get("kind") == BRIDGE_KIND else Measurement
                out.append(kind.from_dict(data))
            except (ValueError, TypeError) as exc:
                warnings.warn(f"{self.path}:{lineno}: skipped a corrupt profile record ({exc})",
                              ProfileWarning, stacklevel=3)
        return out

    def for_model(self, model: ModelSpec, records: list[Measurement] | None = None) -> list[Measurement]:
        """Records of ``model`` (by shape signature) among ``records`` (default: the file's);
        a clear error when the file holds others."""
        records = self.read() if records is None else records
        signature = model.signature()
        mine = [r for r in records if r.model_signature == signature]
        if not mine:
            others = sorted({f"{r.model} ({r.model_signature})" for r in records})
            problem = (f"holds measurements of {', '.join(others)}, not of {model.name} ({signature})"
                       if others else "holds no valid measurement")
            raise ConfigError(f"--profile-db {self.path}", problem,
                              f"run memx profile --model {model.name} --out {self.path}")
        return mine


def deduplicate(records: Iterable[Measurement]) -> list[Measurement]:
    """Later records with the same key replace earlier ones (a re-run supersedes)."""
    by_key: dict[tuple, Measurement] = {}
    for r in records:
        by_key.pop(r.key, None)
        by_key[r.key] = r
    return list(by_key.values())


def merge_profiles(paths: Iterable[str], out_path: str) -> int:
    """Join per-rank profile files into one (layer samples deduplicated, bridge measurements
    all kept), written atomically."""
    paths = list(paths)
    records = deduplicate(r for p in paths for r in ProfileDB(p).read()) + [
        b for p in paths for b in ProfileDB(p).bridge_measurements()]
    with atomic_output(out_path, "--out", overwrite=True) as tmp:
        with open(tmp, "w") as f:
            f.writelines(r.to_json() + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
    return len(records)
