"""Parallel attention + MLP blocks (GPT-J, GPT-NeoX/Pythia, Falcon, PaLM): one norm whose output
both read, one TP all-reduce each way; read from Hugging Face configs, a flag and a --cases
column. No torch."""

import json
from dataclasses import replace

import pytest

from memx_launch.cli import main
from memx_launch.planning import costmodel as cm
from memx_launch.planning.elementwise import elementwise_traffic_bytes
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec, get_model
from memx_launch.specs.training import TrainingSpec

GPTJ = get_model("gpt-j-6b")
SEQUENTIAL = replace(GPTJ, parallel_blocks=False)
CLUSTER_DICT = {"version": 1, "name": "a100x8",
                "device_types": {"gpu": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312,
                                         "memory_bandwidth_gbps": 2039, "compute_capability": 8.0}},
                "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 300}]}
CLUSTER = ClusterSpec.from_dict(CLUSTER_DICT)


def test_the_catalog_and_hugging_face_configs_say_which_blocks_are_parallel():
    assert GPTJ.parallel_blocks and GPTJ.total_params == pytest.approx(6.05e9, rel=0.01)  # GPT-J-6B
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256,
            "vocab_size": 100, "hidden_act": "gelu"}
    neox = ModelSpec.from_hf_dict({**base, "model_type": "gpt_neox", "use_parallel_residual": True}, "n")
    serial_neox = ModelSpec.from_hf_dict({**base, "model_type": "gpt_neox", "use_parallel_residual": False}, "s")
    falcon = ModelSpec.from_hf_dict({**base, "model_type": "falcon"}, "f")  # parallel_attn defaults on
    llama = ModelSpec.from_hf_dict({**base, "model_type": "llama", "hidden_act": "silu"}, "l")
    gptj = ModelSpec.from_hf_dict({"model_type": "gptj", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                   "vocab_size": 100}, "j")
    assert [m.parallel_blocks for m in (neox, serial_neox, falcon, llama, gptj)] == [True, False, True, False, True]
    # One norm per block, not two.
    assert SEQUENTIAL.layer_params - GPTJ.layer_params == GPTJ.norm_params


def test_one_norm_one_all_reduce_each_way_and_the_same_flops():
    training = TrainingSpec(global_batch_size=64, seq_len=2048)
    parallel, sequential = (cm.AnalyticalCostModel(m, CLUSTER, training).layer_costs(0, 4, 1, 2048, cm.NONE)
                            for m in (GPTJ, SEQUENTIAL))
    # Kept: one norm input and one normed tensor fewer (2 bytes of s x h each, replicated over TP).
    sh = 2048 * GPTJ.hidden_size
    assert sequential.activation_bytes - parallel.activation_bytes == pytest.approx(2 * 2 * sh)
    # Element-wise: one norm's passes fewer.
    fewer = (elementwise_traffic_bytes(SEQUENTIAL, training, 1, 2048, 4, cm.NONE)
             - elementwise_traffic_bytes(GPTJ, training, 1, 2048, 4, cm.NONE))
    assert fewer == pytest.approx(sh * (2 + 4) * 2)  # a fused norm: 2d forward, 4d backward
    # TP 4: two all-reduces of the block's s x h instead of four.
    model = cm.AnalyticalCostModel(GPTJ, CLUSTER, training)
    allreduce = float(model.tp_allreduce_time(sh * 2, 0, 4))
    assert sequential.time_s - parallel.time_s == pytest.approx(
        2 * allreduce + fewer / (2039e9), rel=0.05)
    # TP 1: no communication; only the norm's passes differ.
    one = [cm.AnalyticalCostModel(m, CLUSTER, training).layer_costs(0, 1, 1, 2048, cm.NONE).time_s
           for m in (GPTJ, SEQUENTIAL)]
    assert 0 < one[1] - one[0] < 0.01 * one[1]


def test_flag_and_cases_column(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(CLUSTER_DICT))
    base = ["--model", "gpt-j-6b", "--cluster", str(path), "--global-batch-size", "64", "--seq-len", "2048"]
    layout = ["--tp", "4", "--pp", "1", "--dp", "2", "--micro-batch-size", "1"]
    times = {}
    for name, flag in (("parallel", []), ("sequential", ["--no-parallel-blocks"])):
        assert main(["estimate", *base, *layout, *flag, "--json", str(tmp_path / f"{name}.json")]) == 0
        plan = json.loads((tmp_path / f"{name}.json").read_text())
        times[name] = plan["predicted_iteration_time_s"]
        assert plan["model_spec"]["parallel_blocks"] == (name == "parallel")
    assert times["parallel"] < times["sequential"]
    assert any("parallel blocks" in n for n in megatron_args(Plan.load(str(tmp_path / "parallel.json"))).notes)
    assert not any("parallel blocks" in n for n in megatron_args(Plan.load(str(tmp_path / "sequential.json"))).notes)
    cases = tmp_path / "cases.csv"
    cases.write_text("id,tp,pp,dp,micro_batch_size,parallel_blocks\np,4,1,2,1,\ns,4,1,2,1,false\n")
    capsys.readouterr()
    assert main(["estimate", *base, "--cases", str(cases)]) == 0
    rows = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["p"]["iteration_time_s"] == pytest.approx(times["parallel"])
    assert rows["s"]["iteration_time_s"] == pytest.approx(times["sequential"])
