"""The host's time per layer (``planning/host_time.py``): an eager block's ops (``--eager-block``)
as benchmarks/block_host_ops.py counted them in Megatron-Core's eager layer, at an eager op's
measured host time, against a fused block's launches; what wins over the count. No processes."""

import dataclasses
import json
from pathlib import Path

import numpy as np

import pytest
from one_node import H100, one_node

from memx_launch.planning import costmodel as cm
from memx_launch.planning import host_time
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

COUNTED = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "block_host_ops.json").read_text())
OPT = get_model("opt-350m")
LLAMA = get_model("llama2-7b")
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))


def test_the_eager_block_ops_are_the_ones_counted_in_megatron_core():
    """The constants are the file's counts: the base block, what each option adds, the MLP's own."""
    assert tuple(COUNTED["base"]) == host_time.EAGER_BLOCK_OPS["base"]
    assert {name: tuple(ops) for name, ops in COUNTED["added_by_option"].items()} \
        == {name: ops for name, ops in host_time.EAGER_BLOCK_OPS.items() if name != "base"}
    names = {"gelu": (False, True), "gelu no biases": (False, False), "swiglu": (True, True),
             "swiglu no biases": (True, False)}
    assert {names[name]: tuple(ops) for name, ops in COUNTED["mlp"].items()} == host_time.EAGER_MLP_OPS
    # Counted additive: every option at once, with and without fused attention, is what memx sums.
    everything = dict(dropout=True, attention_dropout=True, softmax_in_fp32=True, fused_norm=False, eager_block=True)
    for flash, key in ((False, "unfused attention"), (True, "fused attention")):
        training = TrainingSpec(flash_attention=flash, **everything)
        assert list(host_time.eager_block_ops(LLAMA, training)) == COUNTED["every_option"][key] \
            == COUNTED["every_option_as_sum"][key]
    # The eager op's host time is what the dense block took per op too, within that host's spread.
    for measured in COUNTED["host_us_per_op"].values():
        assert host_time.EAGER_OP_HOST_S * 1e6 == pytest.approx(measured, rel=0.25)


def test_an_eager_block_counts_what_its_options_issue():
    """OPT's block (learned positions, GELU, biases, hidden dropout, torch's softmax) issues the
    base's ops and its dropouts'; a LLaMA block in bf16 adds rotary embeddings and SwiGLU and drops
    the biases; a mixture's block leaves its MLP to the MoE layer's count."""
    opt = TrainingSpec(dtype="fp32", flash_attention=False, dropout=True, eager_block=True)
    assert host_time.eager_block_ops(OPT, opt) == (52 + 8, 94 + 2)
    llama = TrainingSpec(eager_block=True)
    ops = host_time.EAGER_BLOCK_OPS
    assert host_time.eager_block_ops(LLAMA, llama) == tuple(
        sum(ops[name][i] for name in ("base", "flash_attention", "rotary", "gated", "no_biases")) for i in (0, 1))
    mixture = get_model("qwen3-30b-a3b")
    assert np.subtract(host_time.eager_block_ops(LLAMA, llama), host_time.eager_block_ops(mixture, llama)).tolist() \
        == list(host_time.EAGER_MLP_OPS[(True, False)])


def _layer(model, training, recompute=cm.NONE, mbs=1, seq=2048, tp=4):
    costs = cm.AnalyticalCostModel(model, NODE, training)
    return float(costs.layer_costs(0, tp, mbs, seq, recompute).time_s), float(costs.layer_host_seconds(0, recompute))


def test_an_eager_block_holds_a_small_layer_to_its_host_time():
    """OPT-350 at micro-batch 1 on TP 4: its eager block's 156 ops at 14 us take the host longer than
    the device its layer, where a fused block's 40 launches do not; at micro-batch 64 the device
    sets the time again. A measured host time (the flag) wins over the count, and full recompute
    issues the forward's ops again."""
    fused = TrainingSpec(seq_len=2048, flash_attention=False, dropout=True)
    eager = dataclasses.replace(fused, eager_block=True)
    fused_time, fused_host = _layer(OPT, fused)
    eager_time, eager_host = _layer(OPT, eager)
    assert fused_host == host_time.FUSED_BLOCK_HOST_S < fused_time
    assert eager_host == pytest.approx(156 * host_time.EAGER_OP_HOST_S) and eager_time == eager_host > fused_time
    # The device's time alone (what memx estimate holds the host's against) is the fused block's layer time.
    device = float(cm.AnalyticalCostModel(OPT, NODE, eager).layer_costs(0, 4, 1, 2048, cm.NONE, host=False).time_s)
    assert device == fused_time < eager_host
    big_time, big_host = _layer(OPT, eager, mbs=64)
    assert big_time > big_host == eager_host
    told = dataclasses.replace(eager, host_ms_per_layer=5.0)
    assert _layer(OPT, told)[1] == pytest.approx(5e-3)
    forward = host_time.eager_block_ops(OPT, eager)[0]
    assert _layer(OPT, eager, cm.FULL)[1] - eager_host == pytest.approx(forward * host_time.EAGER_OP_HOST_S)


def test_an_eager_mixture_prices_its_moe_ops_at_the_eager_op_time():
    """A mixture's eager block (without its MLP) plus its MoE layer's ops, each at 14 us: no
    scaling, as nothing measured a slower host; a measured host time scales both."""
    mixture = dataclasses.replace(get_model("qwen3-30b-a3b"), seq_len=4096)
    training = TrainingSpec(seq_len=4096, expert_parallel=8, eager_block=True)
    from memx_launch.planning import experts

    host = _layer(mixture, training, seq=4096, tp=1)[1]
    block = sum(host_time.eager_block_ops(mixture, training))
    assert host == pytest.approx((block + float(experts.host_ops(mixture, training))) * host_time.EAGER_OP_HOST_S)
    slower = dataclasses.replace(training, host_ms_per_layer=2e3 * block * host_time.EAGER_OP_HOST_S)
    assert _layer(mixture, slower, seq=4096, tp=1)[1] == pytest.approx(2 * host)


def test_every_setup_but_megatron_runs_eager_blocks():
    """DeepSpeed, FSDP, DDP and Aleph Alpha's codebase issue their blocks as torch ops; Megatron-LM
    with Transformer Engine fuses them, and a setup's word yields to the flag (a compiled run)."""
    from memx_launch.specs.setups import SETUPS

    assert {name for name in SETUPS if TrainingSpec(setup=name).eager_block} == set(SETUPS) - {"megatron"}
    assert not TrainingSpec().eager_block and not TrainingSpec(setup="fsdp2", eager_block=False).eager_block


def test_estimate_and_cases_take_the_eager_block(tmp_path, capsys):
    """`memx estimate --eager-block` says the host sets OPT-350's small layers and what would
    shorten it; without it the fused block binds nothing; a --cases column asks the same."""
    from estimates import cases_rows, cluster_file

    from memx_launch.cli import main

    path = cluster_file(tmp_path, one_node(H100, 8, 450))
    args = ["--model", "opt-350m", "--cluster", path, "--global-batch-size", "8", "--seq-len", "2048",
            "--dtype", "fp32", "--no-flash-attention", "--dropout", "--tp", "4", "--pp", "1", "--dp", "2",
            "--micro-batch-size", "1"]
    assert main(["estimate", *args, "--eager-block"]) == 0
    out = capsys.readouterr().out
    assert "host bound: stage 0 (gpu): 24 of its 24 layers take the host 2.2 ms each" in out
    assert "its block runs as eager ops: a larger micro-batch, fused kernels (torch.compile, Transformer Engine) " \
           "or CUDA graphs (not modelled) would shorten" in out
    assert main(["estimate", *args]) == 0 and "host bound" not in capsys.readouterr().out
    table = "id,eager_block,tp,pp,dp,micro_batch_size\neager,true,4,1,2,1\nfused,false,4,1,2,1\n"
    rows = cases_rows(capsys, tmp_path, table, args[:-8])
    assert rows["eager"]["iteration_time_s"] > rows["fused"]["iteration_time_s"]


def test_another_frameworks_block_issues_about_what_its_options_add_up_to():
    """Hugging Face's LlamaDecoderLayer, counted as the Megatron-Core block was, against the sum of
    its options' counts (torch-op norms, rotary, SwiGLU, no biases; SDPA or eager attention with its
    fp32 softmax): memx's eager count for those options is that sum, within 15% of the count."""
    llama = get_model("llama2-7b")
    for attention, flash in (("sdpa", True), ("eager", False)):
        training = TrainingSpec(flash_attention=flash, softmax_in_fp32=not flash, fused_norm=False, eager_block=True)
        checked = COUNTED["hugging_face_llama"][attention]
        assert list(host_time.eager_block_ops(llama, training)) == checked["options_sum"]
        assert sum(checked["counted"]) == pytest.approx(sum(checked["options_sum"]), rel=0.15)


DEEPSPEED = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "deepspeed_zero3_host.json")
                       .read_text())


def test_deepspeed_zero3_hooks_are_the_timed_ones_where_it_fetches_and_only_there():
    """The constants are the file's: a linear module's hooks and the rest of a block's, forward and
    backward; a Hugging Face LLaMA block (7 linear modules) and a fused one (4) add what was timed."""
    for i, part in enumerate(("forward", "backward")):
        timed = DEEPSPEED["hooks"][part]
        assert host_time.DEEPSPEED_HOOK_HOST_S["per_linear_module"][i] * 1e6 == pytest.approx(
            timed["per_linear_module_us"], rel=0.01)
        assert host_time.DEEPSPEED_HOOK_HOST_S["rest_of_block"][i] * 1e6 == pytest.approx(
            timed["rest_of_block_us"], rel=0.01)
    for name, training in (("hf", TrainingSpec(setup="zero3")),
                           ("fused", TrainingSpec(setup="zero3", fused_qkv=True, fused_gate_up=True))):
        hooks = np.array(host_time.fetch_hook_seconds(LLAMA, training)) * 1e6
        timed = DEEPSPEED["blocks"][name]["hook_us_per_block"]
        assert hooks == pytest.approx([timed["forward"], timed["backward"]], rel=0.01)
    for fsdp in (TrainingSpec(setup="zero3", max_live_params=0.0), TrainingSpec(setup="fsdp2"), TrainingSpec()):
        assert host_time.fetch_hook_seconds(LLAMA, fsdp) == (0.0, 0.0)


def test_deepspeed_zero3_hooks_add_to_an_eager_blocks_host_time_and_run_again_with_its_forward():
    zero3, fsdp = TrainingSpec(setup="zero3"), TrainingSpec(setup="zero3", max_live_params=0.0)
    hooks = host_time.fetch_hook_seconds(LLAMA, zero3)
    assert host_time.default_block_host_seconds(LLAMA, zero3) - host_time.default_block_host_seconds(LLAMA, fsdp) \
        == pytest.approx(sum(hooks))
    block = host_time.default_block_host_seconds(LLAMA, zero3)
    none, full = (float(host_time.layer_host_seconds(LLAMA, zero3, block, level)) for level in (cm.NONE, cm.FULL))
    eager_forward = host_time.eager_block_ops(LLAMA, zero3)[0] * host_time.EAGER_OP_HOST_S
    assert full - none == pytest.approx(eager_forward + hooks[0])  # the recompute's forward fires its hooks again
