"""Embedding-only and head-only stages: with several stages and no interleaving, the first
stage may hold only the embedding and the last only the head (Megatron's layouts ``E|...`` and
``...|L``); interleaved, their first or last chunk may (the first or last stage one layer short of
its chunks). memx estimates, saves, reloads and exports them; memx's runtime refuses them. No
processes."""

import json

import pytest
from estimates import cases_rows, cluster_file
from one_node import H100, one_node
from test_exporters import _built, _megatron_config

from memx_launch.errors import ConfigError
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args, pipeline_layout
from memx_launch.planning.plan import Plan
from memx_launch.runtime.layout import rank_layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
CLUSTER_DICT = one_node(H100, 8, 450)
CLUSTER = ClusterSpec.from_dict(CLUSTER_DICT)
TRAINING = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron")


def _estimate(split, **layout):
    return evaluate_layout(MODEL, CLUSTER, TRAINING, **{"tp": 2, "pp": 4, "dp": 1, "micro_batch_size": 1,
                                                       "layers_per_stage": split, "references": (1, 1, 1),
                                                       **layout})


def test_an_embedding_only_first_stage_holds_the_embedding_and_its_in_flight_outputs():
    plan = _estimate([0, 10, 11, 11])
    first = plan.stages[0].memory_parts_gib
    embedding = MODEL.embedding_params / 2  # over TP 2
    assert first["parameters"] * 2**30 == pytest.approx(embedding * 2)  # bf16 weights
    # No block activations: the embedding outputs of the 4 micro-batches in flight and nothing else.
    assert first["activations"] * 2**30 == pytest.approx(4 * 4096 * MODEL.hidden_size * 2)
    assert plan.stages[0].predicted_stage_time_s < 0.01 * plan.stages[1].predicted_stage_time_s
    assert sum(first.values()) == pytest.approx(plan.stages[0].predicted_peak_memory_gib)  # the parts add up
    head_only = _estimate([10, 11, 11, 0])
    assert head_only.stages[-1].memory_parts_gib["logits_loss"] > 0
    assert pipeline_layout(plan) == "E|t*10|t*11|t*11L" and pipeline_layout(head_only) == "Et*10|t*11|t*11|L"
    config = _megatron_config(plan, megatron_args(plan).args)
    assert [config.pipeline_model_parallel_layout.get_num_layers_to_build(pp_rank=r) for r in range(4)] == \
        [0, 10, 11, 11]


def test_only_the_ends_of_a_plain_pipeline_may_be_empty():
    with pytest.raises(ConfigError, match=r"--layers-per-stage: \[10, 0, 11, 11\] .*may hold one less"):
        _estimate([10, 0, 11, 11])
    with pytest.raises(ConfigError, match="--layers-per-stage"):
        _estimate([0, 10, 12, 10], schedule="interleaved", virtual_stages=2)
    assert [s.num_layers for s in _estimate([0, 32], pp=2, tp=4).stages] == [0, 32]  # two stages: either end


def test_an_interleaved_pipeline_may_give_the_embedding_and_the_head_a_chunk_of_their_own():
    # Megatron's account_for_embedding/loss_in_pipeline_split at one layer a chunk (Llama 3.1 405B
    # on 16 stages of 8 chunks): the first stage's first chunk holds the embedding alone.
    plan = _estimate([1, 10, 10, 11], schedule="interleaved", virtual_stages=2)
    assert pipeline_layout(plan) == "E|t*5|t*5|t*6|t|t*5|t*5|t*5L"
    config = _megatron_config(plan, megatron_args(plan).args)
    assert _built(config) == [[0, 1], [5, 5], [5, 5], [6, 5]]
    with pytest.raises(ConfigError, match="--plan: stage 0 holds fewer layers than its 2 chunks.*memx export"):
        rank_layout(plan, 0)
    with pytest.raises(ConfigError, match="--layers-per-stage"):  # two short of its chunks
        _estimate([0, 11, 10, 11], schedule="interleaved", virtual_stages=2)


def test_a_saved_plan_reloads_and_memx_runtime_refuses_it_by_name(tmp_path):
    path = tmp_path / "plan.json"
    _estimate([0, 10, 11, 11]).save(str(path))
    plan = Plan.load(str(path))
    assert [s.num_layers for s in plan.stages] == [0, 10, 11, 11]
    with pytest.raises(ConfigError, match="--plan: stage 0 holds no layers .*memx export"):
        rank_layout(plan, 0)
    data = json.loads(path.read_text())
    data["stages"][1]["num_layers"], data["stages"][2]["num_layers"] = 0, 21
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"stages\[1\].num_layers: 0 layers .*only the first or last"):
        Plan.load(str(path))


def test_a_cases_row_states_it(tmp_path, capsys):
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,layers_per_stage\nempty,2,4,1,1,0/10/11/11\n",
                      ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, CLUSTER_DICT),
                       "--global-batch-size", "64", "--seq-len", "4096", "--setup", "megatron"])
    assert rows["empty"]["fits"]
    assert rows["empty"]["iteration_time_s"] == pytest.approx(_estimate([0, 10, 11, 11]).predicted_iteration_time_s)
