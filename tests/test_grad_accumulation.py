"""planning/grad_accumulation.py: each micro-batch after a step's first adds its gradients into
the held ones in a pass of its own (torch's AccumulateGrad), which memx times where the training
accumulates so (``grad_accumulation_pass``: ddp, memx-run)."""

from dataclasses import replace

import numpy as np
import pytest

from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.grad_accumulation import accumulation_bytes, accumulation_seconds
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
    3 x 4 bytes per weight, what ``accumulation_bytes`` counts for a step of two micro-batches."""
    torch = pytest.importorskip("torch")
    from traced import byte_counter

    weight = torch.nn.Parameter(torch.randn(256, 512))

    def adds_into_the_weight(func, args, out):
        return func in (torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor) and args[0].shape == weight.shape

    def backward():
        with byte_counter(adds_into_the_weight) as adds:
            (torch.randn(8, 256) @ weight).sum().backward()
        return adds.total
    assert backward() == 0
    training = TrainingSpec(weights_dtype="fp32", grad_dtype="fp32", grad_accumulation_pass=True)
    assert backward() == weight.numel() * float(accumulation_bytes(training, 1, 1, g=2))


def test_fsdp2_upcasts_the_first_micro_batchs_gradients_and_adds_each_later_one():
    """torch's FSDP2 with bf16 compute and fp32 reduction, gradient sync off (as under torch's
    pipelining), three backwards traced on the unsharded weight: the first gradient is upcast
    (2 bytes read, 4 written), each later one added into the fp32 sum (2 + 4 read, 4 written):
    ``accumulation_bytes`` of memx-run's held FSDP2 stages, 6 + 2 x 10 bytes a weight a step."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from traced import byte_counter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        linear = torch.nn.Linear(512, 256, bias=False)
        fully_shard(linear, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                    reshard_after_forward=False)
        linear.set_requires_gradient_sync(False)
        weights = 512 * 256

        def gradient_pass(func, args, out):  # the upcast of a 16-bit gradient, or an add into the sum
            upcast = func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16
            return (upcast or func is torch.ops.aten.add_.Tensor) and args[0].numel() == weights

        with byte_counter(gradient_pass) as passes:
            for _ in range(3):
                linear(torch.randn(8, 512)).float().sum().backward()
    finally:
        dist.destroy_process_group()
    memx_run = TrainingSpec(setup="memx-run", fully_sharded=True)  # bf16 compute, fp32 gradients held
    assert passes.total == weights * float(accumulation_bytes(memx_run, 2, 1, g=3)) == weights * (6 + 2 * 10)


def test_what_each_training_adds_into():
    """Per parameter and step of four micro-batches: whole fp32 gradients (DDP) three adds of 12
    bytes; a fully sharded stage's unsharded ones where it holds them through the step (memx-run)
    an upcast and three adds into fp32; reduce-scattered ones (ZeRO-3, bf16) the 1/DP shard's adds."""
    ddp = TrainingSpec(setup="ddp")
    assert ddp.grad_accumulation_pass and float(accumulation_bytes(ddp, 8, 1, g=4)) == 3 * 12
    memx_run = TrainingSpec(setup="memx-run", fully_sharded=True)
    assert float(accumulation_bytes(memx_run, 8, 1, g=4)) == 6 + 3 * 10
    zero3 = TrainingSpec(setup="zero3")
    assert float(accumulation_bytes(zero3, 8, 1, g=4)) == pytest.approx(3 * 6 / 8)
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
