"""planning/grad_accumulation.py: each micro-batch after a step's first adds its gradients into
the held ones in a pass of its own (torch's AccumulateGrad), which memx times where the training
accumulates so (``grad_accumulation_pass``: ddp, memx-run)."""

from dataclasses import replace

import numpy as np
import pytest

from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.grad_accumulation import accumulated_gradient_bytes, accumulation_seconds
from memx_launch.planning.peaks import hbm_gbps
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.training import TrainingSpec

A100S = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
    "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
    "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})


def test_torch_adds_a_second_micro_batchs_gradients_in_a_pass_of_its_own():
    """Two backwards into the same fp32 weights, traced op by op: the first's gradient becomes the
    weight's ``.grad`` (no copy), the second's is added in place, reading both and writing the sum:
    3 x 4 bytes per weight, what ``accumulated_gradient_bytes`` x 3 counts for fp32 gradients."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    weight = torch.nn.Parameter(torch.randn(256, 512))

    class Adds(TorchDispatchMode):
        total = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor) and args[0].shape == weight.shape:
                self.total += 3 * args[0].numel() * args[0].element_size()  # two reads and a write
            return out

    def backward():
        with Adds() as adds:
            (torch.randn(8, 256) @ weight).sum().backward()
        return adds.total
    assert backward() == 0
    training = TrainingSpec(weights_dtype="fp32", grad_dtype="fp32", grad_accumulation_pass=True)
    assert backward() == 3 * weight.numel() * float(accumulated_gradient_bytes(training, 1, 1))


def test_what_each_training_adds_into():
    """Whole gradients in their dtype (DDP); a fully sharded stage's unsharded ones where it holds
    them through the step (memx-run, in the reduction's fp32), else its 1/DP shard (ZeRO-3)."""
    ddp = TrainingSpec(setup="ddp")
    assert ddp.grad_accumulation_pass and float(accumulated_gradient_bytes(ddp, 8, 1)) == 4.0
    memx_run = TrainingSpec(setup="memx-run", fully_sharded=True)
    assert float(accumulated_gradient_bytes(memx_run, 8, 1)) == 4.0
    zero3 = TrainingSpec(setup="zero3")
    assert float(accumulated_gradient_bytes(zero3, 8, 1)) == pytest.approx(2.0 / 8)
    assert not TrainingSpec(setup="megatron").grad_accumulation_pass  # fused into the weight-gradient GEMM
    assert not accumulation_seconds(np.array([1e9]), ddp, 1000.0, 8, 1, g=1).any()  # one micro-batch: nothing to add


def test_a_step_of_many_micro_batches_takes_its_accumulations_longer():
    """LLaMA-2-7B, PP 2 x DP 4 on eight A100s under --setup ddp, 16 micro-batches of 1: each
    micro-batch of a stage takes 15/16 x 12 bytes per weight it holds longer at HBM speed, and a
    1F1B step of 16 + 1 micro-batch slots 17 times the last stage's (its head as large as stage
    0's embedding, and its final norm)."""
    model = get_model("llama2-7b")
    layout = dict(tp=1, pp=2, dp=4, micro_batch_size=1, layers_per_stage=[16, 16], recompute="full",
                  references=(1.0, 1.0, 1.0))
    on = TrainingSpec(global_batch_size=64, seq_len=2048, setup="ddp")
    with_pass, without = (evaluate_layout(model, A100S, training, **layout).predicted_iteration_time_s
                          for training in (on, replace(on, grad_accumulation_pass=False)))
    hbm = hbm_gbps(A100S.device_type("a100")) * 1e9
    last_stage_params = 16 * model.layer_params + model.embedding_params + model.hidden_size
    assert with_pass - without == pytest.approx(17 * 15 / 16 * 12 * last_stage_params / hbm, rel=1e-6)
