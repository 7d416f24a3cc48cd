"""Emulated accelerators on CPU: a memory capacity enforced by a guard, and a compute slowdown.

A TorchDispatchMode sees every tensor an operator creates (forward, backward, recompute,
optimizer, pipeline receive buffers), so it counts live tensor bytes exactly, by storage,
where process RSS would mix in the interpreter and allocator slack. The same mode times
each compute operator and sleeps until it has taken slowdown times the operator's own CPU time
(slowdown - 1 times as long, where the rank has a core to itself), so a slower device type is
slower in its compute and not in its waits on communication: collectives are not timed, and an
operator whose input is a functional collective's pending result (an AsyncCollectiveTensor, as
DTensor's tensor parallel returns) first waits for it, untimed. Timing that wait as compute
made TP ranks sleep in proportion to each other's waits, a loop that grew every step.

The emulated device is the mode as a whole: training runs under it (runtime/training.py) and so
does calibration (profiling/kernel.py), whose timed blocks pay the mode's call and bookkeeping per
operator (llama-tiny's block about twice its bare time under it: ``guard_cost`` in
benchmarks/results/main_job_step_time.json) and its sleeps, as the steps will.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30
# Sleeping costs ~0.1 ms of overhead, so owed slowdown time is paid in slices of at least this.
MIN_SLEEP_S = 0.002
# Operators that move data between ranks: their time is waiting, not this device's compute.
COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")


class EmulatedOutOfMemoryError(torch.OutOfMemoryError):
    """Raised when an emulated device's tensors pass its capacity, as a GPU allocator would."""


class EmulatedDevice(TorchDispatchMode):
    """Use as a context manager around the work of one rank; ``peak_bytes`` since
    :meth:`reset_peak` is the most tensor memory alive at once."""

    def __init__(self, device_type: str, memory_gib: float, slowdown: float = 1.0):
        super().__init__()
        self.device_type = device_type
        self.capacity_bytes = memory_gib * GIB
        self.slowdown = slowdown
        self.live_bytes = 0
        self.peak_bytes = 0
        self.compute_s = 0.0
        self.slept_s = 0.0
        self._owed_s = 0.0
        # Keyed by the storage itself (its C++ object), not its data pointer: FSDP2 resizes a
        # parameter's storage to 0 and back, so a pointer goes stale and host memory can reuse it.
        self._storages: dict[int, list[int]] = {}  # storage -> [tracked tensors, nbytes counted]
        self._tensors: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (weakref that releases it, storage)
        # Strict mode's bridge check (communication.StrictBridgeCheck.check), called here for every
        # collective: as a second dispatch mode it cost a quarter of an emulated rank's CPU.
        self.collective_check = None

    @property
    def label(self) -> str:
        return f"{self.device_type} (emulated)"

    def track(self, tensors) -> None:
        """Count tensors that already exist (weights, gradients, optimizer state)."""
        for t in tensors:
            self._track(t)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in this device's memory (a tensor its guard counts)."""
        storage = _holder(t).untyped_storage()
        return storage.nbytes() > 0 and _storage_key(storage) in self._storages

    def reset_peak(self) -> None:
        self._recount()
        self.peak_bytes = self.live_bytes
        self.compute_s = 0.0
        self.slept_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for pending in _pending_collectives(args, kwargs):
            pending.trigger_wait()
        if func.namespace in COMMUNICATION_NAMESPACES:
            if self.collective_check is not None:
                self.collective_check(func, args)
            out = func(*args, **(kwargs or {}))
            for t in tensors_in(out):
                self._track(t)
            return out
        start = time.perf_counter()
        if self.slowdown == 1:
            out = func(*args, **(kwargs or {}))
        else:
            own_start = time.thread_time()
            out = func(*args, **(kwargs or {}))
            # The device takes slowdown x the operator's own CPU time. Ranks sharing the host's
            # cores stretch the operator's wall time; the sleep takes that stretch in, instead of
            # multiplying it (calibration times one rank at a time, unstretched).
            own_s, wall_s = time.thread_time() - own_start, time.perf_counter() - start
            self._owed_s += max(0.0, self.slowdown * own_s - wall_s)
        for t in tensors_in(out):
            self._track(t)
        # Compute: the operator and the guard's books on it, as calibration's timed blocks hold them.
        self.compute_s += time.perf_counter() - start
        if self._owed_s >= MIN_SLEEP_S:
            time.sleep(self._owed_s)
            self.slept_s += self._owed_s
            self._owed_s = 0.0
        return out

    def _track(self, t: torch.Tensor) -> None:
        t = _holder(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        known = self._tensors.get(id(t))
        if known is not None:  # an in-place operator's output: its storage may have been resized
            entry = self._storages.get(known[1])
            if entry is not None:
                self._resize(entry, nbytes)
            return
        if nbytes == 0:
            return
        key = _storage_key(storage)
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [0, 0]
        entry[0] += 1
        tid = id(t)
        self._tensors[tid] = (weakref.ref(t, lambda _ref, tid=tid, key=key: self._release(tid, key)), key)
        self._resize(entry, nbytes)

    def _resize(self, entry: list[int], nbytes: int) -> None:
        grown = nbytes - entry[1]
        entry[1] = nbytes
        self.live_bytes += grown
        if grown > 0 and self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.peak_bytes > self.capacity_bytes:
                self._raise_oom(grown)

    def _recount(self) -> None:
        """Bring each storage's bytes up to date: one resized in place (FSDP2 frees an unsharded
        parameter to 0 bytes after its forward) is seen only when an operator next outputs it."""
        for ref, key in list(self._tensors.values()):
            t, entry = ref(), self._storages.get(key)
            if t is not None and entry is not None:
                self._resize(entry, t.untyped_storage().nbytes())

    def _release(self, tid: int, key: int) -> None:
        self._tensors.pop(tid, None)
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            self.live_bytes -= entry[1]

    def _raise_oom(self, nbytes: int) -> None:
        raise EmulatedOutOfMemoryError(
            f"CUDA out of memory (emulated device {self.device_type}). Tried to allocate "
            f"{nbytes / 2**20:.2f} MiB; {self.live_bytes / GIB:.4f} GiB in use would pass the emulated "
            f"capacity of {self.capacity_bytes / GIB:.4f} GiB. Choose a plan with more recompute or fewer "
            f"layers on this device type, or raise memory_gib in the cluster file.")


def _holder(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage ``t`` uses: a DTensor's shard, a collective's pending result
    (DTensor's row-parallel outputs are such wrappers, each with a storage of its own that holds
    nothing: counted, every TP all-reduce's output was counted twice)."""
    local = getattr(t, "_local_tensor", None)
    t = t if local is None else local
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _storage_key(storage: torch.UntypedStorage) -> int:
    """The address of the storage's C++ object: fixed for its life, unlike its data pointer."""
    return storage._cdata


def _pending_collectives(args, kwargs):
    """The unfinished collective results among an operator's inputs (a DTensor's local shard can
    be one): their waits would otherwise run inside the operator's timed dispatch. Operator
    arguments nest tensors one list deep at most; a pytree walk here doubled the mode's overhead."""
    for arg in (*args, *kwargs.values()) if kwargs else args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if type(t) is torch.Tensor or not isinstance(t, torch.Tensor):  # most arguments: nothing to wait for
                continue
            local = getattr(t, "_local_tensor", t)
            if isinstance(local, AsyncCollectiveTensor) and not local.completed:
                yield local


def tensors_in(value):
    """The tensors in an operator's arguments or outputs (a tensor, or lists and tuples of them):
    a pytree walk of the outputs was 15% of the emulated device's overhead in a profile."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def device_for_rank(cluster, rank: int) -> EmulatedDevice:
    """The emulated device the cluster file gives ``rank`` (rank order: ClusterSpec.rank_device_types())."""
    from memx_launch.errors import ConfigError

    types = cluster.rank_device_types()
    if rank >= len(types):
        raise ConfigError("--cluster", f"rank {rank} has no device in {cluster.name} ({len(types)} devices)",
                          "launch as many processes as the cluster file declares devices")
    name = types[rank]
    slowdown = cluster.emulation.slowdown_of(name) if cluster.emulation else 1.0
    return EmulatedDevice(name, cluster.device_type(name).memory_gib, slowdown)
