"""A model of PyTorch's CUDA caching allocator, to replay an allocation trace against a device's
memory: how much it reserves beyond what is allocated, and whether it runs out.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` with its defaults (no
``max_split_size_mb``, no expandable segments, one stream):
- a request is rounded up to 512 bytes; up to 1 MiB it is served from the small pool, whose
  segments are 2 MiB; larger ones from the large pool, whose segments are 20 MiB for requests
  under 10 MiB and the request rounded up to 2 MiB otherwise;
- a request takes the smallest cached free block of its pool that holds it (the lowest address
  among equals) and splits off the rest when more than 1 MiB is left (large pool) or at least
  512 bytes (small pool);
- a freed block merges with free neighbours of its segment and stays cached;
- when a new segment would exceed the device, every wholly free cached segment is released
  (``release_cached_blocks``) and the segment is tried once more; then the request runs out of
  memory.
"""

from __future__ import annotations

import bisect

MIB = 1 << 20
SMALL_REQUEST = 1 * MIB
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB
MIN_BLOCK = 512


class OutOfMemory(Exception):
    pass


class Block:
    __slots__ = ("segment", "address", "size", "free", "prev", "next", "small")

    def __init__(self, segment: int, address: int, size: int, small: bool):
        self.segment, self.address, self.size, self.small = segment, address, size, small
        self.free, self.prev, self.next = True, None, None


def segment_size(size: int) -> int:
    """Bytes of the segment a request of ``size`` (rounded) opens when no cached block holds it."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def _join(first: Block, second: Block) -> Block:
    """``second``, the block after ``first`` in their segment, merged into ``first``."""
    first.size += second.size
    first.next = second.next
    if second.next is not None:
        second.next.prev = first
    return first


class CachingAllocator:
    """Allocations by handle against ``limit_bytes`` of device memory (what the process can
    reserve: the device less its context and what NCCL allocates outside the allocator)."""

    def __init__(self, limit_bytes: float):
        self.limit = limit_bytes
        self._free = {True: [], False: []}  # per pool (small?): sorted (size, address) of free blocks
        self._blocks = {}                    # (small, size, address) -> free block
        self._segments = {}                  # segment -> (bytes, its first block)
        self._idle = set()                   # segments whose one block is free
        self._live = {}
        self._next_address = self._next_segment = 0
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0

    def _cache(self, block: Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address))
        self._blocks[(block.small, block.size, block.address)] = block

    def _uncache(self, block: Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]
        del self._blocks[(block.small, block.size, block.address)]

    def _release_cached_segments(self) -> None:
        for segment in self._idle:
            size, first = self._segments.pop(segment)
            self._uncache(first)
            self.reserved -= size
        self._idle.clear()

    def _new_segment(self, size: int, small: bool) -> Block:
        seg = segment_size(size)
        if self.reserved + seg > self.limit:
            self._release_cached_segments()
            if self.reserved + seg > self.limit:
                raise OutOfMemory(f"{size / MIB:.0f} MiB asked with {self.reserved / 2**30:.1f} GiB reserved "
                                  f"and {self.allocated / 2**30:.1f} GiB allocated")
        block = Block(self._next_segment, self._next_address, seg, small)
        self._segments[self._next_segment] = (seg, block)
        self._next_segment += 1
        self._next_address += seg
        self.reserved += seg
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def malloc(self, handle, nbytes: int) -> None:
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL_REQUEST
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = self._blocks[(small,) + pool[i]]
            self._uncache(block)
            self._idle.discard(block.segment)
        else:
            block = self._new_segment(size, small)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            tail = Block(block.segment, block.address + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._cache(tail)
        block.free = False
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, handle) -> None:
        block = self._live.pop(handle)
        self.allocated -= block.size
        block.free = True
        before, after = block.prev, block.next
        if after is not None and after.free:
            self._uncache(after)
            block = _join(block, after)
        if before is not None and before.free:
            self._uncache(before)
            block = _join(before, block)
        self._cache(block)
        if block.prev is None and block.next is None:
            self._idle.add(block.segment)


def replay(events, limit_bytes: float) -> dict:
    """Peak reserved and allocated bytes of ``events`` (("alloc", handle, bytes) or ("free",
    handle, 0)), and the first request that ran out of memory (None when none did)."""
    allocator = CachingAllocator(limit_bytes)
    out_of_memory = None
    try:
        for kind, handle, nbytes in events:
            if kind == "alloc":
                allocator.malloc(handle, nbytes)
            else:
                allocator.free(handle)
    except OutOfMemory as exc:
        out_of_memory = str(exc)
    return {"peak_reserved": allocator.peak_reserved, "peak_allocated": allocator.peak_allocated,
            "out_of_memory": out_of_memory}
