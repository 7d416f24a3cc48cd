"""The caching allocator model of benchmarks/allocator_replay.py follows PyTorch's rules, and the
meta-tensor trace it replays records every allocation and its release."""

import gc

import pytest

from benchmarks.allocator_replay import stage_trace
from benchmarks.caching_allocator import MIB, CachingAllocator, OutOfMemory, replay, segment_size
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def test_segment_sizes_follow_the_pools():
    assert segment_size(100 * 1024) == 2 * MIB        # small pool
    assert segment_size(5 * MIB) == 20 * MIB          # shared large segment
    assert segment_size(11 * MIB) == 12 * MIB         # rounded up to 2 MiB
    assert segment_size(12 * MIB) == 12 * MIB


def test_a_request_takes_the_smallest_cached_block_that_holds_it():
    a = CachingAllocator(1 << 40)
    a.malloc("big", 50 * MIB)
    a.malloc("small", 30 * MIB)
    a.free("big")
    a.free("small")
    a.malloc("x", 25 * MIB)  # from the 30 MiB block: no new segment, the 50 MiB block stays whole
    assert a.reserved == 80 * MIB
    a.malloc("y", 50 * MIB)
    assert a.reserved == 80 * MIB


def test_a_remainder_of_one_mib_or_less_is_not_split_off():
    a = CachingAllocator(1 << 40)
    a.malloc("a", 21 * MIB)
    assert (a.reserved, a.allocated) == (22 * MIB, 22 * MIB)  # rounded to 2 MiB; 1 MiB left stays in the block
    a.free("a")
    a.malloc("b", 20 * MIB)
    assert a.allocated == 20 * MIB  # 2 MiB left: split off
    a.malloc("c", 2 * MIB)
    assert a.reserved == 22 * MIB   # served from the tail


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator(1 << 40)
    a.malloc("whole", 64 * MIB)
    a.free("whole")
    for name in "abcd":
        a.malloc(name, 16 * MIB)
    for name in "bdac":
        a.free(name)
    a.malloc("again", 64 * MIB)
    assert a.reserved == 64 * MIB


def test_cached_free_segments_are_released_before_running_out():
    a = CachingAllocator(100 * MIB)
    a.malloc("a", 60 * MIB)
    a.free("a")
    a.malloc("b", 70 * MIB)  # 60 + 70 > 100: the cached segment goes back to the device first
    assert a.reserved == 70 * MIB
    assert a.peak_reserved == 70 * MIB


def test_a_split_segment_cannot_be_released_so_the_device_runs_out():
    a = CachingAllocator(100 * MIB)
    a.malloc("a", 60 * MIB)
    a.free("a")
    a.malloc("pin", 2 * MIB)   # carved from the cached 60 MiB segment (no 2 MiB block elsewhere)
    assert a.reserved == 60 * MIB
    with pytest.raises(OutOfMemory):
        a.malloc("b", 70 * MIB)  # 58 MiB free, 40 MiB left on the device: fragmentation
    assert a.allocated == 2 * MIB


def test_replay_reports_the_first_request_that_ran_out():
    events = [("alloc", 0, 60 * MIB), ("free", 0, 0), ("alloc", 1, 2 * MIB), ("alloc", 2, 70 * MIB)]
    out = replay(events, 100 * MIB)
    assert out["out_of_memory"] and "70 MiB" in out["out_of_memory"]
    assert replay(events, 200 * MIB)["out_of_memory"] is None


@pytest.mark.parametrize("recompute, pp, stage", [("none", 2, 1), ("full", 2, 1), ("none", 1, 0)])
def test_the_stage_trace_releases_all_it_allocates(recompute, pp, stage):
    model = ModelSpec("tiny", 2, 64, 4, 4, 128, 256, 32)
    training = TrainingSpec(global_batch_size=8, seq_len=32, setup="scaling", flash_attention=False)
    events = stage_trace(model, training, tp=2, pp=pp, dp=2, stage=stage, layers=2, micro_batch_size=2,
                            micro_batches=4, recompute=recompute)
    gc.collect()
    allocs = [e for e in events if e[0] == "alloc"]
    assert len(allocs) == len([e for e in events if e[0] == "free"]) > 100
    assert replay(events, 1 << 40)["out_of_memory"] is None


def test_recompute_lowers_the_traced_peak():
    model = ModelSpec("tiny", 4, 128, 4, 4, 256, 256, 1024)  # activations far above the model states
    training = TrainingSpec(global_batch_size=8, seq_len=1024, setup="scaling", flash_attention=False)
    peaks = {level: replay(stage_trace(model, training, tp=1, pp=2, dp=1, stage=0, layers=4, micro_batch_size=2,
                                       micro_batches=4, recompute=level), 1 << 40)["peak_allocated"]
             for level in ("none", "full")}
    assert peaks["full"] < 0.6 * peaks["none"]
