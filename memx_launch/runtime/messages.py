"""Rank-to-rank messages as tensors of JSON bytes: nothing received is unpickled.

torch's object collectives (all_gather_object, broadcast_object_list, gather_object,
send_object_list, recv_object_list) pickle their payload over the job's unauthenticated TCP store and network; a peer that can reach them
could run code in every rank. These helpers send ``json.dumps(value)`` as uint8 tensors instead
(lengths first, then the bytes padded to the longest), so a message is at most data.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from memx_launch.errors import ConfigError

MAX_MESSAGE_BYTES = 256 * 2**20
"""A larger message is refused on the receiving side before its buffer is allocated."""


def _device(group) -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(value).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _checked_length(n: int, sender: int) -> int:
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise ConfigError("rank message", f"rank {sender} announced {n} bytes (limit {MAX_MESSAGE_BYTES})",
                          "check that every rank runs the same memx version")
    return n


def _decode(buffer: torch.Tensor, length: int, sender: int) -> Any:
    try:
        return json.loads(bytes(buffer[:length].cpu().numpy()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError("rank message", f"rank {sender} sent something that is not JSON",
                          "check that every rank runs the same memx version") from None


def _lengths(length: int, device, group) -> list[int]:
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [_checked_length(int(t.item()), rank) for rank, t in enumerate(everyone)]


def all_gather_json(value: Any, group=None) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in group rank order, on every rank; a single
    process without a process group is the only rank."""
    if not dist.is_initialized():
        return [value]
    device = _device(group)
    data = _encode(value, device)
    lengths = _lengths(data.numel(), device, group)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(out, padded, group=group)
    return [_decode(buf, n, r) for r, (buf, n) in enumerate(zip(out, lengths))]


def broadcast_json(value: Any, src: int = 0, group=None) -> Any:
    """``value`` of rank ``src`` (a global rank) on every rank; other ranks pass None."""
    device = _device(group)
    data = _encode(value if dist.get_rank() == src else None, device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    n = _checked_length(int(length.item()), src)
    buffer = data if dist.get_rank() == src else torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return _decode(buffer, n, src)


def send_json(value: Any, dst: int, group=None, device: torch.device | None = None) -> None:
    """``value`` to the one rank ``dst`` (a global rank): its length, then its bytes. ``device``:
    where the group carries tensors (default: the group's backend decides)."""
    device = device or _device(group)
    data = _encode(value, device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst=dst, group=group)
    dist.send(data, dst=dst, group=group)


def recv_json(src: int, group=None, device: torch.device | None = None) -> Any:
    """What :func:`send_json` on rank ``src`` (a global rank) sent to this rank."""
    device = device or _device(group)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src, group=group)
    n = _checked_length(int(length.item()), src)
    buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.recv(buffer, src=src, group=group)
    return _decode(buffer, n, src)
