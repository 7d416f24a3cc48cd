"""torchtitan's op-level selective checkpointing (``--selective-recompute op``): what torch keeps
for memx's own block under the policy, measured on CPU against the model; its time and memory
between the attention-core policy and full recompute; the flag, the --cases column, the exports."""

import gc

import pytest
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm, op_checkpointing
from memx_launch.planning.config_exports import torchtitan_toml
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.exporters import megatron_args
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")


def kept_storage_bytes(forward, owned=()) -> int:
    """Bytes of the storages made while ``forward()`` runs that are still alive after it (what
    autograd saves and what a selective checkpoint caches), each once, less those of ``owned``
    tensors and of the output."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    made = {}

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    made[t.untyped_storage().data_ptr()] = (StorageWeakRef(t.untyped_storage()),
                                                            t.untyped_storage().nbytes())
            return out

    with Storages():
        output = forward()
    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in (*owned, output)}
    return sum(n for ptr, (ref, n) in made.items() if ptr not in skip and not ref.expired())


def test_what_torch_keeps_under_the_op_policy_is_the_model():
    """memx's LLaMA block (GQA, SwiGLU) in bf16 on CPU under torchtitan's policy: the block keeps
    wq's, wv's, w1's and w2's outputs and the attention kernel's output and logsumexp, exactly
    ``activation_bytes`` less the block input, which the caller owns here. The measurement
    agrees with autograd's saved tensors where both apply, and the gradients are the plain
    block's."""
    torch = pytest.importorskip("torch")
    from memx_launch.models.checkpointing import op_level_checkpoint
    from memx_launch.models.llama import TransformerBlock
    from memx_launch.profiling.saved_tensors import saved_storage_bytes

    h, seq = 512, 256
    spec = ModelSpec("t", 1, h, 8, 2, 1376, 1000, seq)
    block = TransformerBlock(spec).to(torch.bfloat16)
    x = torch.randn(1, seq, h, dtype=torch.bfloat16, requires_grad=True)
    owned = (*block.parameters(), x)
    assert kept_storage_bytes(lambda: block(x), owned) == saved_storage_bytes(lambda: block(x), owned)
    kept = kept_storage_bytes(lambda: op_level_checkpoint(block._block, x), owned)
    model = float(cm.activation_bytes(spec, 1, seq, 1, cm.SELECTIVE, 2, True, op_selective=True).activation_bytes)
    assert kept == model - 2 * seq * h
    plain = block(x)
    plain.float().square().sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    op_level_checkpoint(block._block, x).float().square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(block.parameters(), expected))


def _stage(policy, level, tp=1, dp=8):
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron", selective_recompute=policy)
    plan = evaluate_layout(MODEL, ClusterSpec.from_dict(one_node(H100, 8, 450)), training, tp=tp, pp=1, dp=dp,
                           micro_batch_size=2, recompute=level, references=(1.0, 1.0, 1.0))
    return plan.stages[0]


@pytest.mark.parametrize("tp, dp", [(1, 8), (4, 2)])
def test_op_policy_lies_between_the_attention_core_and_full_recompute(tp, dp):
    none, attention, op, full = (_stage(p, lvl, tp, dp) for p, lvl in (("attention", "none"), ("attention", "selective"),
                                                                       ("op", "selective"), ("op", "full")))
    assert none.predicted_stage_time_s < attention.predicted_stage_time_s < op.predicted_stage_time_s \
        < full.predicted_stage_time_s
    activations = [s.memory_parts_gib["activations"] for s in (none, attention, op, full)]
    assert activations == sorted(activations, reverse=True) and len(set(activations)) == 4
    # The other levels do not depend on the policy.
    assert _stage("op", "none", tp, dp).predicted_stage_time_s == none.predicted_stage_time_s


def test_the_policy_recomputes_every_other_projection():
    names = ["q", "k", "v", "o", "gate", "up", "down"]
    shapes = dict(zip(names, op_checkpointing.projections(MODEL, 2)))
    assert op_checkpointing.saved_projections(MODEL, 2) == [shapes[n] for n in ("q", "v", "gate", "down")]
    assert op_checkpointing.recomputed_projections(MODEL, 2) == [shapes[n] for n in ("k", "o", "up")]
    assert shapes["down"][0] == MODEL.hidden_size  # a row-parallel output: the whole width of partial sums


def test_flag_exports_and_refusal(tmp_path):
    with pytest.raises(ConfigError, match="--selective-recompute"):
        TrainingSpec(selective_recompute="layer")
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron", selective_recompute="op")
    plan = evaluate_layout(MODEL, ClusterSpec.from_dict(one_node(H100, 8, 450)), training, tp=2, pp=1, dp=4,
                           micro_batch_size=1, recompute="selective", references=(1.0, 1.0, 1.0))
    assert plan.training["selective_recompute"] == "op"
    assert not any("selective maps" in note for note in torchtitan_toml(plan).notes)
    assert any("op-level policy" in note for note in megatron_args(plan).notes)
    plan.training["selective_recompute"] = "attention"
    assert any("--selective-recompute op" in note for note in torchtitan_toml(plan).notes)


def test_cases_column_is_the_flag(tmp_path, capsys):
    from estimates import cases_rows, cluster_file, estimated_plan

    flags = ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, one_node(H100, 8, 450)),
             "--global-batch-size", "64", "--setup", "megatron"]
    plan = estimated_plan(tmp_path, "op", [*flags, "--tp", "1", "--pp", "1", "--dp", "8", "--micro-batch-size", "2",
                                           "--recompute", "selective", "--selective-recompute", "op"])
    rows = cases_rows(capsys, tmp_path, "id,dp,micro_batch_size,recompute,selective_recompute\n"
                      "op,8,2,selective,op\nattention,8,2,selective,\n", flags)
    assert rows["op"]["iteration_time_s"] == pytest.approx(plan["predicted_iteration_time_s"], rel=1e-12)
    assert rows["attention"]["iteration_time_s"] < rows["op"]["iteration_time_s"]


def test_calibration_times_selective_blocks_under_the_plans_policy():
    """memx-run calibrates under the plan's policy: an op-level record says so (its learned ratio
    is then taken against the op policy's analytical cost) and is never reused for the other."""
    from memx_launch.profiling.kernel import calibrate
    from memx_launch.profiling.space import Sample
    from memx_launch.runtime.calibration import measurement_key, sample_key
    from memx_launch.specs.cluster import DeviceType

    spec = ModelSpec("tiny", 2, 64, 4, 4, 176, 128, 64)
    cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
    selective, full = Sample(1, 2, 64, "selective", 4), Sample(1, 2, 64, "full", 4)
    attention, = calibrate(spec, cpu, [selective], num_blocks=2, repeats=1)
    op, op_full = calibrate(spec, cpu, [selective, full], num_blocks=2, repeats=1, selective_policy="op")
    assert attention.run_options == {"setup": "memx-run"}
    assert op.run_options == {"setup": "memx-run", "selective_recompute": "op"}
    assert op_full.run_options == {"setup": "memx-run"}  # the policy changes nothing else: full records stay shared
    # Measured: the op policy keeps every other projection's output, not the attention core's.
    assert op.peak_memory_bytes != attention.peak_memory_bytes
    assert measurement_key(op) == sample_key("cpu", spec, selective, "fp32", "op")
    assert measurement_key(attention) == sample_key("cpu", spec, selective, "fp32")
    assert measurement_key(op) != measurement_key(attention)
    assert measurement_key(op_full) == sample_key("cpu", spec, full, "fp32", "op")
