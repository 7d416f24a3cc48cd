"""torch.autocast over fp32 weights (DDP's, Lightning's "bf16-mixed", memx-run's) casts every
weight a linear reads at every forward and its gradient back in the backward: HBM traffic the
cost model times (elementwise.autocast_weight_cast_bytes)."""

import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning import elementwise
from memx_launch.planning.peaks import hbm_gbps
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

AUTOCAST = TrainingSpec(weights_dtype="fp32")  # bf16 compute over fp32 weights, not sharded
A100 = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
    "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
    "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})


def _traced(block, x, autocast=True, counted=None):
    """(forward, backward) bytes of ``block`` on ``x`` (its forward under CPU autocast where
    ``autocast``) that the ops ``counted`` keeps move, traced op by op."""
    import torch
    from traced import byte_counter

    with byte_counter(counted) as forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = block(x)
    with byte_counter(counted) as backward:
        out.float().sum().backward()
    return forward.total, backward.total


def _weight_cast(block):
    """Whether an op is a cast of a tensor shaped as one of ``block``'s weights (or their gradients)."""
    import torch
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    return lambda func, args, out: func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_memx_block_under_autocast_casts_each_weight_forward_and_its_gradient_backward(recompute):
    """memx's LLaMA block on fp32 weights under CPU autocast: each linear's weight is cast to bf16
    in the forward (4 bytes read, 2 written) and its bf16 gradient back to fp32 in the backward;
    full recompute casts again in the forward it runs inside the backward. Against the count of a
    block's weights on a rank (its two norm weights, not cast, are 1/1,400 of them here)."""
    torch = pytest.importorskip("torch")
    from memx_launch.models.llama import TransformerBlock

    h, seq = 512, 64
    spec = ModelSpec("t", 1, h, 8, 2, 1376, 1000, seq)
    block = TransformerBlock(spec, recompute=recompute)
    x = torch.randn(1, seq, h, requires_grad=True)
    forward, backward = _traced(block, x, counted=_weight_cast(block))
    again = 1.0 if recompute == "full" else 0.0
    counted = float(elementwise.block_weight_cast_bytes(spec, AUTOCAST, 1, again))
    assert forward + backward == pytest.approx(counted, rel=2e-3)
    linear_weights = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    assert backward == 6 * linear_weights * (1 + again)  # the gradient casts and, under full, the forward's again


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_an_autocast_region_over_the_step_casts_each_weight_once(recompute):
    """memx-run runs a step's micro-batches inside one autocast region: the first forward casts each
    weight, the later forwards and full recompute's forward again read autocast's cache, and every
    backward still casts its gradients. Against ``--autocast-per-step``'s count: each micro-batch's
    gradient casts, and the weights' casts once a step (elementwise.step_weight_cast_seconds)."""
    torch = pytest.importorskip("torch")
    from traced import byte_counter

    from memx_launch.models.llama import TransformerBlock

    h, seq = 512, 64
    spec = ModelSpec("t", 1, h, 8, 2, 1376, 1000, seq)
    block = TransformerBlock(spec, recompute=recompute)
    x = torch.randn(1, seq, h, requires_grad=True)
    traffic = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):  # micro-batches of one step
            with byte_counter(_weight_cast(block)) as moved:
                block(x).float().sum().backward()
            traffic.append(moved.total)
    linear_weights = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    per_step = TrainingSpec(setup="memx-run", dtype="bf16")
    assert per_step.autocast_per_step and per_step.autocast
    again = 1.0 if recompute == "full" else 0.0
    each = float(elementwise.block_weight_cast_bytes(spec, per_step, 1, again))
    assert traffic[1] == traffic[2] == pytest.approx(each, rel=2e-3) and traffic[1] == 6 * linear_weights
    once = float(elementwise.step_weight_cast_seconds(linear_weights, per_step, 1.0, 1)) * 1e9
    assert traffic[0] - traffic[1] == once == 6 * linear_weights


def test_autocast_setups_take_longer_by_their_weight_casts_at_hbm_speed():
    """LLaMA-2-7B on an A100, micro-batch 1: under autocast a block takes its weights' casts longer
    than the same block on 16-bit weights (memx times the rest of its element-wise traffic in the
    training dtype either way): 12 bytes per weight at the device's memory bandwidth, 18 under full
    recompute; without recompute 10% of the block's time at 2,048 tokens and 5% at 4,096, as
    docs/setups.md says. Sharded and 16-bit trainings cast nothing."""
    model = get_model("llama2-7b")
    hbm = hbm_gbps(A100.device_type("a100")) * 1e9
    for seq, level, per_weight, share in ((2048, cm.NONE, 12.0, 0.10), (4096, cm.NONE, 12.0, 0.05),
                                          (4096, cm.FULL, 18.0, None)):
        autocast, bf16 = (float(cm.AnalyticalCostModel(model, A100, training).layer_costs(0, 1, 1, seq, level).time_s)
                          for training in (AUTOCAST, TrainingSpec()))
        assert autocast - bf16 == pytest.approx(per_weight * model.layer_params / hbm, rel=0.02)
        if share:
            assert (autocast - bf16) / autocast == pytest.approx(share, abs=0.01)
    sharded = TrainingSpec(weights_dtype="fp32", fully_sharded=True)
    assert not sharded.autocast and not elementwise.block_weight_cast_bytes(model, sharded, 1).any()


def test_autocasts_activation_side_traffic_left_uncounted_is_what_the_docs_say():
    """What docs/setups.md says memx leaves out: memx's block under CPU autocast over fp32 weights
    moves 50 bytes per hidden element and token more outside its matmuls, attention and weight
    casts than the same block in bf16 (each linear's 16-bit copy of its input, the fp32 residual
    adds; CPU autocast runs the norms in 16 bits, CUDA's in fp32)."""
    torch = pytest.importorskip("torch")
    from memx_launch.models.llama import TransformerBlock

    h, seq = 512, 256
    spec = ModelSpec("t", 1, h, 8, 2, 1376, 1000, seq)

    def elementwise_bytes(autocast):
        block = TransformerBlock(spec, recompute="none")
        block = block if autocast else block.to(torch.bfloat16)
        weight_cast = _weight_cast(block)
        def elementwise(func, args, out):
            return not (weight_cast(func, args, out) or "mm" in func._schema.name or "attention" in func._schema.name)
        x = torch.randn(1, seq, h, dtype=torch.float32 if autocast else torch.bfloat16, requires_grad=True)
        return sum(_traced(block, x, autocast, elementwise))

    assert (elementwise_bytes(True) - elementwise_bytes(False)) / (seq * h) == pytest.approx(50, abs=5)
