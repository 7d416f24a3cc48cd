"""Hybrid sharding (``--shard-degree N``: HSDP, MiCS, Megatron's partial distributed optimizer):
the states of a shard group of N ranks, its collectives on its own links, each reduced shard
all-reduced over the DP / N replicas; the search, the estimate, the exports and memx-run's refusals.
(The runtime's HSDP trains as the single-process reference: tests/test_runtime.py.) No torch."""

import dataclasses
import json
import re

import numpy as np
import pytest
from estimates import cases_rows, cluster_file

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning import hybrid_sharding
from memx_launch.planning.collectives import NVLINK, collective_seconds
from memx_launch.planning.data_parallel import stage_gradient_sync
from memx_launch.planning.config_exports import deepspeed_json, torchtitan_toml
from memx_launch.planning.estimate import LayoutScorer, evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.plan import Plan
from memx_launch.planning.report import crossing_lines
from memx_launch.planning.runtime_support import check_runnable
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.planning.shard_hint import hybrid_sharding_hint, node_shard_degree
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
STATES = ("parameters", "gradients", "optimizer_states")


def dgx(nodes: int) -> dict:
    return {"version": 1, "name": f"dgx-{nodes}",
            "device_types": {"a100": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312,
                                      "memory_bandwidth_gbps": 2039, "compute_capability": 8.0}},
            "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300, "nics": 8}] * nodes, "inter_node_gbps": 25}


def plan_of(nodes: int, dp: int, pp: int = 1, **training):
    options = dict(global_batch_size=2 * dp, seq_len=2048, setup="fsdp2") | training
    return evaluate_layout(MODEL, ClusterSpec.from_dict(dgx(nodes)), TrainingSpec(**options), tp=1, pp=pp, dp=dp,
                           micro_batch_size=1, references=(1, 1, 1))


def sync_of(nodes: int, dp: int, **training) -> float:
    """The first of two pipelined stages' gradient sync a step (FSDP2 under torch's pipelining reduces
    once a step), its gathers fully exposed."""
    cluster = ClusterSpec.from_dict(dgx(nodes))
    spec = TrainingSpec(**dict(global_batch_size=8 * dp, seq_len=2048, setup="fsdp2") | training)
    result, evaluator = LayoutScorer(MODEL, cluster, spec).score(tp=1, pp=2, dp=dp, micro_batch_size=1)
    layout, params = result.layout, np.full((1, 2), MODEL.total_params / 2)
    _, sync = stage_gradient_sync(MODEL, spec, layout, result.layers[:1], 1, params, np.zeros((1, 2)),
                                  layout.dp_gbps * cluster.link_efficiency, 0.0, shards=evaluator.shard_links.of(layout))
    return sync[0, 0]


@pytest.mark.parametrize("setup", ["fsdp2", "zero3", "zero1", "megatron"])
def test_a_rank_keeps_the_states_of_a_dp_group_as_large_as_its_shard_group(setup):
    hybrid = plan_of(8, 64, shard_degree=8, setup=setup)  # 8 replicas of a node's shard group
    alone = plan_of(1, 8, setup=setup)
    for part in STATES:
        assert hybrid.stages[0].memory_parts_gib[part] == pytest.approx(alone.stages[0].memory_parts_gib[part])
    whole = plan_of(8, 64, setup=setup)
    assert sum(whole.stages[0].memory_parts_gib[p] for p in STATES) < \
        sum(hybrid.stages[0].memory_parts_gib[p] for p in STATES)


def test_a_shard_group_of_the_whole_dp_group_is_plain_full_sharding():
    for pp in (1, 2):
        assert plan_of(4, 32 // pp, pp, shard_degree=32 // pp).predicted_iteration_time_s == \
            pytest.approx(plan_of(4, 32 // pp, pp).predicted_iteration_time_s)


def test_each_reduced_shard_is_all_reduced_over_the_replicas_on_their_links():
    # A stage on two nodes, HSDP over shard groups of 8: each node's gathers and reduce-scatter as on
    # one node's stage, and the all-reduce of each rank's 1/8 of the fp32 gradients with its peer on
    # the other node, on its NIC: one unit at a time, their sum about one all-reduce of the whole shard
    # (bandwidth-bound) and a latency per unit more.
    hybrid, one_node = sync_of(4, 16, shard_degree=8), sync_of(2, 8)
    cluster = ClusterSpec.from_dict(dgx(4))
    params = MODEL.total_params / 2 / 8  # the stage's half of the model, a rank's shard of it
    replica_link = cluster.group_gbps([0, 8]) * cluster.link_efficiency
    all_reduce = collective_seconds("all_reduce", params * 4, 2, replica_link, 2, NVLINK)
    assert hybrid - one_node == pytest.approx(all_reduce, rel=0.05)
    assert hybrid - one_node > all_reduce


def test_deepspeed_mics_keeps_its_per_linear_gathers_inside_a_node_at_scale():
    # At 1,536 ranks each of DeepSpeed's per-linear all-gathers pays a ring's latency over 192 nodes;
    # MiCS over a node pays 8 ranks' over NVLink, and an all-reduce of the shards once per bucket.
    def step(**options):
        return plan_of(192, 1536, **options, setup="zero3", max_live_params=1e9).predicted_iteration_time_s
    assert step(shard_degree=8) < 0.8 * step()


def test_the_flag_refuses_what_it_cannot_mean():
    for options, says in (({"setup": "ddp"}, "shards none"), ({"setup": "scaling"}, "full_gradient_allreduce"),
                          ({"setup": "zero3", "max_live_params": 1e9, "hpz_partition_size": 8}, "not both"),
                          ({"setup": "fsdp2", "shard_degree": 0}, "--shard-degree")):
        with pytest.raises(ConfigError, match=says) as info:
            TrainingSpec(**{"shard_degree": 8} | options)
        assert info.value.field == "--shard-degree"
    with pytest.raises(ConfigError, match="not a multiple"):
        plan_of(2, 4, 4, shard_degree=8)
    # A shard group of 4 ranks cannot hold whole expert-parallel groups of 8.
    with pytest.raises(ConfigError, match="whole expert groups") as info:
        mixtral_plan(2, 16, shard_degree=4)
    assert info.value.field == "--shard-degree"


MIXTRAL = get_model("mixtral-8x7b")


def mixtral_plan(nodes: int, dp: int, tp: int = 1, ep: int = 8, **training):
    options = dict(global_batch_size=2 * dp, seq_len=2048, setup="megatron", distributed_optimizer=True,
                   expert_parallel=ep) | training
    return evaluate_layout(MIXTRAL, ClusterSpec.from_dict(dgx(nodes)), TrainingSpec(**options), tp=tp, pp=1, dp=dp,
                           micro_batch_size=1, references=(1, 1, 1))


@pytest.mark.parametrize("setup", ["megatron", "fsdp2"])
def test_a_mixture_keeps_the_dense_and_expert_states_of_one_shard_group(setup):
    # Megatron's optimizer instances split the expert data parallel group as they split DP: 64 ranks
    # in 8 instances of a node keep, dense and routed, what 8 ranks on one node keep (EP 8: a node's
    # experts sharded over nobody, so both runs keep them whole; EP 4: over the node's 2 EP groups).
    for ep in (8, 4):
        hybrid = mixtral_plan(8, 64, ep=ep, setup=setup, shard_degree=8)
        alone = mixtral_plan(1, 8, ep=ep, setup=setup)
        for part in STATES:
            assert hybrid.stages[0].memory_parts_gib[part] == pytest.approx(alone.stages[0].memory_parts_gib[part])
        whole = mixtral_plan(8, 64, ep=ep, setup=setup)
        assert sum(whole.stages[0].memory_parts_gib[p] for p in STATES) < \
            sum(hybrid.stages[0].memory_parts_gib[p] for p in STATES)


def test_a_mixture_s_expert_shards_are_all_reduced_over_the_replicas_too():
    # Two nodes of 8 instances each against one node: the difference is the replicas' all-reduce of
    # each rank's dense shard (1/8 of the dense gradients) and its expert shard (EP 4: the local
    # experts' gradients over the node's two EP groups), bucket by bucket.
    def sync(nodes, dp, **options):
        cluster = ClusterSpec.from_dict(dgx(nodes))
        spec = TrainingSpec(global_batch_size=8 * dp, seq_len=2048, setup="megatron", distributed_optimizer=True,
                            expert_parallel=4, **options)
        result, evaluator = LayoutScorer(MIXTRAL, cluster, spec).score(tp=1, pp=1, dp=dp, micro_batch_size=1)
        layout = result.layout
        params = np.full((1, 1), MIXTRAL.total_params - 3 / 4 * MIXTRAL.num_layers * MIXTRAL.expert_params)
        return stage_gradient_sync(MIXTRAL, spec, layout, result.layers[:1], 1, params, np.zeros((1, 1)),
                                   layout.dp_gbps * cluster.link_efficiency, 0.0,
                                   shards=evaluator.shard_links.of(layout))[1][0, 0]
    local_experts = MIXTRAL.num_layers * MIXTRAL.expert_params / 4
    dense = MIXTRAL.total_params - MIXTRAL.num_layers * MIXTRAL.expert_params
    shard_bytes = (dense / 8 + local_experts / 2) * 4  # fp32 gradients
    cluster = ClusterSpec.from_dict(dgx(2))
    replica_link = cluster.group_gbps([0, 8]) * cluster.link_efficiency
    all_reduce = collective_seconds("all_reduce", shard_bytes, 2, replica_link, 2, NVLINK)
    added = sync(2, 16, shard_degree=8) - sync(1, 8)
    assert added == pytest.approx(all_reduce, rel=0.05) and added > all_reduce  # a latency per bucket more


def test_the_search_keeps_the_layouts_it_divides_and_says_when_none():
    cluster = ClusterSpec.from_dict(dgx(2))
    space = SearchSpace(micro_batch_sizes=(1,), recompute_levels=("full",))
    training = TrainingSpec(global_batch_size=64, seq_len=2048, setup="fsdp2", shard_degree=4)
    result = search(MODEL, cluster, training, space=space, top_k=50)
    assert result.plans and all(p.dp % 4 == 0 for p in result.plans)
    assert all(p.training["shard_degree"] == 4 for p in result.plans)
    with pytest.raises(ConfigError, match="divides none") as info:
        search(MODEL, cluster, TrainingSpec(global_batch_size=64, seq_len=2048, setup="fsdp2", shard_degree=3),
               space=space)
    assert info.value.field == "--shard-degree"


def two_vendors(order=("nv", "amd")) -> ClusterSpec:
    """16 GPUs of two vendors (two communication domains), a node of each type in ``order``."""
    a100 = dgx(1)["device_types"]["a100"]
    per_node = 16 // len(order)
    return ClusterSpec.from_dict({"version": 1, "name": "two-vendors", "inter_node_gbps": 25,
                                  "device_types": {"nv": a100, "amd": {**a100, "vendor": "amd"}},
                                  "nodes": [{"devices": {t: per_node}, "intra_node_gbps": 300, "nics": per_node}
                                            for t in order]})


def spanning(cluster, **training):
    """A stage of 16 replicas over both vendors' nodes (its DP group crosses domains)."""
    spec = TrainingSpec(**dict(global_batch_size=32, seq_len=2048, setup="fsdp2") | training)
    return evaluate_layout(MODEL, cluster, spec, tp=1, pp=1, dp=16, micro_batch_size=1, references=(1, 1, 1),
                           stage_devices=["nv+amd"])


def test_a_fully_sharded_dp_group_across_domains_is_sharded_within_each():
    # No library gathers across NCCL and RCCL: each vendor's 8 replicas shard the states among
    # themselves, and each rank all-reduces its reduced shard with its peer over the bridge.
    cluster = two_vendors()
    across, one_node = spanning(cluster), plan_of(1, 8)
    for part in STATES:
        assert across.stages[0].memory_parts_gib[part] == pytest.approx(one_node.stages[0].memory_parts_gib[part])
    assert spanning(cluster, shard_degree=8).predicted_iteration_time_s == \
        pytest.approx(across.predicted_iteration_time_s)
    # A rank's fp32 shard, 1/8 of its gradients, crosses to its one peer: as many bytes as the
    # hierarchical all-reduce of whole gradients sends (its reduce-scatter leaves each rank 1/8 too).
    [crossing] = across.crossings
    assert crossing.kind == "data_parallel"
    assert crossing.bytes_per_step == pytest.approx(MODEL.total_params * 4 / 8, rel=0.01)
    assert crossing.bytes_per_step == pytest.approx(spanning(cluster, setup="ddp").crossings[0].bytes_per_step)
    smaller = spanning(cluster, shard_degree=4)  # two shard groups a vendor: their replicas sum natively first
    assert smaller.stages[0].memory_parts_gib["optimizer_states"] == pytest.approx(
        2 * across.stages[0].memory_parts_gib["optimizer_states"])
    with pytest.raises(ConfigError, match="span communication domains"):
        spanning(cluster, shard_degree=16)
    # A group of 7 + 1 ranks has no two consecutive ranks in one domain at every step of two: shard
    # groups of one, its states whole (memx-run averages it whole), 8 x those sharded within a vendor.
    def two_stages(*devices):
        return evaluate_layout(MODEL, cluster, TrainingSpec(global_batch_size=32, seq_len=2048, setup="fsdp2"), tp=1,
                               pp=2, dp=8, micro_batch_size=1, references=(1, 1, 1), stage_devices=list(devices))
    seven_one, by_vendor = two_stages("nv*7+amd*1", "nv*1+amd*7"), two_stages("nv", "amd")
    assert seven_one.stages[0].memory_parts_gib["optimizer_states"] == \
        pytest.approx(8 * by_vendor.stages[0].memory_parts_gib["optimizer_states"])
    # The plan records how each group keeps its states (a file round trip keeps it), and says so.
    assert crossing.shard_ranks == 8
    assert {c.shard_ranks for c in seven_one.crossings if c.kind == "data_parallel"} == {1}
    assert spanning(cluster, setup="ddp").crossings[0].shard_ranks is None
    assert Plan.from_dict(json.loads(json.dumps(across.to_dict()))).crossings == across.crossings
    assert "DP sync of stage 0 (nccl | rccl), sharded within each domain over 8 ranks:" in \
        "\n".join(crossing_lines(across, cluster))
    assert all(", its states whole:" in line for line in crossing_lines(seven_one, cluster) if "DP sync" in line)
    assert not any("sharded within" in line for line in crossing_lines(spanning(cluster, setup="ddp"), cluster))


def test_shard_groups_within_domains_are_the_most_consecutive_replicas_in_one():
    degree = hybrid_sharding.domain_shard_degree
    assert degree(["a"] * 8, 8) == 8 and degree(["a"] * 8, 8, given=4) == 4 and degree(["a"] * 8, 8, given=3) == 0
    assert degree(["a", "a", "b", "b"], 4) == 2 and degree(["a", "a", "a", "a", "b", "b"], 6) == 2
    assert degree(["a", "b", "a", "b"], 4) == 1 and degree(["a", "b", "a", "b"], 4, given=2) == 0
    assert degree(["a", "a", "a", "b"], 4) == 1
    # With CP, a shard group is N replicas' CP ranks: replica after replica, CP rank after CP rank.
    assert degree(["a", "a", "a", "a", "b", "b", "b", "b"], 4, cp=2) == 2


def test_exports_write_each_framework_s_hybrid_sharding():
    plan = plan_of(8, 64, shard_degree=8)
    toml = torchtitan_toml(plan).text
    assert "data_parallel_replicate_degree = 8" in toml and "data_parallel_shard_degree = 8" in toml
    assert "data_parallel_shard_degree = 64" in torchtitan_toml(plan_of(8, 64)).text
    args = megatron_args(plan, None).command_line()
    assert "--num-distributed-optimizer-instances 8" in args
    assert "--num-distributed-optimizer-instances" not in megatron_args(plan_of(8, 64), None).command_line()
    assert "--num-distributed-optimizer-instances 4" in \
        megatron_args(plan_of(8, 64, setup="megatron", shard_degree=16), None).command_line()
    mics = plan_of(8, 64, setup="zero3", shard_degree=8)
    assert '"mics_shard_size": 8' in deepspeed_json(mics).text
    with pytest.raises(ConfigError, match="ZeRO-3 only"):
        deepspeed_json(plan_of(8, 64, setup="zero1", shard_degree=8))
    experts = mixtral_plan(8, 64, shard_degree=8)
    assert "--num-distributed-optimizer-instances 8" in megatron_args(experts, None).command_line()
    with pytest.raises(ConfigError, match="DeepSpeed's MoE layers refuse ZeRO-3"):  # its engine asserts it
        deepspeed_json(mixtral_plan(8, 64, setup="zero3", shard_degree=8))
    # Hugging Face's Mixtral under ZeRO-3 has no DeepSpeed MoE layer: its experts whole, MiCS as for a dense model.
    assert '"mics_shard_size": 8' in deepspeed_json(mixtral_plan(8, 64, ep=1, setup="zero3", shard_degree=8)).text


def test_memx_run_runs_hybrid_sharding_with_fsdp2_only():
    check_runnable(plan_of(2, 16, setup="memx-run", fully_sharded=True, hold_gathered="always", shard_degree=8))
    with pytest.raises(ConfigError, match="FSDP2 only"):
        check_runnable(plan_of(2, 16, setup="zero1", shard_degree=8))


def test_it_is_a_cases_column(tmp_path, capsys):
    base = ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, dgx(4)), "--global-batch-size", "64",
            "--seq-len", "2048", "--setup", "fsdp2"]
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,shard_degree\n"
                      "whole,1,1,32,1,\nnode,1,1,32,1,8\n", base)
    assert rows["node"]["peak_memory_gib"] > rows["whole"]["peak_memory_gib"]
    assert rows["node"]["iteration_time_s"] != rows["whole"]["iteration_time_s"]


def test_shard_groups_are_consecutive_replicas_and_replica_groups_strided():
    cluster = ClusterSpec.from_dict(dgx(4))
    layout = LayoutScorer(MODEL, cluster, TrainingSpec(global_batch_size=64, seq_len=2048))
    plan = layout.score(tp=2, pp=1, dp=16, micro_batch_size=1)[0].layout
    groups = hybrid_sharding.shard_groups(cluster, plan, TrainingSpec(setup="fsdp2", shard_degree=4))
    # DP groups are every 2nd rank; 4 consecutive replicas of one (ranks 0, 2, 4, 6) fill a node.
    assert groups.ranks.tolist() == [4] and groups.replicas.tolist() == [4]
    assert groups.nodes.tolist() == [1] and groups.replica_nodes.tolist() == [4]
    assert groups.gbps[0] == cluster.group_gbps([0, 2, 4, 6]) * cluster.link_efficiency
    assert groups.replica_gbps[0] == cluster.group_gbps([0, 8, 16, 24]) * cluster.link_efficiency


def test_the_search_tries_shard_degrees_beside_the_whole_group_and_keeps_the_chosen_one():
    # OPT-350M's small blocks on 768 GPUs: FSDP's per-block gathers over 96 nodes are latency-bound,
    # a node's shard group gathers them over NVLink (zero3_fetch_cost.json: 0.54x the step).
    model, cluster = get_model("opt-350m"), ClusterSpec.from_dict(dgx(96))
    training = TrainingSpec(global_batch_size=768, seq_len=2048, setup="zero3", max_live_params=0)
    space = dict(tp_degrees=(1,), pipeline_degrees=(1,), micro_batch_sizes=(1,), recompute_levels=("full",))
    whole = search(model, cluster, training, space=SearchSpace(**space), top_k=5)
    both = search(model, cluster, training, space=SearchSpace(**space, shard_degrees=(8,)), top_k=5)
    assert whole.fastest.training["shard_degree"] is None
    assert both.fastest.training["shard_degree"] == 8
    assert both.fastest.predicted_iteration_time_s < 0.8 * whole.fastest.predicted_iteration_time_s
    assert both.stats.evaluated == 2 * whole.stats.evaluated  # each layout at both degrees
    with pytest.raises(ConfigError, match="--shard-degrees"):
        SearchSpace(shard_degrees=(0,)).check(MODEL)


def test_memx_plan_says_what_hybrid_sharding_over_a_node_would_do_when_it_did_not_search_it(tmp_path, capsys):
    # OPT-350M's FSDP units over 768 GPUs: latency-bound gathers over 96 nodes, within a node over NVLink.
    argv = ["plan", "--model", "opt-350m", "--cluster", cluster_file(tmp_path, dgx(96)), "--setup", "zero3",
            "--max-live-params", "0", "--global-batch-size", "768", "--seq-len", "2048", "--tp", "1", "--pp", "1",
            "--micro-batch-sizes", "1", "--recompute-levels", "full", "--quiet"]
    assert main(argv) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hybrid sharding")]
    assert len(hint) == 1 and "shard groups of 8 replicas" in hint[0] and hint[0].endswith("--shard-degrees 8 searches it")
    assert -60 < int(re.search(r"s \(([-+]\d+)%\)", hint[0]).group(1)) <= -30
    assert main(argv + ["--shard-degrees", "8"]) == 0  # searched: the winner says it (shard=8), no hint
    out = capsys.readouterr().out
    assert "hybrid sharding was not searched" not in out and "shard=8" in out


def test_the_hint_is_said_only_where_it_is_worth_a_line():
    model, cluster = get_model("opt-350m"), ClusterSpec.from_dict(dgx(96))
    zero3 = TrainingSpec(global_batch_size=768, seq_len=2048, setup="zero3", max_live_params=0)
    plan = evaluate_layout(model, cluster, zero3, tp=1, pp=1, dp=768, micro_batch_size=1, recompute="full")
    assert hybrid_sharding_hint(plan, cluster, zero3) is not None
    # Not a sharded setup, or sharded in part already: nothing to say.
    for other in (TrainingSpec(global_batch_size=768, seq_len=2048, setup="ddp"),
                  dataclasses.replace(zero3, shard_degree=8)):
        assert hybrid_sharding_hint(plan, cluster, other) is None
    # LLaMA-2 7B's FSDP units on two nodes: hybrid sharding is not faster (zero3_fetch_cost.json: within 5%).
    assert hybrid_sharding_hint(plan_of(2, 16), ClusterSpec.from_dict(dgx(2)),
                                TrainingSpec(global_batch_size=32, seq_len=2048, setup="fsdp2")) is None


def test_a_node_s_shard_degree_is_its_replicas_of_each_stage_s_tp_x_cp_ranks():
    cluster = ClusterSpec.from_dict(dgx(4))
    assert node_shard_degree(plan_of(4, 32), cluster) == 8
    tp2 = evaluate_layout(MODEL, cluster, TrainingSpec(global_batch_size=32, seq_len=2048, setup="fsdp2"), tp=2, pp=1,
                          dp=16, micro_batch_size=1, references=(1, 1, 1))
    assert node_shard_degree(tp2, cluster) == 4
    assert node_shard_degree(plan_of(1, 8), ClusterSpec.from_dict(dgx(1))) is None  # the whole group is one node
    assert node_shard_degree(spanning(two_vendors()), two_vendors()) is None  # a stage over two device types
