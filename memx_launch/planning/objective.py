"""The objective Phi = T^wT * M^wM * V^wV (paper section 3.1.2) and its weight profiles.
"""

from __future__ import annotations

import math


import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning.plan import Objective
from memx_launch.specs.cluster import ClusterSpec


WEIGHT_PROFILES = {
    "default": (0.4, 0.2, 0.4),
    "safety": (0.3, 0.5, 0.2),
    "throughput": (0.7, 0.2, 0.1),
}


SAFETY_MARGIN = 0.10          # if no candidate leaves this much memory free: safety profile


WEAK_HETEROGENEITY = 0.10     # compute CV below this counts as (nearly) homogeneous


EPS_V_FRACTION = 0.05         # eps_V as a fraction of V_ref


DEFAULT_MAX_SLOWDOWN = 0.05   # the chosen profile may cost this much predicted time against the fastest plan


def objective_terms(T, M, V, references=None):
    """Reference values are medians over the feasible candidates (paper section 3.1.2)."""
    t_ref, m_ref, v_ref = references or (np.median(T), np.median(M), np.median(V))
    eps = EPS_V_FRACTION * v_ref if v_ref > 0 else 1e-12
    return T / t_ref, M / m_ref, (V + eps) / (v_ref + eps)


def phi(T, M, V, weights, references=None):
    """Phi = T^wT * M^wM * V^wV on the normalised terms; returns (phi, (t, m, v))."""
    t, m, v = objective_terms(T, M, V, references)
    w_t, w_m, w_v = weights
    return t**w_t * m**w_m * v**w_v, (t, m, v)


def choose_profile(cluster: ClusterSpec, T, M) -> tuple[str, str]:
    """Safety when memory is tight for this model on this cluster: even the leanest feasible
    candidate leaves under 10% free. Throughput for (nearly) homogeneous clusters; the
    heterogeneous default otherwise."""
    margin = 1.0 - float(np.min(M))
    het = cluster.heterogeneity_index()
    if margin < SAFETY_MARGIN:
        return "safety", f"even the leanest feasible plan leaves only {margin:.0%} memory free (< {SAFETY_MARGIN:.0%})"
    if het < WEAK_HETEROGENEITY:
        return "throughput", f"compute heterogeneity index {het:.2f} < {WEAK_HETEROGENEITY}"
    return "default", f"heterogeneous cluster (compute CV {het:.2f}), up to {margin:.0%} memory free"


def parse_weights(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise ConfigError("--weights", f"expected three non-negative numbers wT,wM,wV, got {text!r}",
                          "e.g. --weights 0.4,0.2,0.4")
    total = sum(values)
    return tuple(v / total for v in values)


def add_slowdown_arg(parser) -> None:
    """``--max-slowdown`` (memx plan, memx-run): the bound on what the default profile may trade."""
    parser.add_argument("--max-slowdown", "--max_slowdown", metavar="PCT",
                        help="the winner may be predicted at most this much slower than the fastest feasible plan, "
                             "trading it for memory and balance, e.g. 5%% or 0.05 (default 5%% for the profile memx "
                             "chooses; none for --objective/--weights)")


def parse_slowdown(text: str) -> float:
    """``--max-slowdown``: a share of the fastest plan's time, ``5%`` or ``0.05``."""
    number = text.strip().removesuffix("%")
    try:
        value = float(number) / (100 if text.strip().endswith("%") else 1)
    except ValueError:
        value = math.nan
    # A bare 5 is almost surely 5%, not 500%: ask for the unit rather than guess.
    if not math.isfinite(value) or value < 0 or (not text.strip().endswith("%") and value >= 1):
        raise ConfigError("--max-slowdown", f"expected a share of the fastest plan's time, got {text!r}",
                          "e.g. --max-slowdown 5% or 0.05 (more than 100% only with %)")
    return value


def objective_for(T, M, V, references, profile, weights) -> Objective:
    value, (t, m, v) = phi(T, M, V, weights, references)
    t_ref, m_ref, v_ref = references
    terms = {"T": float(t), "M": float(m), "V": float(v),
             "T_ref": float(t_ref), "M_ref": float(m_ref), "V_ref": float(v_ref)}
    return Objective(float(value), profile, tuple(weights), terms)
