"""Parallel attention + MLP blocks (GPT-J, GPT-NeoX/Pythia, Falcon, PaLM): one norm whose output
both read, one TP all-reduce each way; read from Hugging Face configs, a flag and a --cases
column. No torch."""

from dataclasses import replace

import pytest
from estimates import cases_rows, cluster_file, estimated_plan
from one_node import A100, one_node

from memx_launch.planning import costmodel as cm
from memx_launch.planning.elementwise import elementwise_traffic_bytes
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

GPTJ = get_model("gpt-j-6b")
SEQUENTIAL = replace(GPTJ, parallel_blocks=False)
CLUSTER_DICT = one_node(A100, 8, 300)
CLUSTER = ClusterSpec.from_dict(CLUSTER_DICT)


def test_the_catalog_and_hugging_face_configs_say_which_blocks_are_parallel():
    assert GPTJ.parallel_blocks and GPTJ.total_params == pytest.approx(6.05e9, rel=0.01)  # GPT-J-6B
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256,
            "vocab_size": 100, "hidden_act": "gelu"}
    neox = model_from_hf_dict({**base, "model_type": "gpt_neox", "use_parallel_residual": True}, "n")
    serial_neox = model_from_hf_dict({**base, "model_type": "gpt_neox", "use_parallel_residual": False}, "s")
    falcon = model_from_hf_dict({**base, "model_type": "falcon"}, "f")  # parallel_attn defaults on
    llama = model_from_hf_dict({**base, "model_type": "llama", "hidden_act": "silu"}, "l")
    gptj = model_from_hf_dict({"model_type": "gptj", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                   "vocab_size": 100}, "j")
    assert [m.parallel_blocks for m in (neox, serial_neox, falcon, llama, gptj)] == [True, False, True, False, True]
    # GPT-NeoX's blocks normalise with torch's LayerNorm, its linears biased unless attention_bias says not.
    assert (neox.layer_norm, neox.linear_biases) == (True, True)
    assert not model_from_hf_dict({**base, "model_type": "gpt_neox", "attention_bias": False}, "b").linear_biases
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
    base = ["--model", "gpt-j-6b", "--cluster", cluster_file(tmp_path, CLUSTER_DICT), "--global-batch-size", "64",
            "--seq-len", "2048"]
    layout = ["--tp", "4", "--pp", "1", "--dp", "2", "--micro-batch-size", "1"]
    parallel = estimated_plan(tmp_path, "parallel", [*base, *layout])
    sequential = estimated_plan(tmp_path, "sequential", [*base, *layout, "--no-parallel-blocks"])
    assert parallel["model_spec"]["parallel_blocks"] and not sequential["model_spec"]["parallel_blocks"]
    assert parallel["predicted_iteration_time_s"] < sequential["predicted_iteration_time_s"]
    assert any("parallel blocks" in n for n in megatron_args(Plan.load(str(tmp_path / "parallel.json"))).notes)
    assert not any("parallel blocks" in n for n in megatron_args(Plan.load(str(tmp_path / "sequential.json"))).notes)
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,parallel_blocks\np,4,1,2,1,\ns,4,1,2,1,false\n",
                      base)
    assert rows["p"]["iteration_time_s"] == pytest.approx(parallel["predicted_iteration_time_s"])
    assert rows["s"]["iteration_time_s"] == pytest.approx(sequential["predicted_iteration_time_s"])
