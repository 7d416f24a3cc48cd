"""In-job calibration: the ranks of each device type measure its minimal sample set together.

Samples with TP = 1 are shared round-robin over the type's ranks; samples with TP = t run on
subgroups of t ranks of that type inside one node (DTensor tensor parallel, as the runtime
would run them). Each sample is appended to the ProfileDB by the rank that measured it as soon
as it is measured, so a rank that dies mid-way loses nothing already stored: after the
elastic restart those samples are read back instead of measured again. Before results are
exchanged, every rank reports through the job's store; a rank that has not reported within
the timeout is named, with its device, in the error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from memx_launch.errors import ConfigError, MemxError
from memx_launch.runtime.faults import Faults
from memx_launch.runtime.messages import all_gather_json
from memx_launch.profiling.profiledb import Measurement, ProfileDB
from memx_launch.profiling.space import ProfileSpace, Sample, default_space
from memx_launch.profiling.kernel import calibrate, record_run_options
from memx_launch.profiling.design import minimal_sample_set
from memx_launch.planning.costmodel import layer_forward_flops
from memx_launch.planning.layouts import tp_degrees
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.inputs import positive_seconds
from memx_launch.specs.model import ModelSpec

CALIBRATION_BUDGET = 20
CALIBRATION_REPEATS = 3
DEFAULT_CALIBRATION_BUDGET_S = 600.0  # per device type
DEFAULT_TIMEOUT_S = 600.0
# Fewer samples than this cannot fit the predictor's time and memory lines.
MIN_CALIBRATION_SAMPLES = 3
# Steps of one sample (warm-up, timed repeats, the memory pass), each a forward and a backward
# (twice the forward), plus the forward again where the block recomputes.
STEPS_PER_SAMPLE = 1 + CALIBRATION_REPEATS + 1
RECOMPUTE_FORWARDS = {"none": 0.0, "selective": 0.25, "full": 1.0}
# A whole transformer block (norms, attention, element-wise ops around its matmuls) reaches about
# this share of a large matmul's measured rate: a cautious figure for the time estimate, so a
# budget that looks enough is.
BLOCK_EFFICIENCY = 0.45


class CalibrationTimeout(MemxError):
    """A rank did not report its calibration samples in time."""


@dataclass
class TypeGroups:
    """Process groups of one device type: all its ranks, and its TP subgroups per degree."""

    ranks: list[int]
    group: object
    tp_groups: dict[int, list[tuple[object, list[int]]]] = field(default_factory=dict)
    """tp -> [(group or None for tp=1, ranks)], the measuring units for that degree."""


def make_groups(cluster: ClusterSpec, model: ModelSpec) -> dict[str, TypeGroups]:
    """Every rank creates every group in the same order, natively (a device type is one
    communication domain; runtime/communication.py builds each only on its members)."""
    from memx_launch.runtime.communication import NATIVE_BACKEND_BY_DEVICE, local_device, new_group

    rank_types = cluster.rank_device_types()
    locations = cluster.rank_locations()
    native = NATIVE_BACKEND_BY_DEVICE[local_device().type]
    out = {}
    for name in sorted(set(rank_types)):
        ranks = [r for r, t in enumerate(rank_types) if t == name]
        groups = TypeGroups(ranks, new_group(ranks, native))
        groups.tp_groups[1] = [(None, [r]) for r in ranks]
        for tp in tp_degrees(model, cluster)[1:]:  # only the degrees the search can choose
            units = []
            for node in sorted({locations[r][0] for r in ranks}):
                local = [r for r in ranks if locations[r][0] == node]
                for i in range(0, len(local) - tp + 1, tp):
                    units.append((new_group(local[i:i + tp], native), local[i:i + tp]))
            if units:
                groups.tp_groups[tp] = units
        out[name] = groups
    return out


def sample_key(device_type: str, model: ModelSpec, s: Sample, dtype: str, selective_policy: str = "attention",
               run_options: dict | None = None) -> tuple:
    return (device_type, model.signature(), s.tp, s.micro_batch_size, s.seq_len, s.recompute, s.num_kv_heads, dtype,
            json.dumps(record_run_options(s.recompute, selective_policy, run_options), sort_keys=True))


def measurement_key(m: Measurement) -> tuple:
    """As :func:`sample_key`: a selective record of one policy is never reused for the other."""
    return (m.device_type, m.model_signature, m.tp, m.micro_batch_size, m.seq_len, m.recompute,
            m.block_shape["num_kv_heads"], m.dtype, json.dumps(m.run_options, sort_keys=True))


class TypeCalibration:
    """One rank's part in calibrating its device type."""

    def __init__(self, model: ModelSpec, device_type: DeviceType, groups: TypeGroups, db: ProfileDB,
                 stored: list[Measurement], *, device: str, dtype: str, slowdown: float | None, tp_link,
                 describe_rank, faults: Faults, timeout_s: float = DEFAULT_TIMEOUT_S, log=print, user_parts=None,
                 selective_policy: str = "attention", run_options: dict | None = None):
        """``user_parts``: the model (models/adapters.py's ModelParts) whose own block is measured
        instead of memx's, split by TP where its kind has a plan; ``selective_policy``: the plan's
        (TrainingSpec.selective_recompute); ``run_options``: how the blocks run, as their records
        say (default profiling/kernel.py's CALIBRATED_AS; a user's block: as it runs, models/block_reading.py)."""
        self.model, self.device_type, self.groups, self.db = model, device_type, groups, db
        self.device, self.dtype, self.slowdown, self.tp_link = device, dtype, slowdown, tp_link
        self.describe_rank, self.faults, self.timeout_s, self.log = describe_rank, faults, timeout_s, log
        self.user_parts, self.selective_policy, self.run_options = user_parts, selective_policy, run_options
        self.stored = {measurement_key(m): m for m in stored}
        self.host_lock = os.path.join(tempfile.gettempdir(),
                                      f"memx-calibration-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}.lock")
        self.reused = 0
        self.done = 0
        self.budget, self.estimate_s, self.started = CALIBRATION_BUDGET, None, time.monotonic()
        self.measured_here = 0
        self._round = 0

    def run(self, tp_degrees: list[int], budget: int = CALIBRATION_BUDGET,
            seconds_per_sample: float | None = None) -> list[Measurement]:
        """Measure up to ``budget`` samples; ``seconds_per_sample`` (the estimate) starts the
        progress lines' time left until measured times replace it."""
        space = calibration_space(self.model, [d for d in tp_degrees if d in self.groups.tp_groups],
                                  own_kv_heads=self.user_parts is not None)
        self.budget, self.estimate_s = budget, seconds_per_sample
        self.started = time.monotonic()
        if dist.get_rank() == self.groups.ranks[0]:
            guess = f", about {budget * seconds_per_sample:.0f} s estimated" if seconds_per_sample else ""
            self.log(f"calibrating {self.device_type.name} on ranks {self.groups.ranks}: up to {budget} samples{guess}")
        result = minimal_sample_set(space, self.measure, budget=budget)
        if dist.get_rank() == self.groups.ranks[0]:
            self.log(f"calibrated {self.device_type.name} on ranks {self.groups.ranks}: "
                     f"{result.measured_count} samples ({self.reused} reused from the profile)\n{result.summary()}")
        return result.measurements

    def measure(self, samples: list[Sample]) -> list[Measurement]:
        """Every rank of the type gets every measurement, in the order of ``samples``."""
        self._round += 1
        me = dist.get_rank()
        todo = [s for s in dict.fromkeys(samples) if self._key(s) not in self.stored]
        mine: list[Measurement] = []
        for tp in sorted({s.tp for s in todo}):
            units = self.groups.tp_groups[tp]
            part = [s for s in todo if s.tp == tp]
            for j, (group, ranks) in enumerate(units):
                if me in ranks:
                    measured = self._measure_unit(part[j::len(units)], group)
                    if me == ranks[0]:  # one record per sample, from the unit's first rank
                        mine += measured
        self._report_and_wait()
        gathered = all_gather_json([m.to_json() for m in mine], group=self.groups.group)
        for part in gathered:
            for line in part:
                m = Measurement.from_dict(json.loads(line))
                self.stored[measurement_key(m)] = m
        self.reused += len(samples) - len(todo)
        self.done += len(todo)
        if todo and dist.get_rank() == self.groups.ranks[0]:
            self.log(self.progress_line())
        return [self.stored[self._key(s)] for s in samples]

    def progress_line(self) -> str:
        """Samples measured of the budget, elapsed, and what is left at the rate so far."""
        elapsed = time.monotonic() - self.started
        rate = elapsed / self.done if self.done else self.estimate_s
        left = max(0, self.budget - self.done - self.reused)
        eta = f", about {left * rate:.0f} s left" if rate is not None and left else ""
        return (f"calibrating {self.device_type.name}: {self.done + self.reused} of at most {self.budget} samples "
                f"({self.reused} reused), {elapsed:.0f} s elapsed{eta}")

    def _measure_unit(self, samples: list[Sample], group) -> list[Measurement]:
        out = []
        leader = group is None or dist.get_rank() == dist.get_process_group_ranks(group)[0]
        for s in samples:
            if group is not None:
                dist.barrier(group=group)  # the whole unit is here before its leader takes the host
            with self._host_turn(leader):
                [m] = calibrate(self.model, self.device_type, [s], device=self.device, tp_group=group,
                                dtype=self.dtype, num_blocks=1, repeats=CALIBRATION_REPEATS,
                                emulation_slowdown=self.slowdown, selective_policy=self.selective_policy,
                                run_options=self.run_options,
                                **self._user_block(),
                                tp_link=self.tp_link(s.tp) if s.tp > 1 else None)
            out.append(m)
            if leader:  # stored at once: a rank that dies later loses nothing measured
                self.db.append([m])
                self.measured_here += 1
                if self.faults.kill_calibration is not None:
                    self.faults.kill_calibration.after_sample(dist.get_rank(), self.measured_here)
        return out

    def _user_block(self) -> dict:
        """calibrate's arguments that measure the user's own block instead of memx's."""
        parts = self.user_parts
        if parts is None:
            return {}
        return dict(block_factory=parts.block_probe,
                    block_tensor_parallel=parts.apply_tensor_parallel if parts.tensor_parallel else None)

    @contextlib.contextmanager
    def _host_turn(self, leader: bool):
        """Emulated devices are processes sharing the host's cores: one measuring unit at a
        time, or each rank's timing would include the others' work. Real devices measure at once."""
        if self.device != "cpu" or not leader:
            yield
            return
        fd = os.open(self.host_lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _report_and_wait(self) -> None:
        """Each rank marks this round done; a rank missing at the deadline is named."""
        # NOTE: the default group's store is the job's (per-generation) store; collectives
        # would only hang, while the store lets us say which rank is missing.
        store = dist.distributed_c10d._get_default_store()
        prefix = f"memx/calibration/{self.device_type.name}/round{self._round}/"
        store.set(prefix + str(dist.get_rank()), "done")
        deadline = time.monotonic() + self.timeout_s
        for rank in self.groups.ranks:
            key = prefix + str(rank)
            while not store.check([key]):
                if time.monotonic() > deadline:
                    raise CalibrationTimeout(
                        f"calibration: rank {rank} ({self.describe_rank(rank)}) did not report within "
                        f"{self.timeout_s:.0f} s; check that process's output, or raise MEMX_CALIBRATION_TIMEOUT_S")
                time.sleep(0.05)

    def _key(self, s: Sample) -> tuple:
        return sample_key(self.device_type.name, self.model, s, self.dtype, self.selective_policy, self.run_options)


def calibration_timeout_s(environ=os.environ) -> float:
    return positive_seconds(environ, "MEMX_CALIBRATION_TIMEOUT_S", DEFAULT_TIMEOUT_S, "MEMX_CALIBRATION_TIMEOUT_S",
                            f"MEMX_CALIBRATION_TIMEOUT_S={DEFAULT_TIMEOUT_S:g}")


def calibration_space(model: ModelSpec, tp_degrees: list[int], own_kv_heads: bool = False):
    """What the job calibrates: micro-batches up to 4, half and full sequence, every recompute level.
    ``own_kv_heads``: the model's KV heads only (a user's block is built with its own, whatever a
    sample's count)."""
    space = default_space(model, tp_degrees=tuple(tp_degrees), max_micro_batch=4,
                          seq_lens=(max(16, model.seq_len // 2), model.seq_len))
    if not own_kv_heads:
        return space
    return ProfileSpace({**space.values, "num_kv_heads": (model.num_kv_heads,)},
                        replace(space.default, num_kv_heads=model.num_kv_heads))


def seconds_per_sample(model: ModelSpec, tp_degrees: list[int], tflops: float, slowdown: float = 1.0) -> float:
    """Estimated seconds to measure one sample, averaged over the calibration space: the block's
    analytical FLOPs at ``tflops`` (a large matmul's rate on the device) x BLOCK_EFFICIENCY."""
    space = calibration_space(model, tp_degrees)
    values = space.values
    forwards = [2.0 + 1.0 + RECOMPUTE_FORWARDS[r] for r in values["recompute"]]  # fwd + bwd (2 fwd) + recompute
    flops = [float(layer_forward_flops(model, m, q, t)) * f for m in values["micro_batch_size"]
             for q in values["seq_len"] for t in values["tp"] for f in forwards]
    return STEPS_PER_SAMPLE * sum(flops) / len(flops) / (tflops * 1e12 * BLOCK_EFFICIENCY) * slowdown


def sample_budget(model: ModelSpec, device_type: str, per_sample_s: float, budget_s: float) -> int:
    """Samples that fit ``budget_s``: at most CALIBRATION_BUDGET; a device too slow for
    MIN_CALIBRATION_SAMPLES is refused with what to do instead."""
    fits = int(budget_s // per_sample_s) if per_sample_s > 0 else CALIBRATION_BUDGET
    if fits < MIN_CALIBRATION_SAMPLES:
        raise ConfigError(
            "--calibration-budget-s", f"calibrating {model.name} on {device_type} takes about {per_sample_s:.0f} s a "
            f"sample, {MIN_CALIBRATION_SAMPLES * per_sample_s:.0f} s for the fewest samples, over the budget of "
            f"{budget_s:.0f} s", "use a smaller --model, a profile DB measured on the GPUs (memx profile there, "
            "then --profile-db FILE), --dry-run to plan with the analytical model, or a larger --calibration-budget-s")
    return min(CALIBRATION_BUDGET, fits)


def calibration_budget_s(environ=os.environ) -> float:
    return positive_seconds(environ, "MEMX_CALIBRATION_BUDGET_S", DEFAULT_CALIBRATION_BUDGET_S,
                            "--calibration-budget-s", f"--calibration-budget-s {DEFAULT_CALIBRATION_BUDGET_S:g}")


BRIDGE_PROBE_BYTES = (4096, 4 * 2**20)
BRIDGE_PROBE_REPEATS = 5


def measure_bridges(domains: list[str]) -> list[tuple[tuple[str, str], tuple[int, int], int, float]]:
    """Ping-pong host buffers between the first ranks of each pair of domains over the default
    group (the bridge in a job that crosses domains): (domains, ranks, bytes, one-way seconds,
    the median of the repeats) per pair and size, on every rank. Every rank takes part in the
    same order; the others wait at a barrier."""
    firsts: dict[str, int] = {}
    for rank, domain in enumerate(domains):
        firsts.setdefault(domain, rank)
    me = dist.get_rank()
    results = []
    pairs = [(a, b) for i, a in enumerate(sorted(firsts)) for b in sorted(firsts)[i + 1:]]
    for a, b in pairs:
        ra, rb = firsts[a], firsts[b]
        for nbytes in BRIDGE_PROBE_BYTES:
            buffer = torch.zeros(nbytes, dtype=torch.uint8)
            times = []
            for _ in range(BRIDGE_PROBE_REPEATS if me in (ra, rb) else 0):
                start = time.perf_counter()
                if me == ra:
                    dist.send(buffer, rb)
                    dist.recv(buffer, rb)
                else:
                    dist.recv(buffer, ra)
                    dist.send(buffer, ra)
                times.append((time.perf_counter() - start) / 2)
            seconds = torch.tensor([sorted(times)[len(times) // 2] if times else 0.0], dtype=torch.float64)
            dist.broadcast(seconds, src=ra)
            results.append(((a, b), (ra, rb), nbytes, seconds.item()))
    return results
