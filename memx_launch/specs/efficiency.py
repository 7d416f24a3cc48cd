"""How fast a device's training matmuls run when its cluster file gives no ``efficiency``: the
share of its datasheet peak, by vendor and NVIDIA compute capability. No torch import."""

from __future__ import annotations

# Share of the datasheet peak that a training step's 16-bit matmuls sustain on A100 (and on any
# device memx knows no better of). The cost model times memory-bound work, launches and
# communication separately, so this is the matmul share, not an end-to-end MFU; calibration
# replaces it per device type.
DEFAULT_EFFICIENCY = 0.75
# The best-shaped bf16 matmul's share of the datasheet peak, found by a brute-force search over
# shapes (Maximum Achievable Matmul FLOPS; github.com/stas00/ml-engineering,
# compute/accelerator/README.md): A100 SXM 85.9% and H100 SXM 80.1% (CUDA 12.1), MI300X 60.1%
# (ROCm 6.2; MI250X 76.7%), B200 77.6% (1,745 of 2,250 TFLOPS, torch 2.7.1 with CUDA 12.8; B300
# 78.6%, GB200 72.9% of its 2,500). The newer datasheet peaks sit further above what the clocks
# sustain under the power limit.
BEST_MATMUL_SHARE = {"ampere": 0.859, "hopper": 0.801, "blackwell": 0.776, "amd": 0.601}
# fp32 matmuls on CUDA cores (TF32 off): whole fp32 blocks of the public Sailor and Aceso profiles
# reach up to 0.95 of the fp32 peak in matmul FLOPs per second (Aceso's OPT-350 on GH-96; Sailor's
# OPT-30 on A100-40 0.92; their unfused attention over the whole s x s square,
# benchmarks/results/peer_profile_bounds.json), their element-wise work included, so their GEMMs
# sustain at least that: CUDA cores 8-16x slower than the tensor cores beside them are far easier
# to keep fed. The 16-bit training share (above) would time them 1.27x too slow.
FP32_MATMUL_SHARE = 0.95
# NVIDIA compute capabilities of Hopper (H100, H200, GH200) and Blackwell (B200, GB200; B300 and
# GB300 are 10.3).
HOPPER_COMPUTE_CAPABILITY = 9.0
BLACKWELL_COMPUTE_CAPABILITY = 10.0
# What training's matmuls sustain of the device's best matmul rate. Ampere: DEFAULT_EFFICIENCY of
# A100's peak, where it reproduces Megatron's published A100 throughput. Hopper sustains less of
# its own: MosaicML's MPT tables, the one public table of the same layouts run on A100 and H100,
# give a median A100/H100 step time of 2.26 over the 17 layouts of at most 4,096 tokens
# (matmul-bound), which memx reproduces at 0.58 of H100's peak, 72% of its best matmul where
# A100's training reaches 87% (benchmarks/published_throughput.py, docs/setups.md). Why is not
# measured here (the power limit under sustained load, per-kernel costs of a 3x faster chip are
# candidates). AMD's MI300X, H100's contemporary and with no such table, and Blackwell, with no
# public table of the same layouts on it and on an older GPU, are taken at Hopper's share of
# their own best rate.
_HOPPER_SHARE = 0.58 / BEST_MATMUL_SHARE["hopper"]
TRAINING_SHARE_OF_BEST_MATMUL = {"ampere": DEFAULT_EFFICIENCY / BEST_MATMUL_SHARE["ampere"],
                                 "hopper": _HOPPER_SHARE, "blackwell": _HOPPER_SHARE, "amd": _HOPPER_SHARE}


def hopper_or_later(compute_capability: float | None) -> bool:
    """An NVIDIA compute capability of Hopper or later (unset: taken as Ampere)."""
    return compute_capability is not None and compute_capability >= HOPPER_COMPUTE_CAPABILITY


def blackwell_or_later(compute_capability: float | None) -> bool:
    """An NVIDIA compute capability of Blackwell or later."""
    return compute_capability is not None and compute_capability >= BLACKWELL_COMPUTE_CAPABILITY


def _generation(vendor: str, compute_capability: float | None) -> str:
    """The key of the tables above: NVIDIA Blackwell, Hopper, AMD, else Ampere (any other device)."""
    if vendor == "amd":
        return "amd"
    if vendor != "nvidia" or not hopper_or_later(compute_capability):
        return "ampere"
    return "blackwell" if blackwell_or_later(compute_capability) else "hopper"


def training_share_of_best_matmul(vendor: str, compute_capability: float | None) -> float:
    """Share of a device's best matmul rate (a large square matmul's) that its training matmuls
    sustain (:data:`TRAINING_SHARE_OF_BEST_MATMUL`)."""
    return TRAINING_SHARE_OF_BEST_MATMUL[_generation(vendor, compute_capability)]


def default_efficiency(vendor: str, compute_capability: float | None) -> float:
    """Share of the datasheet peak a device type's 16-bit training matmuls sustain when its file
    gives no ``efficiency``: its training share of its generation's best matmul rate, 0.58 on
    NVIDIA Hopper, 0.56 on Blackwell and 0.44 on AMD (MI300X's best rate; an MI250X, A100's
    contemporary, is better given A100's share in its file: ``efficiency: 0.67``, docs/clusters.md).
    Any other device: DEFAULT_EFFICIENCY."""
    generation = _generation(vendor, compute_capability)
    return TRAINING_SHARE_OF_BEST_MATMUL[generation] * BEST_MATMUL_SHARE[generation]


# A GPU's idle board power as a share of its rated power (H100 SXM about 70 of 700 W, A100 SXM
# about 50 of 400): the part of a power limit that lowering the clock cannot give back.
IDLE_POWER_SHARE = 0.1


def power_limited_clock_share(power_limit_w: float, rated_power_w: float) -> float:
    """Share of its clock a GPU keeps on compute-bound work under a power limit below its rated
    power. Dynamic power is C V^2 f, and over the range the driver moves the clock in the voltage
    follows the clock, so the power above idle grows as f^3. Large matmuls and fused attention
    draw the rated power at the rated limit (H100 SXM's clock settles there, under its top), so
    under a limit P their clock is ((P - idle) / (rated - idle))^(1/3) of the one the default
    shares assume: 0.88 at 500 of H100's 700 W. A GPU whose matmuls stay under the rated power at
    its top clock (A100) loses less (docs/clusters.md). HBM and links keep their own clocks."""
    idle = IDLE_POWER_SHARE * rated_power_w
    return min(1.0, max(power_limit_w - idle, 0.0) / (rated_power_w - idle)) ** (1.0 / 3.0)
