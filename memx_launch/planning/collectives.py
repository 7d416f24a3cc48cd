"""Collectives as NCCL runs them: ring and tree algorithms, three protocols, per-step latency
by hop (NVLink, PCIe, network) and the cheapest choice per message. No torch import.

NCCL times each (algorithm, protocol) pair with a latency-bandwidth model and runs the fastest
(``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime`` in ``src/graph/tuning.cc``, NVIDIA/nccl,
commit 01afd20); memx uses the same model with the same constants:

- ring: 2(n-1) steps for an all-reduce, n-1 for a reduce-scatter or all-gather; of them
  2(nodes-1) (nodes-1) cross the network, the others a link inside a node; each step pays that
  hop's latency. The bytes move at the bus bandwidth: time = latency + S (steps / n) / busbw.
- tree (all-reduce only): a reduce up and a broadcast down, 2((n/nodes - 1) intra + log2(nodes)
  inter) hops of latency, at half of 0.9 x the bus bandwidth (S / (0.45 busbw)).
- protocols: LL (8-byte stores with a flag: the lowest latency, a quarter of the bandwidth), LL128
  (128-byte lines: 92% of it, on NVLink only) and Simple (the whole bandwidth, the highest
  latency, 1.9 x on multi-node ring all-reduces of large buffers: the ring's plateau).

Small messages are latency bound and reach a small share of the bus bandwidth; large groups pay
many steps: both are what makes data parallelism and ZeRO-3 slower per byte as they grow.
The bus bandwidth is what the links give (a group's slowest link, a node's share of its NICs:
``ClusterSpec.group_gbps``, at the cluster's link_efficiency).
"""

from __future__ import annotations

import functools
import math

import numpy as np

# Hop kinds, NCCL's NCCL_HW_*.
NVLINK, PCI, NET = 0, 1, 2
LL, LL128, SIMPLE = 0, 1, 2
# Microseconds (tuning.cc): base latency per algorithm and protocol (LL, LL128, Simple), and the
# latency of one step over each kind of hop.
_BASE_US = {"ring": (3.6, 10.0, 8.4), "tree": (4.4, 4.4, 0.0)}
_HOP_US = {"ring": {NVLINK: (0.47, 1.9, 3.4), PCI: (1.0, 2.5, 5.7), NET: (2.7, 4.0, 9.6)},
           "tree": {NVLINK: (0.52, 1.2, 28.0), PCI: (1.0, 1.9, 28.0), NET: (5.0, 8.5, 50.0)}}
# Share of the bus bandwidth each protocol carries: LL sends a 4-byte flag with every 4 bytes and
# waits on it (1/4 in all-reduces and across nodes, else 1/3); LL128 sends 120 of 128 bytes.
_LL_SHARE_ALLREDUCE, _LL_SHARE_OTHER = 1.0 / 4.0, 1.0 / 3.0
_LL128_SHARE, _LL128_SHARE_ONE_PER_NODE = 0.92, 0.7
_TREE_SHARE = 0.9
_TREE_LL_SHARE = 1.0 / 3.8
_RING_PLATEAU = 1.9

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# Thread blocks (one per channel, each on an SM) an NCCL collective holds while it runs: 24 for
# an all-gather on H100s over NVLink, which made a GEMM running beside it nearly twice as slow
# (an nsys trace: forums.developer.nvidia.com/t/337991). The compute beside it runs on the rest.
COLLECTIVE_CTAS = 24


def collective_seconds(op: str, nbytes, ranks, busbw_gbps, nodes=1, intra_hop=NVLINK) -> np.ndarray:
    """Seconds of one NCCL collective over ``ranks`` ranks on ``nodes`` nodes (arrays broadcast):
    the fastest (algorithm, protocol) pair. ``nbytes``: the whole buffer (an all-gather's output,
    a reduce-scatter's input); ``busbw_gbps``: the bus bandwidth the links give (GB/s, per
    direction); ``intra_hop``: NVLINK or PCI, the hop between ranks of one node. One rank: 0."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    group = [np.asarray(x, dtype=np.float64) for x in (ranks, nodes, busbw_gbps, intra_hop)]
    group_shape = np.broadcast(*group).shape
    nbytes = np.asarray(nbytes, dtype=np.float64)
    shape = np.broadcast(nbytes, np.empty(group_shape)).shape
    if not math.prod(group_shape):  # no elements
        return np.zeros(shape)
    # Few distinct groups (a stage's, a device type's): each group's candidates are built once,
    # then every element takes its group's row of them and the fastest is one vectorised min.
    keys = np.empty((len(group), *group_shape))
    for i, values in enumerate(group):
        keys[i] = values
    # A layout's few stages (memx estimate's rows) repeat whole: their table is looked up at once.
    table = (_group_rows(op, keys.tobytes()) if keys[0].size <= _CACHED_GROUP_SIZE
             else _gather_rows(op, keys.reshape(len(group), -1)))
    latency, per_byte, plateau = (part.reshape(*group_shape, _CANDIDATES) for part in table)
    nbytes = nbytes[..., None]
    latency = np.where(nbytes >= plateau, latency * _RING_PLATEAU, latency)
    return np.where(nbytes[..., 0] > 0, (latency + per_byte * nbytes).min(axis=-1), 0.0)


# Candidates per group: up to three ring protocols and three tree ones.
_CANDIDATES = 6
# Groups of up to this many elements have their whole table cached.
_CACHED_GROUP_SIZE = 64


def _gather_rows(op, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(latency, seconds per byte, plateau bytes) of each element's group, one row of
    ``_CANDIDATES`` per column of ``keys`` (4, elements: ranks, nodes, bus bandwidth, hop)."""
    index: dict = {}
    columns = list(zip(*keys.tolist()))
    code = np.fromiter((index.setdefault(key, len(index)) for key in columns), dtype=np.int64, count=len(columns))
    table = [_candidates(op, *key) for key in index]
    return tuple(np.stack([rows[i] for rows in table])[code] for i in range(3))


@functools.lru_cache(maxsize=4096)
def _group_rows(op, keys: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_gather_rows` of a small group (its keys' float64 bytes), kept: its callers never
    write to the arrays."""
    return _gather_rows(op, np.frombuffer(keys).reshape(4, -1))


@functools.lru_cache(maxsize=65536)
def _candidates(op, n, nodes, busbw_gbps, hop) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``_CANDIDATES`` of one group, one entry per enabled (algorithm, protocol) pair:
    latency (s), seconds per byte and the bytes from which the ring plateau applies (inf: never).
    Unused entries are never the fastest; a group of one rank costs nothing."""
    if n <= 1:
        return np.zeros(_CANDIDATES), np.zeros(_CANDIDATES), np.full(_CANDIDATES, np.inf)
    nodes = min(max(nodes, 1.0), n)
    busbw = min(busbw_gbps, 1e18) * 1e9  # an unbounded link (ranks of one device) stays finite
    per_node, multi_node = n / nodes, nodes > 1
    if op == "all_reduce":
        steps, inter = 2.0 * (n - 1), 2.0 * (nodes - 1)
    else:  # reduce-scatter, all-gather; a broadcast pipelines every hop once
        steps, inter = n - 1, nodes - 1
    moved = 1.0 if op == "broadcast" else steps / n
    latency, per_byte, plateau = [], [], np.full(_CANDIDATES, np.inf)
    for proto in (LL, LL128, SIMPLE):
        if proto == LL:
            share = _LL_SHARE_ALLREDUCE if multi_node or op == "all_reduce" else _LL_SHARE_OTHER
        elif proto == LL128:  # NCCL enables LL128 over NVLink only
            share = (_LL128_SHARE_ONE_PER_NODE if per_node < 2 else _LL128_SHARE) if hop == NVLINK else 0.0
        else:
            share = 1.0
        if share > 0:
            intra_us = _HOP_US["ring"][hop][proto] * (1.8 if multi_node and proto == LL else 1.0)
            latency.append((_BASE_US["ring"][proto] + (steps - inter) * intra_us
                            + inter * _HOP_US["ring"][NET][proto]) * 1e-6)
            per_byte.append(moved / (busbw * share))
            if op == "all_reduce" and proto == SIMPLE and multi_node:
                plateau[len(latency) - 1] = n / 16.0 * 65536
        if op == "all_reduce":
            tree = _TREE_SHARE * (_TREE_LL_SHARE if proto == LL else 1.0)
            if proto == LL128:
                tree = _TREE_SHARE * (0.915 if multi_node else 7.0 / 9.0) if hop == NVLINK else 0.0
            if tree > 0:
                latency.append((_BASE_US["tree"][proto] + 2.0 * ((per_node - 1) * _HOP_US["tree"][hop][proto]
                                                                 + math.log2(nodes) * _HOP_US["tree"][NET][proto]))
                               * 1e-6)
                per_byte.append(1.0 / (busbw * tree * 0.5))
    unused = _CANDIDATES - len(latency)
    return np.array(latency + [np.inf] * unused), np.array(per_byte + [0.0] * unused), plateau


def summed_seconds(op: str, sizes, ranks, busbw_gbps, nodes=1, intra_hop=NVLINK, counts=None) -> np.ndarray:
    """Seconds of several collectives over one group, ``sizes`` bytes each (numpy-broadcast), summed,
    each taken ``counts`` times (once by default): priced in one call, each paying its own latency."""
    shape = np.broadcast(*sizes, ranks, busbw_gbps, nodes, intra_hop).shape
    stacked = np.empty((len(sizes), *shape))  # each collective shaped as the result
    for i, size in enumerate(sizes):
        stacked[i] = size
    seconds = collective_seconds(op, stacked, ranks, busbw_gbps, nodes, intra_hop)
    return sum(seconds[i] if counts is None else counts[i] * seconds[i] for i in range(len(sizes)))


def bucketed_seconds(op: str, total_bytes, bucket_bytes, ranks, busbw_gbps, nodes=1, intra_hop=NVLINK) -> np.ndarray:
    """``total_bytes`` synced as buckets of ``bucket_bytes`` (the last one partial), each its own
    collective that pays its own latency: how DDP, Megatron and ZeRO reduce gradients."""
    total = np.asarray(total_bytes, dtype=np.float64)
    bucket = np.minimum(np.asarray(bucket_bytes, dtype=np.float64), np.maximum(total, 1.0))
    full = np.floor(total / bucket)
    return summed_seconds(op, (bucket, total - full * bucket), ranks, busbw_gbps, nodes, intra_hop, (full, 1.0))


def collective_sm_share(sms) -> np.ndarray:
    """Share of a device's ``sms`` streaming multiprocessors a collective holds while compute runs
    beside it (:data:`COLLECTIVE_CTAS`); 0 for a CPU or a stand-in (``sms`` 0: no SMs to share)."""
    sms = np.asarray(sms, dtype=np.float64)
    return np.where(sms > 0, np.minimum(COLLECTIVE_CTAS / np.maximum(sms, 1.0), 1.0), 0.0)


def overlapped_exposed_seconds(comm, compute, sm_share) -> np.ndarray:
    """Seconds collectives of ``comm`` seconds add to the ``compute`` seconds they run beside:
    what exceeds the compute, or what the compute loses while they hold ``sm_share`` of the SMs,
    whichever is more."""
    comm, compute = np.asarray(comm, dtype=np.float64), np.asarray(compute, dtype=np.float64)
    return np.maximum(comm - compute, np.asarray(sm_share) * np.minimum(comm, compute))
