"""The LLaMA stage model: split-invariant init, recompute levels, tensor parallel."""

import os

import pytest
import torch
import torch.nn.functional as F

from memx_launch.errors import ConfigError
from memx_launch.models.llama import LlamaStage, TransformerBlock, apply_tensor_parallel
from memx_launch.planning.plan import layer_recompute_levels
from memx_launch.specs.catalog import get_model
from ranks import spawn_ranks
from memx_launch.profiling.saved_tensors import saved_storage_bytes

SPEC = get_model("llama-tiny")
# fp32 on CPU: differences come only from summation order (TP all-reduce, checkpoint replay).
ATOL = 1e-5


def _tokens(batch=2, seq=32, seed=1):
    return torch.randint(0, SPEC.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def test_stages_of_any_split_hold_the_reference_weights():
    ref = LlamaStage.full(SPEC)
    tokens = _tokens()
    expected = ref(tokens)
    stages = [LlamaStage(SPEC, 3, first=True, last=False),
              LlamaStage(SPEC, 1, first=False, last=False, layer_offset=3),
              LlamaStage(SPEC, 4, first=False, last=True, layer_offset=4)]
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, expected)
    ref_state = ref.state_dict()
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, ref_state[name]), name


def test_layers_differ_from_each_other_and_seed_changes_weights():
    ref = LlamaStage.full(SPEC)
    assert not torch.equal(ref.layers["0"].attention.wq.weight, ref.layers["1"].attention.wq.weight)
    other = LlamaStage.full(SPEC, seed=1)
    assert not torch.equal(ref.layers["0"].attention.wq.weight, other.layers["0"].attention.wq.weight)


@pytest.mark.parametrize("level", ["selective", "full", "full:2", "full:every2"])
def test_recompute_gives_the_same_loss_and_gradients(level):
    """full:K checkpoints the first K blocks and keeps everything of the rest; full:everyN every N-th."""
    levels = layer_recompute_levels(level, SPEC.num_layers)
    tokens = _tokens()
    base = LlamaStage.full(SPEC)
    _loss(base, tokens).backward()
    model = LlamaStage.full(SPEC, recompute=levels)
    assert [block.recompute for block in model.layers.values()] == levels
    loss = _loss(model, tokens)
    loss.backward()
    assert torch.allclose(loss, _loss(base, tokens), atol=ATOL)
    grads = dict(base.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=ATOL), name


def test_op_level_selective_recompute_reproduces_the_model():
    """torchtitan's op-level policy on memx's blocks: the same loss and gradients as keeping all."""
    tokens = _tokens()
    base = LlamaStage.full(SPEC)
    base_loss = _loss(base, tokens)
    base_loss.backward()
    model = LlamaStage.full(SPEC, recompute="selective", selective_policy="op")
    loss = _loss(model, tokens)
    loss.backward()
    assert torch.allclose(loss, base_loss, atol=ATOL)
    # The policy reaches the blocks: they keep other tensors than the attention-core policy does.
    x = torch.randn(4, 64, SPEC.hidden_size, requires_grad=True)
    kept = {policy: saved_storage_bytes(lambda p=policy: TransformerBlock(SPEC, "selective", p)(x))
            for policy in ("attention", "op")}
    assert kept["op"] != kept["attention"]
    assert [block.selective_policy for block in model.layers.values()] == ["op"] * SPEC.num_layers
    grads = dict(base.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=ATOL), name


def test_recompute_levels_really_drop_saved_activations():
    """Bytes saved for backward by one block fall from none to selective to full."""
    x = torch.randn(4, 64, SPEC.hidden_size, requires_grad=True)
    saved = {level: saved_storage_bytes(lambda: TransformerBlock(SPEC, recompute=level)(x))
             for level in ("none", "selective", "full")}
    assert saved["none"] > saved["selective"] > saved["full"]


def test_full_recompute_stops_before_the_block_s_last_linear():
    """torch's non-reentrant checkpoint stops its recompute once the block's last saved tensor is
    back, the input of its last linear: the matmul FLOPs the backward adds under full recompute
    are the forward's less that linear's, the last of memx's ``linear_shapes``
    (``--checkpoint-early-stop``)."""
    from torch.utils.flop_counter import FlopCounterMode
    from memx_launch.planning.matmuls import linear_shapes
    from memx_launch.specs.training import TrainingSpec

    x = torch.randn(2, 64, SPEC.hidden_size, requires_grad=True)
    flops = {}
    for level in ("none", "full"):
        block = TransformerBlock(SPEC, level)
        with FlopCounterMode(display=False) as forward:
            y = block(x)
        with FlopCounterMode(display=False) as backward:
            y.sum().backward()
        flops[level] = (forward.get_total_flops(), backward.get_total_flops())
    n, k = linear_shapes(SPEC, TrainingSpec(fused_gate_up=False), 1)[-1]
    assert (n, k) == (SPEC.hidden_size, SPEC.ffn_hidden_size)  # the MLP's down projection
    assert flops["full"][1] - flops["none"][1] == flops["none"][0] - 2 * x.shape[0] * x.shape[1] * n * k


def test_full_k_checkpoints_the_first_k_blocks_and_no_others():
    """A stage's ``full:K`` text: the first K blocks keep only their input, the rest everything.
    Measured: the bytes autograd saves sit exactly K/N of the way from "none" to "full"."""
    n, k = SPEC.num_layers, 2
    assert layer_recompute_levels("full:2", 4) == ["full", "full", "none", "none"]
    assert layer_recompute_levels("full:every2", 4) == ["none", "full", "none", "full"]
    model = LlamaStage.full(SPEC, recompute=f"full:{k}")
    assert [block.recompute for block in model.layers.values()] == ["full"] * k + ["none"] * (n - k)
    tokens = _tokens()
    none, full, some = (saved_storage_bytes(lambda r=recompute: _loss(LlamaStage.full(SPEC, recompute=r), tokens))
                        for recompute in ("none", "full", f"full:{k}"))
    assert full < some < none
    assert some - full == (none - full) * (n - k) // n


def test_recompute_rejects_unknown_level():
    with pytest.raises(ConfigError, match="recompute"):
        TransformerBlock(SPEC, recompute="some")
    with pytest.raises(ConfigError, match="recompute"):
        LlamaStage.full(SPEC, recompute=["full"])  # one level for a model of several layers


def test_out_of_range_layers_are_a_config_error():
    with pytest.raises(ConfigError, match="num_layers"):
        LlamaStage(SPEC, 5, first=False, last=True, layer_offset=4)


def _tp_worker(rank, port, world, result_queue):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = apply_tensor_parallel(LlamaStage.full(SPEC, recompute="selective"), mesh)
        tokens = _tokens()
        loss = _loss(model, tokens)
        loss.backward()
        wq = model.layers["0"].attention.wq.weight
        w2 = model.layers["7"].feed_forward.w2.weight
        # numpy arrays travel by value; tensors would go through shared memory that dies with the worker
        result_queue.put((rank, (loss.item(), tuple(wq.to_local().shape), wq.grad.full_tensor().numpy(),
                                 w2.grad.full_tensor().numpy(), model.layers["0"].attention_norm.weight.grad.numpy())))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_matches_the_reference():
    tokens = _tokens()
    ref = LlamaStage.full(SPEC)
    ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    results = spawn_ranks(_tp_worker, 2, 2)
    for loss, local_shape, wq_grad, w2_grad, norm_grad in results.values():
        assert local_shape == (SPEC.hidden_size // 2, SPEC.hidden_size)
        assert abs(loss - ref_loss.item()) < ATOL
        assert torch.allclose(torch.from_numpy(wq_grad), ref.layers["0"].attention.wq.weight.grad, atol=ATOL)
        assert torch.allclose(torch.from_numpy(w2_grad), ref.layers["7"].feed_forward.w2.weight.grad, atol=ATOL)
        assert torch.allclose(torch.from_numpy(norm_grad), ref.layers["0"].attention_norm.weight.grad, atol=ATOL)


def test_tensor_parallel_rejects_a_degree_that_does_not_divide_the_heads():
    class FakeMesh:
        def size(self):
            return 4  # llama-tiny has 2 KV heads

    with pytest.raises(ConfigError, match="tp"):
        apply_tensor_parallel(LlamaStage.full(SPEC), FakeMesh())
