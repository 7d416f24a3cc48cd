"""torch.autocast over fp32 weights (DDP's, Lightning's "bf16-mixed", memx-run's) casts every
weight a linear reads at every forward and its gradient back in the backward: HBM traffic the
cost model times (elementwise.autocast_weight_cast_bytes)."""

import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning import elementwise
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

AUTOCAST = TrainingSpec(weights_dtype="fp32")  # bf16 compute over fp32 weights, not sharded
A100 = ClusterSpec.from_dict({"version": 1, "device_types": {"a100": {
    "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}},
    "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})


def _weight_cast_bytes(block, x, recompute_again=False):
    """Bytes of the ``_to_copy`` ops on tensors shaped as one of ``block``'s weights, forward
    (under CPU autocast) and backward, traced op by op."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}

    class Casts(TorchDispatchMode):
        total = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes:
                self.total += args[0].numel() * (args[0].element_size() + out.element_size())
            return out

    with Casts() as forward, torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    with Casts() as backward:
        out.float().sum().backward()
    return forward.total, backward.total


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
    forward, backward = _weight_cast_bytes(block, x)
    again = 1.0 if recompute == "full" else 0.0
    counted = float(elementwise.block_weight_cast_bytes(spec, AUTOCAST, 1, again))
    assert forward + backward == pytest.approx(counted, rel=2e-3)
    linear_weights = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    assert backward == 6 * linear_weights * (1 + again)  # the gradient casts and, under full, the forward's again


def test_autocast_setups_take_longer_by_their_weight_casts_at_hbm_speed():
    """LLaMA-2-7B on an A100, micro-batch 1 of 4,096 tokens: under autocast a block takes its
    weights' casts longer than the same block on 16-bit weights (memx times the rest of its
    element-wise traffic in the training dtype either way): 12 bytes per weight at the device's
    memory bandwidth, 18 under full recompute. Sharded and 16-bit trainings cast nothing."""
    model = get_model("llama2-7b")
    weights = model.layer_params
    for level, per_weight in ((cm.NONE, 12.0), (cm.FULL, 18.0)):
        times = [float(cm.AnalyticalCostModel(model, A100, training).layer_costs(0, 1, 1, 4096, level).time_s)
                 for training in (AUTOCAST, TrainingSpec())]
        hbm = float(cm.AnalyticalCostModel(model, A100, AUTOCAST)._hbm[0]) * 1e9
        assert times[0] - times[1] == pytest.approx(per_weight * weights / hbm, rel=0.02)
    sharded = TrainingSpec(weights_dtype="fp32", fully_sharded=True)
    assert not sharded.autocast and not elementwise.block_weight_cast_bytes(model, sharded, 1).any()


def test_autocasts_activation_side_traffic_left_uncounted_is_what_the_docs_say():
    """What docs/setups.md says memx leaves out: memx's block under CPU autocast over fp32 weights
    moves 50 bytes per hidden element and token more outside its matmuls, attention and weight
    casts than the same block in bf16 (each linear's 16-bit copy of its input, the fp32 residual
    adds; CPU autocast runs the norms in 16 bits, CUDA's in fp32)."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from memx_launch.models.llama import TransformerBlock

    h, seq = 512, 256
    spec = ModelSpec("t", 1, h, 8, 2, 1376, 1000, seq)

    def elementwise_bytes(autocast):
        block = TransformerBlock(spec, recompute="none")
        block = block if autocast else block.to(torch.bfloat16)
        weights = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}

        class Traffic(TorchDispatchMode):
            total = 0
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func._schema.name
                weight_cast = func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in weights
                if not (func.is_view or weight_cast or "mm" in name or "attention" in name):
                    tensors = tree_flatten((args, kwargs, out))[0]
                    self.total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                return out

        x = torch.randn(1, seq, h, dtype=torch.float32 if autocast else torch.bfloat16, requires_grad=True)
        with Traffic() as traffic, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = block(x)
        with Traffic() as backward:
            out.float().sum().backward()
        return traffic.total + backward.total

    assert (elementwise_bytes(True) - elementwise_bytes(False)) / (seq * h) == pytest.approx(50, abs=5)
