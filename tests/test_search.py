"""The search: layouts, layer balancing, recompute policy, Phi, pruning and the Table 1 case."""

import os

import numpy as np
import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.errors import ConfigError, NoFeasiblePlanError
from memx_launch.planning.search import SearchSpace, search
from memx_launch.planning.layer_split import balance_layers
from memx_launch.planning.baselines import compare_baselines, proportional_split
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.objective import WEIGHT_PROFILES, parse_slowdown, parse_weights
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.specs.catalog import get_model

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")


def cluster(name):
    return ClusterSpec.from_yaml(os.path.join(CLUSTERS, name + ".yaml"))


def test_table1_memory_asymmetry_case():
    """Paper Table 1: the compute-proportional split overflows the 32 GB part, the
    memory-proportional split fits but is slow, memx's time-only plan fits and is faster.
    (Since interleaving is timed by physics, the default profile trades time for balance here:
    its plan fits with the lowest memory variance but is not the fastest.)"""
    model = get_model("llama2-7b")
    choices = compare_baselines(model, cluster("table1-2vendor"), TrainingSpec(global_batch_size=64))
    by_compute, by_memory, memx, fastest = (choices["compute-proportional"], choices["memory-proportional"],
                                            choices["memx"], choices["time-only"])
    overflow = [s for s in by_compute.stages if s.predicted_peak_memory_gib > s.memory_capacity_gib]
    # The small part overflows (the fastest such plan may run the big one over too: the
    # compute-share planner checks no memory).
    assert overflow and "vendor-x-32gb" in {s.device_type for s in overflow}
    for plan in (by_memory, memx, fastest):
        assert all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in plan.stages)
    assert fastest.predicted_iteration_time_s < by_memory.predicted_iteration_time_s
    assert memx.predicted_memory_variance < by_memory.predicted_memory_variance
    # The small fast part recomputes, the big one keeps (some of) its activations.
    x_levels = {s.recompute for s in memx.stages if s.device_type == "vendor-x-32gb"}
    y_levels = {s.recompute for s in memx.stages if s.device_type == "vendor-y-64gb"}
    assert max(map(cm.RECOMPUTE_LEVELS.index, x_levels)) >= max(map(cm.RECOMPUTE_LEVELS.index, y_levels))


def test_paper_cluster_plans_are_feasible_ranked_and_uneven():
    model = get_model("llama2-7b")
    result = search(model, cluster("paper-20gpu"), TrainingSpec(global_batch_size=64), top_k=5)
    phis = [p.objective.phi for p in result.plans]
    assert phis == sorted(phis)
    for plan in result.plans:
        assert sum(s.num_layers for s in plan.stages) == 32
        assert all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in plan.stages)
        assert plan.tp * plan.pp * plan.dp == 20
        for stage in plan.stages:  # a stage never mixes device types
            assert len({cluster("paper-20gpu").rank_device_types()[r] for r in stage.ranks}) == 1
    assert len({s.num_layers for s in result.best.stages}) > 1
    assert result.profile == "default"
    stats = result.stats
    assert stats.cache_misses > 0 and stats.cache_hits > 100 * stats.cache_misses
    assert stats.enumerated == stats.evaluated + stats.pruned_memory + stats.pruned_time + \
        stats.pruned_schedule + stats.pruned_batch
    # The Pareto front trades time for variance: sorted by time, variance strictly falls.
    times = [p.predicted_iteration_time_s for p in result.pareto]
    variances = [p.predicted_memory_variance for p in result.pareto]
    assert times == sorted(times)
    assert variances == sorted(variances, reverse=True) and len(set(variances)) == len(variances)


def test_weights_change_the_winner_towards_time():
    model, c, t = get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=64)
    time_only = search(model, c, t, weights=(1, 0, 0), top_k=1).best
    balanced = search(model, c, t, weights=(0, 0, 1), top_k=1).best
    assert time_only.predicted_iteration_time_s <= balanced.predicted_iteration_time_s
    assert balanced.predicted_memory_variance <= time_only.predicted_memory_variance


def test_default_pick_is_within_max_slowdown_of_the_fastest_feasible_plan():
    """Issue 22: the default profile's pick was the slowest point of its own Pareto front (+29%)."""
    model, c, t = get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=64)
    fastest = search(model, c, t, weights=(1, 0, 0), top_k=1).best.predicted_iteration_time_s
    result = search(model, c, t, top_k=5)
    assert result.profile == "default" and result.max_slowdown == 0.05
    assert result.fastest.predicted_iteration_time_s == pytest.approx(fastest)
    assert all(p.predicted_iteration_time_s <= 1.05 * fastest * (1 + 1e-9) for p in result.plans)
    # The bound binds here: the profile alone picks a much slower plan, kept as ``unbounded``.
    assert result.unbounded.predicted_iteration_time_s > 1.05 * fastest
    assert result.unbounded.objective.phi < result.best.objective.phi
    # What it bought: less peak memory and variance than the fastest plan.
    assert result.best.predicted_memory_variance < result.fastest.predicted_memory_variance
    zero = search(model, c, t, space=SearchSpace(max_slowdown=0.0), top_k=1)
    assert zero.best.predicted_iteration_time_s == pytest.approx(fastest)


def test_explicit_paper_weights_rank_every_candidate_unless_bounded_too():
    model, c, t = get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=64)
    auto = search(model, c, t, top_k=1)
    for given in (dict(objective="default"), dict(weights=WEIGHT_PROFILES["default"])):
        paper = search(model, c, t, top_k=1, **given)
        assert paper.max_slowdown is None and paper.best is paper.unbounded
        assert _layout(paper.best) == _layout(auto.unbounded)  # what the paper's Phi picked before the bound
        assert min(p.objective.phi for p in paper.pareto) >= paper.best.objective.phi
    bounded = search(model, c, t, top_k=1, objective="default", space=SearchSpace(max_slowdown=0.05))
    assert bounded.best.predicted_iteration_time_s <= 1.05 * auto.fastest.predicted_iteration_time_s * (1 + 1e-9)
    with pytest.raises(ConfigError, match="--max-slowdown"):
        search(model, c, t, space=SearchSpace(max_slowdown=-0.1))


def _layout(plan):
    return (plan.stage_tps, plan.pp, plan.dp, plan.micro_batch_size, [s.num_layers for s in plan.stages],
            [s.recompute for s in plan.stages])


@pytest.mark.parametrize("text, value", [("5%", 0.05), ("0.05", 0.05), ("0", 0.0), ("150%", 1.5)])
def test_max_slowdown_reads_a_share_or_a_percentage(text, value):
    assert parse_slowdown(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["5", "-1%", "nan", "fast", "inf%"])
def test_max_slowdown_refuses_what_it_cannot_read_as_a_share(text):
    with pytest.raises(ConfigError, match="--max-slowdown"):
        parse_slowdown(text)


def test_time_budget_is_honoured():
    model = get_model("llama3-70b")
    space = SearchSpace(micro_batch_sizes=(1, 2, 4, 8, 16), seq_lens=(2048, 4096, 8192), time_prune_factor=1e9)
    result = search(model, cluster("hetero-1024"), TrainingSpec(global_batch_size=2048, seq_len=8192,
                    distributed_optimizer=True), space=space, time_budget_s=0.5)
    # A budget well under the whole search's (1.7 s on a fast 2-core host), so that it runs out on any host.
    assert result.stats.budget_exhausted and result.plans
    assert result.stats.evaluated < result.stats.enumerated
    # One group of candidates may finish after the deadline, nothing more.
    assert result.stats.seconds < 2.5


def test_nothing_fits_lists_closest_with_shortfall():
    with pytest.raises(NoFeasiblePlanError) as err:
        search(get_model("llama3-70b"), cluster("v100-t4"), TrainingSpec(global_batch_size=8))
    assert err.value.closest and "short" in err.value.closest[0] and "GiB" in err.value.closest[0]


def test_balance_layers_respects_memory_and_balances_time():
    t_layer = np.array([[1.0, 2.0]])
    layers, ok = balance_layers(t_layer, np.zeros(2), np.array([[100.0, 100.0]]), 30)
    assert ok[0] and layers.tolist() == [[20, 10]]
    layers, ok = balance_layers(t_layer, np.zeros(2), np.array([[12.0, 100.0]]), 30)
    assert ok[0] and layers.tolist() == [[12, 18]]
    _, ok = balance_layers(t_layer, np.zeros(2), np.array([[12.0, 10.0]]), 30)
    assert not ok[0]


def test_balance_layers_finds_the_fastest_split_that_fits():
    """Against every split of a few layers over a few stages (each between its minimum and its
    memory limit): the slowest stage of the chosen split is the least any fitting split reaches,
    ties between stages of equal speed included."""
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(300):
        pp, layers = int(rng.integers(1, 4)), int(rng.integers(3, 9))
        t_layer = rng.choice([0.5, 1.0, 1.5], size=(1, pp)) * rng.choice([1.0, rng.uniform(0.8, 1.2)], size=(1, pp))
        edge_t = rng.choice([0.0, 0.75], size=pp)
        max_layers = rng.integers(0, layers + 1, size=(1, pp)).astype(float)
        fewest = int(rng.integers(1, 3))
        split, ok = balance_layers(t_layer, edge_t, max_layers, layers, fewest)
        fitting = [c for c in itertools.product(range(fewest, layers + 1), repeat=pp)
                   if sum(c) == layers and all(n <= m for n, m in zip(c, max_layers[0]))]
        assert ok[0] == bool(fitting), (t_layer, edge_t, max_layers, layers, fewest, split)
        if fitting:
            def slowest(c):
                return max(n * t + e for n, t, e in zip(c, t_layer[0], edge_t))
            assert split[0].sum() == layers and all(fewest <= n <= m for n, m in zip(split[0], max_layers[0]))
            assert slowest(split[0]) == pytest.approx(min(slowest(c) for c in fitting))


def test_proportional_split_adds_up():
    assert proportional_split(np.array([70.0, 86.0]), 32).tolist() == [14, 18]
    assert proportional_split(np.array([32.0, 64.0]), 32).sum() == 32


def test_evaluate_layout_reproduces_the_searched_plan():
    model, c, t = get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=64)
    plan = search(model, c, t, top_k=1).best
    refs = tuple(plan.objective.terms[k] for k in ("T_ref", "M_ref", "V_ref"))
    again = evaluate_layout(model, c, t, tp=plan.tp, pp=plan.pp, dp=plan.dp,
                            micro_batch_size=plan.micro_batch_size,
                            layers_per_stage=[s.num_layers for s in plan.stages],
                            recompute=[s.recompute for s in plan.stages],
                            stage_devices=[s.device_type for s in plan.stages], schedule=plan.schedule,
                            virtual_stages=plan.virtual_stages, references=refs, weights=plan.objective.weights)
    assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
    assert again.objective.phi == pytest.approx(plan.objective.phi)
    for a, b in zip(again.stages, plan.stages):
        assert a.predicted_peak_memory_gib == pytest.approx(b.predicted_peak_memory_gib)
        assert a.ranks == b.ranks


def test_bad_layouts_are_rejected_with_the_field():
    model, c, t = get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=64)
    with pytest.raises(ConfigError, match="--tp/--pp/--dp"):
        evaluate_layout(model, c, t, tp=1, pp=3, dp=1, micro_batch_size=1)
    with pytest.raises(ConfigError, match="--global-batch-size"):
        evaluate_layout(model, c, TrainingSpec(global_batch_size=10), tp=1, pp=5, dp=4, micro_batch_size=4)
    with pytest.raises(ConfigError, match="--weights"):
        parse_weights("1,2")


def test_a_batch_that_never_divides_names_the_batch():
    with pytest.raises(ConfigError, match="--global-batch-size"):
        search(get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=7),
               space=SearchSpace(micro_batch_sizes=(2, 4)))


def test_plan_records_training_assumptions():
    t = TrainingSpec(global_batch_size=64, fully_sharded=True)
    plan = search(get_model("llama2-7b"), cluster("paper-20gpu"), t, top_k=1).best
    assert plan.training["fully_sharded"] is True


def test_memory_headroom_keeps_every_stage_under_its_share():
    model, c, t = get_model("llama2-7b"), cluster("table1-2vendor"), TrainingSpec(global_batch_size=64)
    plans = search(model, c, t, space=SearchSpace(memory_headroom=0.35), weights=(1, 0, 0), top_k=5).plans
    for plan in plans:
        assert all(s.predicted_peak_memory_gib <= 0.65 * s.memory_capacity_gib for s in plan.stages)
    tight = search(model, c, t, weights=(1, 0, 0), top_k=1).best
    assert max(s.predicted_peak_memory_gib / s.memory_capacity_gib for s in tight.stages) > 0.65


def test_excluded_recompute_level_never_appears_even_through_the_hard_rule():
    """Without selective, the per-stage hard rule must not lower a full stage to selective
    (on this case it did: the lightest level that fits was selective)."""
    model = get_model("llama2-7b")
    training = TrainingSpec(global_batch_size=64, distributed_optimizer=True)
    every = search(model, cluster("table1-2vendor"), training, top_k=50)
    assert "selective" in {s.recompute for p in every.plans + every.pareto for s in p.stages}
    binary = search(model, cluster("table1-2vendor"), training, top_k=50,
                    space=SearchSpace(recompute_levels=("none", "full")))
    assert {s.recompute.split(":")[0] for p in binary.plans + binary.pareto for s in p.stages} <= {"none", "full"}


def test_a_stage_that_needs_full_recompute_recomputes_only_the_layers_it_must():
    """Megatron's block method in the search: the fewest first layers at full recompute that let
    the stage fit; memx-run's searches keep one level per stage."""
    model, c = get_model("llama2-7b"), cluster("table1-2vendor")
    training = TrainingSpec(global_batch_size=64)
    space = SearchSpace(recompute_levels=("none", "full"), schedules=("1f1b",))
    some = search(model, c, training, space=space, top_k=50)
    partial = [(p, s) for p in some.plans for s in p.stages if s.recompute.startswith("full:")]
    assert partial, "no plan recomputes part of a stage"
    for plan, stage in partial:
        k = int(stage.recompute.split(":")[1])
        assert 0 < k < stage.num_layers
        assert stage.predicted_peak_memory_gib <= stage.memory_capacity_gib
        # One layer fewer at full recompute would not fit.
        fewer = evaluate_layout(model, c, training, tp=plan.tp, pp=plan.pp, dp=plan.dp,
                                micro_batch_size=plan.micro_batch_size,
                                layers_per_stage=[s.num_layers for s in plan.stages],
                                stage_devices=[s.device_type for s in plan.stages],
                                recompute=[s.recompute if s is not stage else f"full:{k - 1}" for s in plan.stages],
                                references=(1.0, 1.0, 1.0))
        index = plan.stages.index(stage)
        assert fewer.stages[index].predicted_peak_memory_gib > stage.memory_capacity_gib
        whole = evaluate_layout(model, c, training, tp=plan.tp, pp=plan.pp, dp=plan.dp,
                                micro_batch_size=plan.micro_batch_size,
                                layers_per_stage=[s.num_layers for s in plan.stages],
                                stage_devices=[s.device_type for s in plan.stages],
                                recompute=[s.recompute.split(":")[0] for s in plan.stages],
                                references=(1.0, 1.0, 1.0))
        assert whole.stages[index].predicted_stage_time_s > stage.predicted_stage_time_s
    levels = SearchSpace(recompute_levels=("none", "full"), schedules=("1f1b",), recompute_some_layers=False)
    whole_only = search(model, c, training, space=levels, top_k=50)
    assert all(":" not in s.recompute for p in whole_only.plans + whole_only.pareto for s in p.stages)
    # A larger space never has a slower fastest plan (the default pick may trade up to 5% of time).
    assert some.fastest.predicted_iteration_time_s <= whole_only.fastest.predicted_iteration_time_s


def test_restrictions_bound_every_plan():
    space = SearchSpace(tp_degrees=(2,), pipeline_degrees=(10,), micro_batch_sizes=(1, 2), schedules=("1f1b",),
                        recompute_levels=("full",))
    result = search(get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(global_batch_size=64), space=space,
                    top_k=20)
    for plan in result.plans + result.pareto:
        assert (plan.tp, plan.pp, plan.schedule) == (2, 10, "1f1b") and plan.micro_batch_size in (1, 2)
        assert {s.recompute for s in plan.stages} == {"full"}
    with pytest.raises(ConfigError, match="--schedules"):
        search(get_model("llama2-7b"), cluster("paper-20gpu"), TrainingSpec(), space=SearchSpace(schedules=("x",)))


def test_fewer_micro_batches_than_stages_are_searched_and_stay_physical():
    model, c = get_model("llama2-7b"), cluster("paper-20gpu")
    training = TrainingSpec(global_batch_size=4, distributed_optimizer=True)
    space = SearchSpace(pipeline_degrees=(10, 20), micro_batch_sizes=(1, 2, 4))
    result = search(model, c, training, space=space, top_k=200)
    few = [p for p in result.plans if p.num_microbatches < p.pp]
    assert few
    for plan in few:
        times = [s.predicted_stage_time_s for s in plan.stages]
        # One micro-batch crosses every stage; G of them pass the slowest stage one after another.
        assert plan.predicted_iteration_time_s >= sum(times)
        assert plan.predicted_iteration_time_s >= plan.num_microbatches * max(times)
    runtime_space = SearchSpace(pipeline_degrees=(10, 20), micro_batch_sizes=(1, 2, 4),
                                fewer_microbatches_than_stages=False)
    with pytest.raises(ConfigError, match="fewer micro-batches than pipeline stages"):  # pp >= 10 > G = 4
        search(model, c, training, space=runtime_space)


@pytest.mark.parametrize("seed", range(3))
def test_estimated_time_covers_one_micro_batch_path_when_g_below_p(seed):
    rng = np.random.default_rng(seed)
    model, c = get_model("llama2-7b"), cluster("paper-20gpu")
    for _ in range(4):
        pp, g = int(rng.choice([5, 10])), int(rng.integers(1, 5))
        tp, dp = (2, 20 // (2 * pp)) if pp == 5 else (1, 2)
        plan = evaluate_layout(model, c, TrainingSpec(global_batch_size=g * dp, distributed_optimizer=True), tp=tp,
                               pp=pp, dp=dp, micro_batch_size=1, recompute="full", references=(1, 1, 1))
        times = [s.predicted_stage_time_s for s in plan.stages]
        assert plan.num_microbatches == g < pp
        assert plan.predicted_iteration_time_s >= sum(times) + (g - 1) * max(times)
        assert [s.num_layers for s in plan.stages][0] >= [s.num_layers for s in plan.stages][-1]  # even split
