"""Every process group of a job whose ranks may use different collective libraries.

Each device type belongs to a communication domain (ClusterSpec.rank_domains: NCCL for NVIDIA,
RCCL for AMD, ...). A group whose members share a domain uses that domain's native backend and is
created by its members only, so it exists only where its library does. Traffic between domains
takes the **bridge**: a backend every torch build has (gloo over TCP; MPI or UCC by the cluster
file's ``bridge.backend``), carrying host tensors: a device tensor is staged to host memory, sent,
and copied to the receiver's device. The crossing traffic is pipeline P2P between stages on
different domains (runtime/pipeline_stage.py), the gradient sync of a stage whose DP replicas
span domains (:meth:`Communicator.all_reduce_mean`, hierarchical) and job-wide scalars.

Nothing else in memx creates process groups. Strict mode (MEMX_STRICT_DOMAINS=1, the default on
emulated clusters) fails the job when a group that is not a bridge spans two domains, or when a
device tensor (on an emulated device: one its guard counts) reaches a bridge op unstaged.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memx_launch.errors import ConfigError
from memx_launch.profiling.emulation import tensors_in
from memx_launch.runtime.bridge_traffic import BridgeTraffic

STRICT_VAR = "MEMX_STRICT_DOMAINS"  # 1 on, 0 off, unset: on for emulated clusters (memx-run checks it first)
# Gradients summed across domains travel in flat buckets of this size (the last one smaller).
BUCKET_BYTES = 2**20
# Each torch build names its vendor's library by the device it drives (ROCm's torch calls RCCL "nccl").
NATIVE_BACKEND_BY_DEVICE = {"cuda": "nccl", "xpu": "xccl", "npu": "hccl", "cpu": "gloo"}


class DomainViolation(RuntimeError):
    """Strict mode: a native group spans domains, or a device tensor reached the bridge unstaged."""


def bridge_backend(cluster) -> str:
    """The cluster file's bridge backend (gloo without a file), if this torch build has it."""
    backend = cluster.bridge.backend if cluster is not None else "gloo"
    if backend != "gloo" and not dist.is_backend_available(backend):
        raise ConfigError("cluster.bridge.backend", f"this torch build has no {backend} backend",
                          "use gloo, or a torch built with it on every node")
    return backend


def strict_mode(emulated: bool, environ=os.environ) -> bool:
    value = environ.get(STRICT_VAR, "")
    if value not in ("", "0", "1"):
        raise ConfigError(STRICT_VAR, f"must be 0 or 1, got {value!r}", f"{STRICT_VAR}=1 refuses groups and "
                          "transfers that would break between vendors' libraries, 0 allows them")
    return emulated if value == "" else value == "1"


def job_cluster(environ=os.environ):
    """The job's cluster file (None: none given or detected yet)."""
    from memx_launch.runtime.worker_env import cluster_path
    from memx_launch.specs.cluster import ClusterSpec

    path = cluster_path(environ)
    return ClusterSpec.from_yaml(path) if path else None


def init_distributed(plan=None, cluster=None, *, across_domains: bool = False) -> None:
    """Join the job's process group from torchrun's variables, under a per-generation key prefix:
    after an in-place restart the agent's store still holds the previous generation's keys. With a
    plan, this device takes its stage-major process rank (layout.process_rank). The job-wide group
    is native when every rank shares a domain and the bridge when they do not (``cluster``: the
    job's ClusterSpec, default its cluster file; ``across_domains``: cluster detection's job)."""
    from memx_launch.runtime.layout import process_rank
    from memx_launch.runtime.restarts import restart_generation

    if dist.is_initialized():
        return
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise ConfigError(exc.args[0], "not set", "start the script with memx-run or torchrun") from None
    cluster = job_cluster() if cluster is None else cluster
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store,
                          multi_tenant=not agent_store)
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # CPU stand-ins share the host's cores: oversubscribed threads make every rank crawl
        process = psutil.Process()
        cores = len(process.cpu_affinity()) if hasattr(process, "cpu_affinity") else psutil.cpu_count()
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    crosses = across_domains or (cluster is not None and cluster.crosses_domains)
    backend = bridge_backend(cluster) if crosses else NATIVE_BACKEND_BY_DEVICE[device.type]
    dist.init_process_group(backend, store=dist.PrefixStore(f"memx/generation{restart_generation()}", store),
                            rank=rank if plan is None else process_rank(plan, rank), world_size=world)


def new_group(ranks, backend: str) -> dist.ProcessGroup | None:
    """A group of ``ranks`` on ``backend``, or None on a rank outside it. Every rank of the job
    calls this for every group, in one order (torch numbers groups by creation), but only the
    members build the backend: a non-member names gloo, which every torch build has, so a group
    of another vendor's library is never built where that library does not exist."""
    member = dist.get_rank() in ranks
    group = dist.new_group(sorted(ranks), backend=backend if member else "gloo")
    return group if member else None


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclass
class _JobGroups:
    """The groups made during one process group's life: a runtime rebuilt in the same processes
    (a re-plan applied in place) reuses them instead of making each again."""

    world: object
    groups: dict = field(default_factory=dict)
    bridge_names: set = field(default_factory=set)


_registry: _JobGroups | None = None


def _job_groups() -> _JobGroups:
    global _registry
    if _registry is None or _registry.world is not dist.group.WORLD:
        _registry = _JobGroups(dist.group.WORLD)
    return _registry


class Communicator:
    """The groups of one rank. ``domains``: each process rank's communication domain."""

    def __init__(self, domains: list[str], device: torch.device, *, strict: bool = False, emulated=None,
                 bridge_backend: str = "gloo"):
        if len(domains) != dist.get_world_size():
            raise ConfigError("cluster", f"{len(domains)} ranks have a domain but the job has "
                              f"{dist.get_world_size()}", "launch one process per declared device")
        self.domains = domains
        self.rank = dist.get_rank()
        self.domain = domains[self.rank]
        self.strict = strict
        self.emulated = emulated
        self.traffic = BridgeTraffic()
        registry = _job_groups()
        self._groups = registry.groups
        self._bridge_names = registry.bridge_names
        self.crossing = len(set(domains)) > 1
        self.native_backend = NATIVE_BACKEND_BY_DEVICE[device.type]
        self.bridge_backend = dist.get_backend() if self.crossing else bridge_backend
        # Job-wide scalars travel as host tensors: over the default group when it is a bridge (the
        # job crosses domains) or carries host tensors, else over a host group made by every rank.
        if self.crossing or self.native_backend == "gloo":
            self.host_world = dist.group.WORLD
        else:
            if ("host", ()) not in self._groups:
                self._groups[("host", ())] = dist.new_group(backend=self.bridge_backend)
            self.host_world = self._groups[("host", ())]
        if self.host_world is not dist.group.WORLD or self.crossing:
            self._bridge_names.add(self.host_world.group_name)

    # ---- groups
    def spans_domains(self, ranks) -> bool:
        return len({self.domains[r] for r in ranks}) > 1

    def native(self, ranks) -> dist.ProcessGroup | None:
        """The native group of ``ranks`` (one domain); None on other ranks. Every rank calls it
        for every group, in one order (:func:`new_group`)."""
        ranks = tuple(sorted(ranks))
        if self.spans_domains(ranks):
            raise DomainViolation(f"native group {list(ranks)} spans domains "
                                  f"{sorted({self.domains[r] for r in ranks})}: its traffic must take the bridge")
        return self._group("native", ranks, self.native_backend)

    def bridge(self, ranks) -> dist.ProcessGroup | None:
        """A bridge group over ``ranks`` (host tensors only); None on other ranks."""
        group = self._group("bridge", tuple(sorted(ranks)), self.bridge_backend)
        if group is not None:
            self._bridge_names.add(group.group_name)
        return group

    def group(self, ranks) -> dist.ProcessGroup | None:
        """Native where ``ranks`` share a domain, else the bridge."""
        return self.bridge(ranks) if self.spans_domains(ranks) else self.native(ranks)

    def _group(self, kind: str, ranks: tuple[int, ...], backend: str) -> dist.ProcessGroup | None:
        key = (kind, ranks)
        if key not in self._groups:
            self._groups[key] = new_group(ranks, backend)
        return self._groups[key]

    def _made(self, kind: str, ranks) -> dist.ProcessGroup:
        try:
            return self._groups[(kind, tuple(sorted(ranks)))]
        except KeyError:  # made here by this rank alone, it would wait for the others forever
            raise RuntimeError(f"no {kind} group over {sorted(ranks)}: every rank calls "
                               "Communicator.prepare_all_reduce for it first") from None

    def is_bridge(self, group) -> bool:
        return group.group_name in self._bridge_names

    def prepare_all_reduce(self, ranks) -> None:
        """Create the groups :meth:`all_reduce_sum` over ``ranks`` uses; every rank calls it for
        every group it makes, in one order."""
        ranks = sorted(ranks)
        if len(ranks) < 2:
            return
        if not self.spans_domains(ranks):
            self.native(ranks)
            return
        by_domain = self._by_domain(ranks)
        for members in by_domain.values():
            if len(members) > 1:
                self.native(members)
        shards = len(next(iter(by_domain.values()))) if _equal_sizes(by_domain) else 1
        for index in range(shards):  # the ranks holding shard ``index`` (or the domains' first ranks)
            self.bridge([members[index] for members in by_domain.values()])

    def _by_domain(self, ranks) -> dict[str, list[int]]:
        by_domain: dict[str, list[int]] = {}
        for r in sorted(ranks):
            by_domain.setdefault(self.domains[r], []).append(r)
        return by_domain

    def verify_groups(self) -> None:
        """Strict mode: every process group of the job (memx's and any a library made) that is not
        a bridge lies in one domain."""
        if not self.strict:
            return
        from torch.distributed.distributed_c10d import _world

        for group, ranks in _world.pg_group_ranks.items():
            if not isinstance(group, dist.ProcessGroup):  # torch's marker of groups this rank is not in
                continue
            if group.group_name not in self._bridge_names and self.spans_domains(ranks.keys()):
                raise DomainViolation(f"group {group.group_name} over ranks {sorted(ranks)} spans domains "
                                      f"{sorted({self.domains[r] for r in ranks})} and is not a bridge")

    # ---- staging
    @contextmanager
    def on_host(self):
        """Work on host memory: outside the emulated device's guard (its tensors are device memory)."""
        with _disable_current_modes():
            yield

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` for the bridge (pinned when it comes from a GPU)."""
        start = time.perf_counter()
        host = self._host_like(tensor)
        with self.on_host():
            host.copy_(tensor.detach())
        self.traffic.staging_s += time.perf_counter() - start
        return host

    def unstage(self, host: torch.Tensor, into: torch.Tensor) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            into.copy_(host)
        self.traffic.staging_s += time.perf_counter() - start

    def send_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`stage` for a bridge send, counted as one message of its bytes sent."""
        host = self.stage(tensor)
        self.traffic.sent(host.numel() * host.element_size())
        return host

    def receive_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer that a bridge receive fills (then :meth:`unstage` into ``like``)."""
        return self._host_like(like)

    def _host_like(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``like`` (pinned for a GPU's)."""
        with self.on_host():
            return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.device.type == "cuda")

    # ---- collectives that may cross domains
    def all_reduce_sum(self, tensor: torch.Tensor, ranks) -> None:
        """Sum ``tensor`` (in place) over ``ranks``: natively in one domain, else hierarchically
        (the groups :meth:`prepare_all_reduce` made on every rank)."""
        ranks = sorted(ranks)
        if len(ranks) < 2:
            return
        if not self.spans_domains(ranks):
            dist.all_reduce(tensor, group=self._made("native", ranks))
            return
        by_domain = self._by_domain(ranks)
        mine = by_domain[self.domain]
        if _equal_sizes(by_domain) and tensor.numel() >= len(mine):
            self._all_reduce_sharded(tensor, mine, by_domain)
        else:
            self._all_reduce_by_leaders(tensor, mine, by_domain)

    def _all_reduce_sharded(self, tensor, mine, by_domain) -> None:
        # Reduce-scatter inside the domain, each shard summed across domains over the bridge by
        # the ranks that hold it, all-gather inside the domain: a rank sends 1/k of the tensor.
        k = len(mine)
        peers = [members[mine.index(self.rank)] for members in by_domain.values()]
        if k == 1:
            self._bridge_all_reduce(tensor, peers)
            return
        flat = tensor.reshape(-1)
        shard = -(-flat.numel() // k)
        padded = flat if flat.numel() == shard * k and flat.is_contiguous() else \
            torch.cat([flat, flat.new_zeros(shard * k - flat.numel())])
        piece = flat.new_empty(shard)
        native = self._made("native", mine)
        dist.reduce_scatter_tensor(piece, padded, group=native)
        self._bridge_all_reduce(piece, peers)
        dist.all_gather_into_tensor(padded, piece, group=native)
        if padded is not flat:
            with torch.no_grad():
                flat.copy_(padded[:flat.numel()])

    def _all_reduce_by_leaders(self, tensor, mine, by_domain) -> None:
        # Domains of different sizes: sum inside the domain, leaders sum across, leader broadcasts.
        native = self._made("native", mine) if len(mine) > 1 else None
        if native is not None:
            dist.all_reduce(tensor, group=native)
        if self.rank == mine[0]:
            self._bridge_all_reduce(tensor, [members[0] for members in by_domain.values()])
        if native is not None:
            dist.broadcast(tensor, src=mine[0], group=native)

    def _bridge_all_reduce(self, tensor: torch.Tensor, ranks: list[int]) -> None:
        host = self.stage(tensor)
        self.traffic.sent(2 * (len(ranks) - 1) / len(ranks) * host.numel() * host.element_size())
        start = time.perf_counter()
        dist.all_reduce(host, group=self._made("bridge", ranks))
        self.traffic.collective_s += time.perf_counter() - start
        self.unstage(host, tensor)

    def all_reduce_mean(self, tensors: list[torch.Tensor], ranks) -> None:
        """Average ``tensors`` (in place) over ``ranks`` in flat buckets of up to BUCKET_BYTES: the
        gradient sync of a stage whose DP replicas span domains. A bucket bounds both the
        messages (one per bucket, not per tensor) and the memory on top of the gradients."""
        self._all_reduce_buckets(tensors, ranks, mean=True)

    def all_reduce_sums(self, tensors: list[torch.Tensor], ranks) -> None:
        """Sum ``tensors`` (in place) over ``ranks``, in buckets as :meth:`all_reduce_mean`."""
        self._all_reduce_buckets(tensors, ranks, mean=False)

    def _all_reduce_buckets(self, tensors: list[torch.Tensor], ranks, mean: bool) -> None:
        if len(ranks) < 2:
            return
        bucket: list[torch.Tensor] = []
        for i, t in enumerate(tensors):
            bucket.append(t)
            if sum(b.numel() * b.element_size() for b in bucket) >= BUCKET_BYTES or i == len(tensors) - 1:
                self._all_reduce_bucket(bucket, ranks, mean)
                bucket = []

    def _all_reduce_bucket(self, tensors: list[torch.Tensor], ranks, mean: bool) -> None:
        flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce_sum(flat, ranks)
        if mean:
            flat /= len(ranks)
        if len(tensors) > 1:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def sum_over_job(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank, as a host copy (job-wide scalars such as a norm)."""
        with self.on_host():
            host = value.detach().to("cpu", copy=True)
        dist.all_reduce(host, group=self.host_world)
        return host

    def ddp_comm_hook(self, state, bucket):  # unannotated: DDP checks the annotation as an object
        """DDP's gradient all-reduce (``register_comm_hook``) in a job that crosses domains: the
        bucket averaged over every rank, natively inside each domain and over the bridge between
        (:meth:`prepare_all_reduce` over the whole job first, on every rank)."""
        tensor = bucket.buffer()
        self.all_reduce_sum(tensor, range(dist.get_world_size()))
        tensor /= dist.get_world_size()
        future = torch.futures.Future()
        future.set_result(tensor)
        return future

    def all_gather_host(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's host tensor ``row`` (job-wide scalars)."""
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row, group=self.host_world)
        return rows

    def strict_check(self) -> "StrictBridgeCheck | None":
        return StrictBridgeCheck(self) if self.strict else None


class StrictBridgeCheck(TorchDispatchMode):
    """Sees every c10d operator: one on a bridge group must carry host tensors only."""

    def __init__(self, communicator: Communicator):
        super().__init__()
        self.communicator = communicator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.check(func, args)
        return func(*args, **(kwargs or {}))

    def check(self, func, args) -> None:
        """Raise DomainViolation if operator ``func`` would carry a device tensor over the bridge."""
        if func.namespace == "c10d" and any(self.communicator.is_bridge(group) for group in _process_groups(args)):
            for t in tensors_in(args):
                if self._device_tensor(t):
                    raise DomainViolation(f"{func} sends a device tensor {tuple(t.shape)} over the bridge "
                                          "unstaged (Communicator.stage copies it to host first)")

    def _device_tensor(self, t: torch.Tensor) -> bool:
        emulated = self.communicator.emulated
        return t.device.type != "cpu" or (emulated is not None and emulated.holds(t))


def _process_groups(args):
    """The process groups among a c10d operator's arguments (torch passes them as script objects)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                yield dist.ProcessGroup.unbox(arg)
            except RuntimeError:  # another kind of script object (a reduce op)
                continue


def _equal_sizes(by_domain: dict) -> bool:
    """Whether every domain holds as many of the ranks: then each sums one shard across domains."""
    return len({len(members) for members in by_domain.values()}) == 1
