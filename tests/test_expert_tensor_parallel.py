"""Expert tensor parallelism (``--expert-tensor-parallel``, Megatron's
``--expert-tensor-parallel-size``): each routed expert's MLP split over ETP ranks, what a rank
holds and shards, the gathered tokens it keeps, its collectives, what is refused and the
Megatron export. No processes."""

import dataclasses

import pytest
from one_node import H100
from test_experts import H100_GEMM, NODE, QWEN3, _estimate, _training

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning import experts
from memx_launch.planning.activations import activation_bytes
from memx_launch.planning.collectives import NVLINK, collective_seconds

GIB = 2**30


def test_a_rank_holds_its_share_of_each_expert_and_shards_the_state_over_the_rest():
    plain, split, spread = (_estimate(QWEN3, _training(expert_parallel=ep, expert_tensor_parallel=etp))
                            .stages[0].memory_parts_gib for ep, etp in ((4, 1), (4, 2), (8, 1)))
    experts_gib = QWEN3.num_layers * QWEN3.expert_params / GIB
    # bf16 weights and fp32 main grads: a quarter of the experts at EP 4, half of each of them at ETP 2.
    assert plain["parameters"] - split["parameters"] == pytest.approx(2 * experts_gib / 8)
    assert plain["gradients"] - split["gradients"] == pytest.approx(4 * experts_gib / 8)
    # EP 4 x ETP 2 holds as many expert bytes as EP 8, and shards their Adam states over the same one rank.
    for part in ("parameters", "gradients", "optimizer_states"):
        assert split[part] == pytest.approx(spread[part])


def test_the_gathered_tokens_are_kept_and_their_collectives_timed():
    tokens, k, h = 4096, QWEN3.experts_per_token, QWEN3.hidden_size
    kept = [float(activation_bytes(QWEN3, 1, tokens, 1, cm.NONE, expert_tp=etp).activation_bytes) for etp in (1, 2)]
    # Each routed copy's dispatched token, gathered from the other rank of the pair: 2 bytes x h more.
    assert kept[1] - kept[0] == pytest.approx(tokens * k * h * 2 * (2 - 1))
    split = _training(expert_parallel=4, expert_tensor_parallel=2)
    model = cm.AnalyticalCostModel(QWEN3, NODE, split)
    gathered = tokens * k * 2 * h * 2
    link = (2, 450 * NODE.link_efficiency, 1, NVLINK)
    assert float(model.expert_tp_seconds(tokens, 1, 0)) == pytest.approx(
        2 * float(collective_seconds("all_gather", gathered, *link) + collective_seconds("reduce_scatter", gathered,
                                                                                           *link)))
    assert float(cm.AnalyticalCostModel(QWEN3, NODE, _training(expert_parallel=8)).expert_tp_seconds(tokens, 1, 0)) == 0
    # Beside EP 4 alone: the experts' GEMMs at ETP x the rows and 1 / ETP of the width, and the collectives.
    whole = _training(expert_parallel=4)
    # The device's times (the host's for 32 local experts' ops at EP 4 would hide them).
    split_s, whole_s = (float(cm.AnalyticalCostModel(QWEN3, NODE, t).layer_costs(0, 1, 1, tokens, cm.NONE, host=False)
                              .time_s) for t in (split, whole))
    gemms = [float(sum(experts.expert_seconds(QWEN3, t, tokens, 1, *H100_GEMM))) for t in (split, whole)]
    assert split_s - whole_s == pytest.approx(gemms[0] - gemms[1] + float(model.expert_tp_seconds(tokens, 1, 0)),
                                              rel=1e-6)


def test_what_expert_tensor_parallelism_refuses_and_the_export_builds():
    from test_exporters import _megatron_config

    from memx_launch.planning.exporters import megatron_args

    with pytest.raises(ConfigError, match="--expert-tensor-parallel: 2, but llama2-7b has no experts"):
        experts.check(dataclasses.replace(QWEN3, name="llama2-7b", num_experts=0, experts_per_token=0,
                                          expert_ffn_hidden_size=0), _training(expert_tensor_parallel=2))
    with pytest.raises(ConfigError, match="--expert-tensor-parallel: 5 does not divide an expert's width 768"):
        experts.check(QWEN3, _training(expert_tensor_parallel=5))
    with pytest.raises(ConfigError, match="--expert-parallel: 8 x --expert-tensor-parallel 2 does not divide a "
                                          "stage's TP x CP x DP = 8 ranks"):
        _estimate(QWEN3, _training(expert_parallel=8, expert_tensor_parallel=2))
    plan = _estimate(dataclasses.replace(QWEN3, num_layers=4, name="qwen3-moe-small"),
                     _training(expert_parallel=2, expert_tensor_parallel=2), tp=2, dp=4)
    config = _megatron_config(plan, megatron_args(plan).args)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 2)


def test_memx_plan_searches_the_expert_tensor_parallel_degree_unless_given(tmp_path, capsys):
    from estimates import cluster_file
    from test_experts import MIXTRAL, TWO_NODES

    from memx_launch.cli import main
    from memx_launch.planning.plan import Plan
    from memx_launch.planning.search import search
    from memx_launch.planning.search_space import SearchSpace
    from memx_launch.specs.catalog import get_model

    # Powers of two dividing an expert's width, inside the smallest node (8 devices here).
    assert experts.search_tensor_degrees(MIXTRAL, TWO_NODES) == (1, 2, 4, 8)
    odd = dataclasses.replace(QWEN3, expert_ffn_hidden_size=4 * 193)
    assert experts.search_tensor_degrees(odd, TWO_NODES) == (1, 2, 4)
    assert experts.search_tensor_degrees(get_model("llama2-7b"), TWO_NODES) == ()
    # Each EP x ETP pair scored on the layouts it divides; at EP 8 on 16 devices, ETP 2 opens TP 2 x DP 8.
    result = search(MIXTRAL, TWO_NODES, _training(global_batch_size=128), top_k=30,
                    space=SearchSpace(micro_batch_sizes=(1,), expert_degrees=(8,), expert_tensor_degrees=(1, 2)))
    pairs = {(p.training["expert_parallel"], p.training["expert_tensor_parallel"]) for p in result.plans}
    assert pairs == {(8, 1), (8, 2)}
    assert all(p.tp * p.dp % (ep * etp) == 0 for p in result.plans
               for ep, etp in [(p.training["expert_parallel"], p.training["expert_tensor_parallel"])])
    path = cluster_file(tmp_path, {"version": 1, "name": "two", "device_types": {"gpu": H100},
                                   "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 450}] * 2,
                                   "inter_node_gbps": 50})
    args = ["plan", "--model", "mixtral-8x7b", "--cluster", path, "--global-batch-size", "128", "--seq-len", "4096",
            "--setup", "megatron", "--micro-batch-sizes", "1", "--expert-parallel", "8", "--quiet", "--top", "20"]
    assert main([*args, "--json", str(tmp_path / "searched.json")]) == 0
    out = capsys.readouterr().out
    searched = Plan.load(str(tmp_path / "searched.json")).training["expert_tensor_parallel"]
    assert " etp=" in out and (searched == 1 or f"etp={searched}" in out)
    assert main([*args, "--expert-tensor-parallel", "1", "--json", str(tmp_path / "given.json")]) == 0
    assert " etp=" not in capsys.readouterr().out
    assert Plan.load(str(tmp_path / "given.json")).training["expert_tensor_parallel"] == 1


def test_plans_that_differ_only_in_their_expert_or_shard_degrees_are_different_plans():
    from types import SimpleNamespace

    import numpy as np

    from memx_launch.planning.search import _plan_key

    layout = SimpleNamespace(stage_tp=np.array([1]), cp=1, stage_dps=np.array([16]), order=(0,))
    keys = {_plan_key(SimpleNamespace(layout=layout, mbs=1, seq=4096, schedule="1f1b", v=1, levels=np.zeros((1, 1)),
                                      layers=np.full((1, 1), 4), experts=pair, shard_degree=shards), 0)
            for pair in ((8, 1), (8, 2), (16, 1)) for shards in (None, 8)}
    assert len(keys) == 6  # the top-k list keeps each, where it had kept the best of them alone
