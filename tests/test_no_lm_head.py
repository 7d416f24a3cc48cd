"""A model without an LM head (reward, value and classifier models, a base model feeding
another): no output projection, logits, loss or tied copy on the last stage; read from a Hugging
Face config's architectures, a flag and a --cases column. No torch."""

from dataclasses import replace

import pytest
from estimates import cases_rows, cluster_file, estimated_plan
from one_node import A100, one_node

from memx_launch.planning.data_parallel import tied_gradient_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

LLAMA = get_model("llama2-7b")
CLUSTER_DICT = one_node(A100, 4, 300)
CLUSTER = ClusterSpec.from_dict(CLUSTER_DICT)
GIB = 2**30


def test_hugging_face_architectures_name_the_head():
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 172, "vocab_size": 100}
    heads = [model_from_hf_dict({**base, **extra}, "m").lm_head for extra in (
        {}, {"architectures": ["LlamaForCausalLM"]}, {"architectures": ["LlamaForSequenceClassification"]},
        {"architectures": ["LlamaModel"]})]
    assert heads == [True, True, False, False]
    gpt2 = model_from_hf_dict({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
                                   "architectures": ["GPT2LMHeadModel"]}, "g")
    assert gpt2.lm_head


def test_the_last_stage_keeps_no_head_logits_or_tied_copy():
    training = TrainingSpec(global_batch_size=16, seq_len=4096)
    layout = dict(tp=1, pp=2, dp=2, micro_batch_size=1, references=(1, 1, 1))
    with_head, without = (evaluate_layout(m, CLUSTER, training, **layout) for m in (LLAMA, replace(LLAMA,
                                                                                              lm_head=False)))
    head, bare = with_head.stages[-1].memory_parts_gib, without.stages[-1].memory_parts_gib
    assert head["logits_loss"] > 0 and bare["logits_loss"] == 0
    per_param = (head["parameters"] + head["gradients"] + head["optimizer_states"]
                 - bare["parameters"] - bare["gradients"] - bare["optimizer_states"]) * GIB
    assert per_param == pytest.approx(18 * LLAMA.vocab_size * LLAMA.hidden_size, rel=1e-6)  # the output layer
    assert without.stages[0].memory_parts_gib == with_head.stages[0].memory_parts_gib  # the first stage: same
    assert without.stages[-1].predicted_stage_time_s < with_head.stages[-1].predicted_stage_time_s
    tied = get_model("opt-350m")
    assert tied_gradient_bytes(tied, 2, 1, training) > 0  # OPT ties its head: the two ends sum its gradient
    assert tied_gradient_bytes(replace(tied, lm_head=False), 2, 1, training) == 0


def test_flag_cases_column_and_export_note(tmp_path, capsys):
    base = ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, CLUSTER_DICT), "--global-batch-size", "16",
            "--seq-len", "4096"]
    plan = estimated_plan(tmp_path, "plan", [*base, "--tp", "1", "--pp", "2", "--dp", "2", "--micro-batch-size", "1",
                                             "--no-lm-head"])
    assert plan["model_spec"]["lm_head"] is False
    assert any("no LM head" in n for n in megatron_args(Plan.load(str(tmp_path / "plan.json"))).notes)
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,lm_head\nhead,1,2,2,1,\nbare,1,2,2,1,false\n",
                      base)
    assert rows["bare"]["iteration_time_s"] == pytest.approx(plan["predicted_iteration_time_s"])
    assert rows["bare"]["iteration_time_s"] < rows["head"]["iteration_time_s"]
