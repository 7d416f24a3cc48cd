"""Planning: the cost model, the search, the plan file, re-planning, exports and reports.

Never imports torch: plans for any cluster are made on a laptop.
"""

from memx_launch.planning.costmodel import AnalyticalCostModel, LayerCost, LayerCostModel
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.objective import WEIGHT_PROFILES, parse_weights, phi
from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.planning.search import SearchResult, SearchSpace, search

__all__ = ["WEIGHT_PROFILES", "AnalyticalCostModel", "LayerCost", "LayerCostModel", "Objective", "Plan",
           "SearchResult", "SearchSpace", "StagePlan", "evaluate_layout", "parse_weights", "phi", "search"]
