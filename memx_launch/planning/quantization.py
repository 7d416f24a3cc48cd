"""Quantized linear layers (Transformer Engine's recipes, ``--fp8`` and ``--fp4``): the bytes a
quantized tensor takes and what the backward's GEMMs cost beyond the forward's. No torch import.

Every recipe quantizes each linear's input, weight and output gradient along both axes (per-tensor
FP8 by cast and transpose, the block-scaled ones along rows and along columns): the forward GEMM
reads one copy, the two backward GEMMs the other.
"""

from __future__ import annotations

from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.efficiency import blackwell_or_later
from memx_launch.specs.training import TrainingSpec

# Bytes per element of a quantized tensor, its scales included: per-tensor FP8 (``delayed``,
# ``current``); MXFP8, E4M3 with an E8M0 scale per 32 elements; blockwise FP8, E4M3 with an fp32
# scale per 128 elements (a weight's per 128 x 128, counted alike); NVFP4, E2M1 with an E4M3 scale
# per 16 elements (and one fp32 scale per tensor).
ELEMENT_BYTES = {"delayed": 1.0, "current": 1.0, "mxfp8": 1.0 + 1.0 / 32.0, "blockwise": 1.0 + 4.0 / 128.0,
                 "nvfp4": 0.5 + 1.0 / 16.0}
# FP8 tensor cores of Ada and Hopper accumulate at reduced precision. Training runs the forward GEMM
# with that fast accumulation and promotes the backward's two GEMMs' partial sums to fp32
# (torchao's Float8Linear: use_fast_accum for the output only; Transformer Engine: the split
# accumulator for dgrad and wgrad), which costs them 1.1-1.2x (pytorch/ao#2377): 1.15 here.
# Blackwell's tensor cores accumulate in fp32 (Transformer Engine documents the fast accumulation
# as Hopper's and Ada's); its FP4 GEMMs never take the split accumulator.
FP8_PRECISE_ACCUMULATION_SLOWDOWN = 1.15
# Recipes whose scale comes from the whole tensor's amax, known only after a pass over it: current
# (tensorwise dynamic) scaling and NVFP4's per-tensor scale read each 16-bit tensor once for its
# amax, then again to cast it. Delayed scaling casts with the scale of past amaxes and records
# this one's in the same pass; MXFP8 and blockwise FP8 scale each block as they cast it.
WHOLE_TENSOR_AMAX = frozenset({"current", "nvfp4"})


def element_bytes(training: TrainingSpec) -> float:
    """Bytes per element of a quantized linear's operands (the training dtype's without a recipe)."""
    recipe = training.quantized_linears
    return training.dtype_bytes if recipe is None else ELEMENT_BYTES[recipe]


def cast_bytes(training: TrainingSpec, amax_found: bool = False, axes: int = 2) -> float:
    """HBM bytes per element a quantized linear's operand cast moves: the 16-bit tensor read (twice
    where the recipe needs its amax first, :data:`WHOLE_TENSOR_AMAX`, unless the kernel that wrote
    the tensor found it: ``amax_found``) and written quantized along ``axes`` axes (both: the
    forward's copy and the backward's transpose)."""
    reads = 2.0 if training.quantized_linears in WHOLE_TENSOR_AMAX and not amax_found else 1.0
    return reads * training.dtype_bytes + axes * element_bytes(training)


def backward_gemm_slowdown(device: DeviceType, training: TrainingSpec) -> float:
    """What the backward's GEMMs of a quantized linear take on ``device`` against the forward's at
    the same rate: :data:`FP8_PRECISE_ACCUMULATION_SLOWDOWN` for FP8 before Blackwell, else 1."""
    if training.fp8 is None or blackwell_or_later(device.compute_capability):
        return 1.0
    return FP8_PRECISE_ACCUMULATION_SLOWDOWN
