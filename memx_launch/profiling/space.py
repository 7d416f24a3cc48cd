"""What a device type's profile may sample: the parameters, their values and one sample point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


from memx_launch.errors import ConfigError
from memx_launch.planning.plan import RECOMPUTE_LEVELS
from memx_launch.specs.model import ModelSpec


PARAMETERS = ("tp", "micro_batch_size", "seq_len", "recompute", "num_kv_heads")


@dataclass(frozen=True)
class Sample:
    """One configuration to calibrate."""

    tp: int
    micro_batch_size: int
    seq_len: int
    recompute: str
    num_kv_heads: int

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ConfigError("recompute", f"unknown level {self.recompute!r}",
                              f"use one of {', '.join(RECOMPUTE_LEVELS)}")


@dataclass(frozen=True)
class ProfileSpace:
    """The values each profiled parameter may take, in increasing order, and the defaults
    (the centre of the ablation)."""

    values: dict[str, tuple]
    default: Sample

    def __post_init__(self):
        for name in PARAMETERS:
            vals = self.values.get(name)
            if not vals:
                raise ConfigError(f"profile_space.{name}", "no values", "give at least one value")
            if getattr(self.default, name) not in vals:
                raise ConfigError(f"profile_space.{name}", f"default {getattr(self.default, name)!r} is not "
                                  "among the values", "add it to the values")

    @property
    def full_grid_size(self) -> int:
        return math.prod(len(self.values[p]) for p in PARAMETERS)

    def three_points(self, name: str) -> tuple:
        """(min, mid, max) of a parameter, fewer when it has fewer values. The mid is the
        default when it lies strictly inside, so the ablation's points are design points too."""
        vals = self.values[name]
        default = getattr(self.default, name)
        mid = default if vals[0] != default != vals[-1] else vals[len(vals) // 2]
        return tuple(dict.fromkeys((vals[0], mid, vals[-1])))


def default_space(model: ModelSpec, *, tp_degrees: Sequence[int] = (1,), max_micro_batch: int = 8,
                  seq_lens: Sequence[int] | None = None) -> ProfileSpace:
    """Powers of two for micro-batch; sequence lengths up to the model's; every level of
    recompute; the KV-head counts (query groups) that divide the model's heads."""
    mbs = tuple(2**i for i in range(int(math.log2(max_micro_batch)) + 1))
    seqs = tuple(seq_lens) if seq_lens else tuple(sorted({max(16, model.seq_len // 4), max(16, model.seq_len // 2),
                                                          model.seq_len}))
    kv = tuple(k for k in range(1, model.num_heads + 1)
               if model.num_heads % k == 0 and all(k % t == 0 for t in tp_degrees))
    tps = tuple(sorted(tp_degrees))
    default = Sample(tp=tps[0], micro_batch_size=mbs[len(mbs) // 2], seq_len=seqs[len(seqs) // 2],
                     recompute="none", num_kv_heads=model.num_kv_heads if model.num_kv_heads in kv else kv[-1])
    return ProfileSpace({"tp": tps, "micro_batch_size": mbs, "seq_len": seqs, "recompute": RECOMPUTE_LEVELS,
                         "num_kv_heads": kv}, default)
