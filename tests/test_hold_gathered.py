"""A fully sharded stage that holds its gathered weights and unsharded gradients through the step
(``--hold-gathered``), as FSDP2 runs under torch's pipelining: its memory, its time, and the
runtimes and exports that must agree with what the plan counted."""

import numpy as np
import pytest

from benchmarks.common import dgx_cluster
from memx_launch.errors import ConfigError
from memx_launch.planning import data_parallel
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.model_states import (held_gathered_bytes, held_gradient_share, holds_weights,
                                               keeps_gathered, model_state_bytes_per_param)
from memx_launch.planning.runtime_support import check_runnable
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

A100S = dgx_cluster("a100_80gb", 32)
MODEL = get_model("llama2-7b")


def training(**options):
    return TrainingSpec(global_batch_size=64, seq_len=MODEL.seq_len, setup="fsdp2", **options)


def test_which_stages_hold_their_gathered_weights():
    assert TrainingSpec(fully_sharded=True).hold_gathered == "pipelined"
    assert TrainingSpec(setup="zero3").hold_gathered == "never"
    for hold, one_stage, pipeline in (("never", False, False), ("weights", False, False), ("pipelined", False, True),
                                      ("always", True, True)):
        assert (keeps_gathered(training(hold_gathered=hold), 1), keeps_gathered(training(hold_gathered=hold), 4)) \
            == (one_stage, pipeline), hold
        assert holds_weights(training(hold_gathered=hold), 1) == (hold in ("weights", "always")), hold
    assert not keeps_gathered(TrainingSpec(hold_gathered="always"), 4)  # nothing is sharded
    with pytest.raises(ConfigError, match="--hold-gathered"):
        TrainingSpec(hold_gathered="sometimes")


def test_a_held_stage_keeps_a_bf16_weight_and_an_fp32_gradient_per_parameter_it_shards():
    held = training()
    # fsdp2: fp32 weights, gradients and Adam moments sharded over DP (16/DP), plus 2 + 4 held.
    assert model_state_bytes_per_param(held, 8, pp=4) == pytest.approx(16 / 8 + 2 + 4)
    assert model_state_bytes_per_param(held, 8, pp=1) == pytest.approx(16 / 8)
    assert held_gathered_bytes(held, np.array([1, 2]), pp=4)[0].tolist() == [0.0, 2.0]  # one rank gathers nothing
    # Held from the forward to the backward only: the weights, whatever the pipeline.
    for pp in (1, 4):
        assert model_state_bytes_per_param(training(hold_gathered="weights"), 8, pp=pp) == pytest.approx(16 / 8 + 2)
    zero3 = TrainingSpec(setup="zero3", hold_gathered="pipelined")
    assert sum(held_gathered_bytes(zero3, 8, pp=2)) == 2 + 2  # bf16 weights and gradients
    # Reduced in fp32 (FSDP2's reduce_dtype over bf16 weights), they accumulate upcast to fp32.
    assert held_gathered_bytes(TrainingSpec(setup="zero3", hold_gathered="pipelined", fp32_allreduce=True), 8,
                               pp=2)[1] == 4


def _plan(hold, pp=4, dp=8, **layout):
    return evaluate_layout(MODEL, A100S, training(hold_gathered=hold), tp=1, pp=pp, dp=dp, micro_batch_size=1,
                           recompute="full", references=(1, 1, 1), **layout)


def test_a_held_pipeline_stage_counts_its_whole_weights_and_gradients_and_one_reduce_a_step():
    never, held = _plan("never"), _plan("pipelined")
    for a, b in zip(never.stages, held.stages):
        assert a.num_layers == b.num_layers
        extra = b.predicted_peak_memory_gib - a.predicted_peak_memory_gib
        # Every layer's bf16 weights and fp32 gradient, less the two gathered layers and the
        # unsharded gradient the per-micro-batch run has in flight, plus a fresh bf16 gradient.
        layer = MODEL.layer_params / 2**30
        assert extra > (b.num_layers * 6 - 2 * 2 - 4) * layer
    # One gather and one reduce-scatter a step instead of three collectives every micro-batch: it
    # waits for the reduce-scatter at the end, which hides nowhere, but never more than per micro-batch.
    assert 0 < held.predicted_iteration_time_s < never.predicted_iteration_time_s
    # Weights held from each forward to its backward: every layer's weights, no gradient, no layer
    # gathered in flight; one gather a micro-batch instead of two.
    weights = _plan("weights")
    for a, c in zip(never.stages[1:-1], weights.stages[1:-1]):  # the middle stages: blocks only
        layer = MODEL.layer_params / 2**30
        assert c.memory_parts_gib["parameters"] - a.memory_parts_gib["parameters"] == pytest.approx(
            (c.num_layers - 2) * layer * 2, rel=1e-3)
        assert c.memory_parts_gib["gradients"] == pytest.approx(a.memory_parts_gib["gradients"])


def _open_chunks(pp: int, g: int, v: int, rank: int) -> int:
    """The most chunks of ``rank`` whose unsharded gradients are alive at once under torch's
    interleaved 1F1B: from a chunk's first backward to its gradient reduction, which torch's
    pipelining schedules right after the chunk's last backward (``_add_reduce_grad``)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _add_reduce_grad
    from torch.distributed.pipelining.schedules import _ComputationType as Op
    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # its order alone, no stages
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, pp, g
    schedule.number_of_rounds = max(1, g // pp)
    schedule.microbatches_per_round = g // schedule.number_of_rounds
    alive, most = set(), 0
    for action in _add_reduce_grad(schedule._calculate_single_rank_operations(rank), g):
        if action is not None and action.computation_type == Op.FULL_BACKWARD:
            alive.add(action.stage_index)
            most = max(most, len(alive))
        elif action is not None and action.computation_type == Op.REDUCE_GRAD:
            alive.discard(action.stage_index)
    return most


def test_one_interleaved_round_holds_one_chunk_s_unsharded_gradients_as_torch_s_schedule_does():
    """With fewer than 2 x P micro-batches torch's interleaved 1F1B runs one round: each chunk's
    backwards one chunk after another, so a rank holds one chunk's unsharded gradients at a time
    (torchtitan's default of P micro-batches: its 405B runs, docs/setups.md); with more rounds,
    every chunk's. memx's count against torch's own schedule, then in a plan's memory."""
    held = training()
    for pp, v, g in ((2, 2, 2), (2, 2, 3), (2, 2, 4), (4, 2, 4), (4, 3, 7), (4, 3, 8), (4, 2, 12), (8, 2, 8)):
        assert max(_open_chunks(pp, g, v, rank) for rank in range(pp)) == held_gradient_share(held, pp, g, v) * v
    assert held_gradient_share(training(hold_gathered="never"), 4, 4, 2) == 1.0  # nothing kept through the step
    interleaved = dict(schedule="interleaved", virtual_stages=2)

    def parts(batch):  # 4 or 8 micro-batches on 4 stages of two chunks
        spec = TrainingSpec(global_batch_size=batch, seq_len=MODEL.seq_len, setup="fsdp2")
        plan = evaluate_layout(MODEL, A100S, spec, tp=1, pp=4, dp=8, micro_batch_size=1, recompute="full",
                               references=(1, 1, 1), **interleaved)
        return [s.memory_parts_gib for s in plan.stages]

    for one_round, two_rounds in zip(parts(32), parts(64)):
        # The parameters part is an fp32 shard over 8 ranks and a bf16 gathered copy per parameter
        # (2.5 bytes); two rounds hold every chunk's fp32 gradients (4 bytes), one round half of them.
        params = one_round["parameters"] / 2.5
        assert two_rounds["parameters"] == pytest.approx(one_round["parameters"])
        assert two_rounds["gradients"] - one_round["gradients"] == pytest.approx(params * 4 / 2, rel=1e-6)


def test_a_held_step_waits_for_its_whole_reduce_scatter_and_only_the_first_gather():
    params, layer, layers = 6.6e9 / 4, 2.0e8, 8
    args = (params, layer, layers)
    link = (training(), 8, 200.0)
    # Compute far longer than the collectives: per micro-batch only the first unit's gather shows;
    # held, the first gather and the whole reduce-scatter of the stage's gradients.
    long = 100.0
    per_microbatch = data_parallel.fully_sharded_exposed_time(*args, long, *link)
    held = data_parallel.held_fully_sharded_step_time(*args, long, *link)
    first_gather = per_microbatch
    # FSDP2 reduces unit by unit after the last backward: each layer's, then the rest's (fp32 gradients).
    reduce_scatter = (layers * data_parallel.collective_seconds("reduce_scatter", layer * 4, 8, 200.0)
                      + data_parallel.collective_seconds("reduce_scatter", (params - layers * layer) * 4, 8, 200.0))
    assert held == pytest.approx(first_gather + reduce_scatter, rel=1e-6)
    # No compute: held, every gather once plus the reduce-scatter; per micro-batch, every gather twice,
    # or once where the weights are held from the forward to the backward.
    twice = data_parallel.fully_sharded_exposed_time(*args, 0.0, *link)
    once = data_parallel.fully_sharded_exposed_time(*args, 0.0, training(hold_gathered="weights"), 8, 200.0)
    assert data_parallel.held_fully_sharded_step_time(*args, 0.0, *link) < twice
    assert twice - once == pytest.approx(data_parallel.held_fully_sharded_step_time(*args, 0.0, *link)
                                         - reduce_scatter - first_gather, rel=1e-9)


def test_memx_run_refuses_a_fully_sharded_plan_that_counts_less_than_its_runtime_holds():
    plan = _plan("pipelined", pp=1, dp=32)
    with pytest.raises(ConfigError, match="hold-gathered always"):
        check_runnable(plan)
    check_runnable(_plan("always", pp=1, dp=32))
    check_runnable(_plan("pipelined", pp=4, dp=8))


def test_exports_say_where_the_framework_holds_less_than_the_plan():
    from memx_launch.planning.config_exports import torchtitan_toml
    from memx_launch.planning.exporters import megatron_args

    held = _plan("pipelined")
    assert any("Megatron-FSDP gathers and reduce-scatters every micro-batch" in n for n in megatron_args(held).notes)
    assert not any("Megatron-FSDP" in n for n in megatron_args(_plan("never")).notes)
    assert not any("torchtitan holds" in n for n in torchtitan_toml(held).notes)
    assert any("torchtitan holds" in n for n in torchtitan_toml(_plan("always", pp=1, dp=32)).notes)
    # One stage holding its weights from the forward to the backward is torchtitan's "never" resharding.
    weights = torchtitan_toml(_plan("weights", pp=1, dp=32))
    assert 'fsdp_reshard_after_forward = "never"' in weights.text
    assert not any("torchtitan holds" in n for n in weights.notes)
    assert "fsdp_reshard_after_forward" not in torchtitan_toml(held).text
    assert any("Megatron-FSDP" in n for n in megatron_args(_plan("weights", pp=1, dp=32)).notes)
