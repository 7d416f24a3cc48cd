"""Training the predictor's boosted trees and tuning their hyper-parameters: a small Gaussian-process
Bayesian optimisation (expected improvement) of the k-fold cross-validated ratio MAPE, the offsets
re-fitted inside each fold. No torch import."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm

from memx_launch.profiling.features import Offsets, TrainingSet

# Bounds of the tuned hyper-parameters; (name, low, high, log scale, integer).
_SEARCH_SPACE = (
    ("max_depth", 2, 6, False, True),
    ("learning_rate", 0.08, 0.3, True, False),
    ("subsample", 0.6, 1.0, False, False),
    ("min_child_weight", 0.5, 8.0, True, False),
    ("reg_lambda", 0.1, 10.0, True, False),
)


# Boosting rounds scale with 1/learning rate so every trial reaches a similar total step.
_ROUNDS_X_RATE = 15.0
XGBOOST_THREADS = 1
"""Threads per boosting round. A profile holds hundreds of rows, too few to split: a second
thread adds a synchronisation per round, which waits out a time slice whenever another process
holds the core (a shared host, a test suite). One thread fits 2.5-3.9x faster beside one busy
process and no slower on a quiet machine (benchmarks/results/predictor_fit_speed.json)."""


def _booster_params(params: dict, seed: int) -> dict:
    return {"tree_method": "hist", "multi_strategy": "multi_output_tree", "objective": "reg:squarederror",
            "max_depth": int(params["max_depth"]), "eta": params["learning_rate"],
            "subsample": params["subsample"], "min_child_weight": params["min_child_weight"],
            "lambda": params["reg_lambda"], "seed": seed, "nthread": XGBOOST_THREADS, "verbosity": 0}


def train_trees(ts: TrainingSet, offsets: Offsets, params: dict, seed: int):
    """Boosted trees of ``params`` on ``ts``, each row starting from its ``offsets`` margin."""
    import xgboost as xgb

    rounds = int(round(_ROUNDS_X_RATE / params["learning_rate"]))
    data = xgb.DMatrix(ts.X, label=ts.Y, base_margin=offsets.margin(ts.X, ts.device_types, ts.models))
    return xgb.train(_booster_params(params, seed), data, num_boost_round=rounds)


def ratio_mape(pred_log: np.ndarray, true_log: np.ndarray) -> float:
    """MAPE of exp(pred) against exp(true): the error of the scaled physical estimate."""
    if pred_log.size == 0:
        return 0.0
    return float(np.mean(np.abs(np.exp(pred_log - true_log) - 1.0)))


def _cv_error(ts: TrainingSet, params, folds, seed) -> float:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(ts.X))
    errors = []
    for k in range(folds):
        test = ts.subset(order[k::folds])
        train = ts.subset(np.setdiff1d(order, order[k::folds]))
        offsets = Offsets.fit(train)  # from the training fold only
        booster = train_trees(train, offsets, params, seed)
        margin = offsets.margin(test.X, test.device_types, test.models)
        pred = np.asarray(booster.inplace_predict(test.X, base_margin=margin)).reshape(-1, 2)
        mem = test.has_memory
        errors.append(ratio_mape(pred[:, 0], test.Y[:, 0]) + ratio_mape(pred[mem, 1], test.Y[mem, 1]))
    return float(np.mean(errors))


def _decode(u: np.ndarray) -> dict:
    out = {}
    for value, (name, low, high, log, integer) in zip(u, _SEARCH_SPACE):
        x = math.exp(math.log(low) + value * (math.log(high) - math.log(low))) if log else low + value * (high - low)
        out[name] = int(round(x)) if integer else float(x)
    return out


def _gp_posterior(U: np.ndarray, y: np.ndarray, candidates: np.ndarray):
    """Zero-mean GP with an RBF kernel; length scale by maximum marginal likelihood on a grid."""
    best = None
    for length in (0.15, 0.3, 0.6, 1.2):
        K = np.exp(-0.5 * ((U[:, None] - U[None]) ** 2).sum(-1) / length**2) + 1e-4 * np.eye(len(U))
        L = np.linalg.cholesky(K)
        alpha = np.linalg.solve(L.T, np.linalg.solve(L, y))
        loglik = -0.5 * y @ alpha - np.log(np.diag(L)).sum()
        if best is None or loglik > best[0]:
            best = (loglik, length, L, alpha)
    _, length, L, alpha = best
    Ks = np.exp(-0.5 * ((candidates[:, None] - U[None]) ** 2).sum(-1) / length**2)
    mean = Ks @ alpha
    v = np.linalg.solve(L, Ks.T)
    std = np.sqrt(np.maximum(1.0 - (v**2).sum(0), 1e-12))
    return mean, std


def tune_hyperparameters(ts: TrainingSet, *, trials: int = 10, initial: int = 4, folds: int = 3,
                         seed: int = 0) -> tuple[dict, float, list[dict]]:
    """Bayesian optimisation (GP + expected improvement) of the k-fold CV error."""
    rng = np.random.default_rng(seed)
    folds = max(2, min(folds, len(ts.X)))
    U, scores, history = [], [], []
    for i in range(trials):
        if i < initial:
            u = rng.random(len(_SEARCH_SPACE))
        else:
            Ua, s = np.array(U), np.array(scores)
            y = (s - s.mean()) / (s.std() + 1e-12)
            candidates = rng.random((512, len(_SEARCH_SPACE)))
            mean, std = _gp_posterior(Ua, y, candidates)
            z = (y.min() - mean) / std
            ei = (y.min() - mean) * norm.cdf(z) + std * norm.pdf(z)
            u = candidates[int(np.argmax(ei))]
        params = _decode(u)
        score = _cv_error(ts, params, folds, seed)
        U.append(u)
        scores.append(score)
        history.append({**params, "cv_error": score})
    best = int(np.argmin(scores))
    return _decode(U[best]), scores[best], history
