"""Context parallelism: a CP degree in layouts, the search, memx estimate (flag and --cases column),
plan files and the exporters; its physics (seq/cp per rank, attention over the whole sequence,
the K/V ring). No torch."""

import json
import os

import numpy as np
import pytest
from estimates import cases_rows, cluster_file, estimated_plan
from one_node import H100, one_node

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning import context_parallel, costmodel as cm
from memx_launch.planning.config_exports import deepspeed_json, torchtitan_toml
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.launch_lines import plan_env
from memx_launch.planning.layouts import cp_ring_pairs
from memx_launch.planning.plan import Plan
from memx_launch.planning.runtime_support import check_runnable
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
NODE = one_node(H100, 8, 450)
TWO_NODES = {**NODE, "nodes": [NODE["nodes"][0]] * 2, "inter_node_gbps": 50}
REFERENCES = (1.0, 1.0, 1.0)


def _estimate(seq, cp, dp, tp=1, cluster=NODE, setup_name="megatron", **training):
    spec = TrainingSpec(global_batch_size=8, seq_len=seq, setup=setup_name, **training)
    return evaluate_layout(MODEL, ClusterSpec.from_dict(cluster), spec, tp=tp, pp=1, dp=dp, cp=cp,
                           micro_batch_size=1, references=REFERENCES)


def test_a_rank_holds_a_cp_th_of_each_sequence():
    whole, split = _estimate(16384, 1, 8), _estimate(16384, 2, 4)
    assert split.num_microbatches == 2 * whole.num_microbatches  # DP 4: two sequences per replica, not one
    parts, whole_parts = split.stages[0].memory_parts_gib, whole.stages[0].memory_parts_gib
    assert parts["logits_loss"] == pytest.approx(whole_parts["logits_loss"] / 2, rel=1e-9)
    # Kept activations halve; the backward working set grows by the ring's buffers.
    working = context_parallel.ring_working_bytes(MODEL, TrainingSpec(), 1, 16384, 1, 2)
    assert 0.45 < (parts["activations"] - float(working) / cm.GIB) / whole_parts["activations"] < 0.55
    # The weights are replicated over CP: the distributed optimizer shards over DP x CP (8 ranks both).
    assert parts["optimizer_states"] == pytest.approx(whole_parts["optimizer_states"], rel=1e-9)
    assert split.cp == 2 and split.world_size == 8


def test_attention_work_is_conserved_over_the_ring():
    """A rank's attention in its layer time (its own chunk's, and the ring's other cp - 1 steps,
    transfers hidden) over the cp ranks is the whole sequence's attention."""
    cost = cm.AnalyticalCostModel(MODEL, ClusterSpec.from_dict(NODE), TrainingSpec())
    whole = sum(cost.attention_seconds(0, 1, 1, 32768))
    for cp in (2, 4, 8):
        forward, backward = cost.attention_seconds(0, 1, 1, 32768 // cp)
        for all_gather in (False, True):  # Transformer Engine's ring, torch's context_parallel
            ring = context_parallel.layer_seconds(forward, backward, 0.0, 0.0, cp, np.array([False]), all_gather)
            assert cp * float(forward + backward + ring[0]) == pytest.approx(float(whole), rel=1e-12)


def test_ring_transfers_hide_behind_attention_until_they_outlast_it():
    forward, backward, again = 1.0, 2.5, np.array([False, True])  # no recompute, full
    hidden = context_parallel.layer_seconds(forward, backward, 0.5, 0.5, 4, again)
    assert hidden.tolist() == pytest.approx([3 * (1.0 + 2.5), 3 * (2.0 + 2.5)])
    slow = context_parallel.layer_seconds(forward, backward, 3.0, 3.0, 4, again)
    # Forward steps wait 3 - 1 each (twice when recomputed); backward steps carry K, V and their gradients: 6 - 2.5.
    assert slow.tolist() == pytest.approx([3 * (3.5 + 2.0 + 3.5), 3 * (4.5 + 4.0 + 3.5)])
    assert (slow >= hidden).all()


def test_the_ring_runs_again_where_the_recompute_runs_the_attention_again():
    levels = np.array([cm.NONE, cm.SELECTIVE, cm.FULL])
    # Megatron's selective level recomputes the attention core; torchtitan's op-level policy keeps
    # the fused kernel's output; latent attention's default selective module is its up projections.
    assert cm.attention_recomputed(levels, MODEL, TrainingSpec(setup="megatron")).tolist() == [False, True, True]
    assert cm.attention_recomputed(levels, MODEL, TrainingSpec(setup="torchtitan")).tolist() == [False, False, True]
    assert cm.attention_recomputed(levels, get_model("deepseek-v3"), TrainingSpec()).tolist() == [False, False, True]
    assert cm.attention_recomputed(levels, MODEL, TrainingSpec(setup="torchtitan"), flash=False).tolist() == \
        [False, True, True]  # unfused attention has no kept kernel output


def test_a_ring_across_nodes_is_slower_than_one_inside_a_node():
    inside = _estimate(32768, 8, 2, cluster=TWO_NODES)  # each CP group: 8 ranks of one node
    across = _estimate(32768, 16, 1, cluster=TWO_NODES)  # one group over both nodes, the NICs shared
    cluster = ClusterSpec.from_dict(TWO_NODES)
    assert cluster.transfers_gbps(cp_ring_pairs(list(range(16)), 1, 16)) < cluster.transfers_gbps(
        cp_ring_pairs(list(range(8)), 1, 8))
    # The same global batch on the same 16 GPUs: the step whose ring crosses the network is slower.
    assert across.predicted_iteration_time_s > 1.5 * inside.predicted_iteration_time_s


def test_short_chunks_leave_the_ring_exposed():
    """Why the search tries CP only from 4,096 tokens per rank (docs/setups.md)."""
    def slowdown(seq):
        return _estimate(seq, 8, 1).predicted_iteration_time_s / _estimate(seq, 1, 8).predicted_iteration_time_s
    assert slowdown(4096) > 1.10
    assert slowdown(32768) < 1.05


def test_cp_ring_pairs_follow_megatrons_rank_order():
    # tp 2, cp 2, dp 2: replica 0 is ranks 0-3 (TP groups {0,1}, {2,3}); rings 0<->2 and 1<->3.
    assert sorted(cp_ring_pairs(list(range(8)), 2, 2)) == [(0, 2), (1, 3), (2, 0), (3, 1), (4, 6), (5, 7), (6, 4), (7, 5)]


def test_never_faster_than_the_whole_steps_flops_at_peak():
    for seq, cp, dp in ((8192, 2, 4), (32768, 4, 2), (32768, 8, 1)):
        plan = _estimate(seq, cp, dp)
        flops = 6 * 8 * seq * MODEL.total_params + 8 * MODEL.num_layers * 2 * 8 * seq * seq * MODEL.hidden_size
        assert plan.predicted_iteration_time_s >= flops / (8 * 989e12)


def test_communicators_count_the_cp_and_the_dp_x_cp_groups():
    assert cm.communicators_per_rank(1, 1, 4, cp=2) == 3  # world, DP x CP, CP
    assert cm.communicators_per_rank(2, 2, 2, cp=2) == 6  # + TP, PP, model-parallel
    assert cm.communicators_per_rank(1, 1, 8) == 1


def test_the_search_tries_cp_where_the_sequence_is_long():
    assert context_parallel.search_degrees(4096) == (1,)
    assert context_parallel.search_degrees(32768) == (1, 2, 4, 8)
    cluster = ClusterSpec.from_dict(NODE)
    training = TrainingSpec(global_batch_size=16, seq_len=32768, setup="megatron")
    found = search(MODEL, cluster, training, space=SearchSpace(cp_degrees=None), top_k=50)
    plain = search(MODEL, cluster, training, top_k=50)  # the default space keeps CP 1 (memx-run's)
    assert {p.cp for p in plain.plans} == {1}
    assert {p.cp for p in found.plans} & {2, 4, 8} and found.stats.enumerated > plain.stats.enumerated
    assert found.fastest.predicted_iteration_time_s <= plain.fastest.predicted_iteration_time_s
    best = found.best
    assert Plan.from_dict(json.loads(json.dumps(best.to_dict()))).cp == best.cp
    assert all(len(s.ranks) == best.stage_tps[i] * best.cp * best.dp for i, s in enumerate(best.stages))


def test_the_checks_before_the_search_count_cp_layouts():
    """memx-run checks the space before calibrating: a batch only CP layouts can split (their DP is
    smaller) passes the check as it passes the search."""
    from memx_launch.planning.search import check_space

    one_head = ModelSpec("one-head", 1, 64, 1, 1, 176, 128, 128)  # TP 1 and PP 1 only
    cluster = ClusterSpec.from_dict(one_node(H100, 2, 450))
    training = TrainingSpec(global_batch_size=1, seq_len=128)
    cp_only = SearchSpace(cp_degrees=(2,), micro_batch_sizes=(1,))
    check_space(one_head, cluster, training, cp_only)
    assert search(one_head, cluster, training, space=cp_only, top_k=1).best.cp == 2
    with pytest.raises(ConfigError, match="not divisible by DP x micro-batch"):
        check_space(one_head, cluster, training, SearchSpace(micro_batch_sizes=(1,)))


def test_the_papers_cluster_at_32k_tokens_picks_cp_4():
    """What docs/setups.md says `memx plan` picks there."""
    cluster = ClusterSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                                                 "paper-20gpu.yaml"))
    training = TrainingSpec(global_batch_size=16, seq_len=32768, setup="megatron")
    best = search(MODEL, cluster, training, space=SearchSpace(cp_degrees=None), top_k=1).best
    assert (best.cp, best.tp, best.pp) == (4, 1, 5)


def test_plan_cli_restricts_and_refuses_cp_degrees(tmp_path, capsys):
    path = cluster_file(tmp_path, NODE)
    args = ["plan", "--model", "llama2-7b", "--cluster", path, "--seq-len", "32768", "--global-batch-size", "16",
            "--setup", "megatron", "--quiet"]
    assert main([*args, "--cp", "4", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["cp"] == 4
    capsys.readouterr()
    assert main([*args, "--cp", "3"]) != 0
    assert "--cp" in capsys.readouterr().err


def test_estimate_flag_and_cases_column_agree(tmp_path, capsys):
    path = cluster_file(tmp_path, NODE)
    flags = ["--model", "llama2-7b", "--cluster", path, "--seq-len", "16384", "--global-batch-size", "8",
             "--setup", "megatron"]
    plan = estimated_plan(tmp_path, "cp2", [*flags, "--tp", "2", "--pp", "1", "--cp", "2", "--dp", "2",
                                            "--micro-batch-size", "1"])
    assert plan["cp"] == 2 and plan["world_size"] == 8
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,cp,dp\na,2,1,2,2\nb,2,1,,4\n", flags)
    assert rows["a"]["iteration_time_s"] == pytest.approx(plan["predicted_iteration_time_s"], rel=1e-12)
    assert rows["a"]["peak_memory_gib"] == pytest.approx(plan["stages"][0]["predicted_peak_memory_gib"], rel=1e-6)
    assert rows["a"]["num_microbatches"] == 4 and rows["b"]["num_microbatches"] == 2  # an empty cp is 1


@pytest.mark.parametrize("extra, problem", [(["--cp", "3"], "divisible by 2*cp=6"),
                                            (["--cp", "2", "--no-flash-attention"], "needs fused attention"),
                                            (["--cp", "2", "--dp", "8"], "tp*pp*dp*cp = 16"),
                                            (["--cp", "2", "--pp", "2", "--dp", "4", "--stage-dp", "4,2"],
                                             "sum(tp*stage_dp)*cp = 12")])
def test_estimate_refuses_a_cp_it_cannot_price(tmp_path, capsys, extra, problem):
    path = cluster_file(tmp_path, NODE)
    args = ["estimate", "--model", "llama2-7b", "--cluster", path, "--seq-len", "4096", "--tp", "1", "--pp", "1",
            "--micro-batch-size", "1", "--global-batch-size", "8"]
    args += [] if "--dp" in extra else ["--dp", "4"]
    assert main([*args, *extra]) != 0
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1


def test_exports_state_the_cp_degree_and_memx_run_refuses_it():
    plan = _estimate(16384, 2, 4)
    args = megatron_args(plan).args
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert "--context-parallel-size" not in megatron_args(_estimate(16384, 1, 8)).args
    assert "context_parallel_degree = 2" in torchtitan_toml(plan).text
    # Planned with Transformer Engine's ring (megatron); torchtitan runs torch's: the export says so.
    assert any("--cp-all-gather" in note for note in torchtitan_toml(plan).notes)
    as_run = _estimate(16384, 2, 4, setup_name="torchtitan")
    assert not any("--cp-all-gather" in note for note in torchtitan_toml(as_run).notes)
    assert plan_env(plan)["MEMX_CP"] == "2"
    with pytest.raises(ConfigError, match="cp=2"):
        deepspeed_json(plan)
    with pytest.raises(ConfigError, match="no context parallelism"):
        check_runnable(plan)


def test_a_plan_file_without_cp_reads_as_cp_1():
    data = _estimate(4096, 1, 8).to_dict()
    del data["cp"]
    assert Plan.from_dict(data).cp == 1
    data["cp"] = 2  # 8 ranks of tp 1 cannot form cp 2 x dp 8
    with pytest.raises(ConfigError, match="world_size"):
        Plan.from_dict(data)
