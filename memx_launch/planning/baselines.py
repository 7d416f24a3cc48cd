"""What other planners would pick, judged by memx's cost model (``memx plan --compare``).
"""

from __future__ import annotations


import numpy as np

from memx_launch.planning import costmodel as cm
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.planning.layouts import enumerate_layouts, tp_degrees
from memx_launch.planning.objective import objective_for
from memx_launch.planning.cost_table import CostTable
from memx_launch.planning.scoring import Evaluator
from memx_launch.planning.scored_plan import to_plan
from memx_launch.planning.search import SearchResult, SearchSpace, search


def compare_baselines(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                      cost_model: cm.LayerCostModel | None = None, space: SearchSpace | None = None,
                      objective: str | None = None, weights=None,
                      memx: SearchResult | None = None) -> dict[str, Plan | None]:
    """What other planners would pick, judged by the same cost model.

    compute-proportional: layers by effective compute share, no recompute, fastest predicted
    plan (memory not checked, as compute-share planners do); memory-proportional: layers by
    capacity share, no recompute, fastest plan that fits; time-only: memx's search with
    weights (1, 0, 0); memx: memx's own choice (``memx``, the search already run, when given);
    memx unbounded: what the same profile picks with no --max-slowdown bound.
    """
    space = space or SearchSpace()
    if memx is None:
        memx = search(model, cluster, training, cost_model=cost_model, space=space, objective=objective,
                      weights=weights, top_k=1)
    refs = tuple(memx.best.objective.terms[k] for k in ("T_ref", "M_ref", "V_ref"))
    out: dict[str, Plan | None] = {}
    cost_model = cost_model or cm.AnalyticalCostModel(model, cluster, training)
    names = tuple(cost_model.device_names)
    seq = training.seq_len
    table = CostTable(cost_model, len(names), tp_degrees(model, cluster), space.micro_batch_sizes, [seq])
    evaluator = Evaluator(model, cluster, training, cost_model, table)
    for name, share_of, must_fit in (("compute-proportional", _compute_share, False),
                                     ("memory-proportional", _memory_share, True)):
        best = None
        for layout in enumerate_layouts(model, cluster, names):
            # A learned model's cluster carries the efficiencies calibration measured.
            layers = proportional_split(share_of(getattr(cost_model, "calibrated_cluster", cluster), layout, names),
                                        model.num_layers)
            for mbs in space.micro_batch_sizes:
                if training.global_batch_size % (layout.dp * mbs) or layers.min() < 1:
                    continue
                levels = np.zeros((1, layout.pp), dtype=np.int64)
                result = evaluator.score(layout, mbs, seq, "1f1b", 1, levels, layers[None, :])
                if must_fit and not result.feasible[0]:
                    continue
                if best is None or result.T[0] < best.T[0]:
                    best = result
        out[name] = None if best is None else to_plan(
            best, 0, model, cluster, training,
            objective_for(best.T[0], best.M[0], best.V[0], refs, memx.profile, memx.weights))
    time_only = search(model, cluster, training, cost_model=cost_model, space=space, weights=(1.0, 0.0, 0.0),
                       top_k=1).best
    time_only.objective = objective_for(time_only.predicted_iteration_time_s,
                                         time_only.predicted_peak_memory_fraction,
                                         time_only.predicted_memory_variance, refs, memx.profile, memx.weights)
    out["time-only"] = time_only
    out["memx"] = memx.best
    out["memx unbounded"] = memx.unbounded
    return out


def _compute_share(cluster, layout, names):
    return np.array([cluster.device_type(names[d]).effective_tflops for d in layout.stage_device])


def _memory_share(cluster, layout, names):
    return np.array([cluster.device_type(names[d]).memory_gib for d in layout.stage_device])


def proportional_split(share: np.ndarray, num_layers: int) -> np.ndarray:
    """Largest-remainder rounding of ``num_layers * share / sum(share)``."""
    exact = num_layers * share / share.sum()
    layers = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - layers))[: num_layers - layers.sum()]:
        layers[i] += 1
    return layers
