"""models/router_loss.py: a Hugging Face mixture's load-balancing loss carried through pipeline
stages equals the one its own forward adds, in value and in every gradient (one process)."""

import pytest
import torch

from memx_launch.models.adapters import ModelParts
from memx_launch.runtime.batches import BatchLoss, default_loss

pytest.importorskip("transformers")

COEF = 0.5  # large, so that a loss without the term is far off


def _mixture(family):
    from test_adapters import _hf_config
    from transformers import AutoModelForCausalLM

    config = _hf_config(family)
    config.output_router_logits, config.router_aux_loss_coef = True, COEF
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _stages(parts, x, layers, recompute, mask):
    offset, out = 0, (x,)
    for i, (n, level) in enumerate(zip(layers, recompute)):
        stage = parts.stage(offset, n, first=i == 0, last=i == len(layers) - 1, recompute=level)
        out = stage(*out, attention_mask=mask)
        offset += n
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("padded", [False, True], ids=["full rows", "right-padded"])
def test_stages_carry_the_load_balancing_loss_the_model_adds(family, padded):
    model = _mixture(family)
    x = torch.randint(0, 97, (2, 8))
    mask = torch.ones_like(x)
    if padded:
        mask[1, 5:] = 0
    ref = model(x, attention_mask=mask if padded else None)
    reference_loss = ref.logits.square().mean() + COEF * ref.aux_loss
    reference_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    parts = ModelParts(model)
    assert parts.router_loss.num_routers == 3 and parts.takes_mask
    logits, router_term = _stages(parts, x, [1, 1, 1], ["full", "none", "selective"], mask if padded else None)
    assert torch.allclose(logits, ref.logits, atol=1e-6, rtol=0)
    assert router_term.item() == pytest.approx(COEF * ref.aux_loss.item(), rel=1e-6)
    assert abs(router_term.item()) > 0.1  # the term is large enough to tell
    (logits.square().mean() + router_term).backward()
    routers = [n for n in ref_grads if "gate.weight" in n and "shared" not in n]
    assert len(routers) == 3
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-6, rtol=0), name


def test_the_pipeline_loss_adds_the_term_and_a_model_without_it_carries_nothing():
    targets = torch.randint(0, 97, (2, 8))
    logits = torch.randn(2, 8, 97)
    loss = BatchLoss(default_loss)
    assert loss((logits, torch.tensor(0.25)), targets).item() == pytest.approx(default_loss(logits, targets).item() + 0.25)
    from test_adapters import _hf_config
    from transformers import AutoModelForCausalLM

    plain = ModelParts(AutoModelForCausalLM.from_config(_hf_config("mixtral")))  # output_router_logits off
    assert plain.router_loss is None and plain.takes_mask  # its blocks take the padding mask, as Llama's
    stage = plain.stage(0, 1, first=True, last=False, recompute="none")
    assert isinstance(stage(torch.randint(0, 97, (1, 4))), torch.Tensor)
    mixture = ModelParts(_mixture("mixtral"))
    probe = mixture.block_probe("none")  # calibration times a block: a tensor in and out
    assert isinstance(probe(torch.randn(1, 4, 32)), torch.Tensor)
    mixture.verify()  # without gradients: the logits alone, as the model's own forward gives them


def test_a_config_asking_for_the_loss_plans_its_sums_into_every_pipeline_send():
    import json
    import os

    from memx_launch.errors import ConfigError
    from memx_launch.planning.pipeline_sends import edge_hidden_bytes
    from memx_launch.specs.hf_config import model_from_hf_dict
    from memx_launch.specs.training import TrainingSpec

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "models", "hf-mixtral-tiny", "config.json")
    with open(path) as f:
        config = json.load(f)
    plain = model_from_hf_dict(config, "mixtral")
    carried = model_from_hf_dict({**config, "output_router_logits": True}, "mixtral")
    assert not plain.router_aux_loss and carried.router_aux_loss
    layout = type("Layout", (), {"stage_dp": None, "cp": 1, "tp": 1, "uniform_tp": True})
    for dtype in ("fp32", "bf16"):  # the sums are fp32 whatever the hidden state's precision
        training = TrainingSpec(global_batch_size=8, seq_len=32, dtype=dtype, setup="memx-run")
        sent = [edge_hidden_bytes(m, training, layout, 2, 32) for m in (plain, carried)]
        assert sent[1] - sent[0] == 2 * plain.num_experts * 4
    with pytest.raises(ConfigError, match="output_router_logits: must be a bool"):
        model_from_hf_dict({**config, "output_router_logits": "yes"}, "mixtral")


def test_a_load_balancing_loss_of_other_arithmetic_is_refused(monkeypatch):
    import sys

    from memx_launch.errors import ConfigError

    model = _mixture("qwen3_moe")  # its own copy of Mixtral's function: carried
    assert ModelParts(model).router_loss is not None
    module = sys.modules[type(model).__module__]
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *args, **kwargs: 0.0)
    with pytest.raises(ConfigError, match="load-balancing loss is not the one memx carries"):
        ModelParts(model)


def test_a_fully_sharded_16_bit_stage_adds_to_the_sums_it_received_in_fp32():
    """FSDP2's bf16 policy casts a unit's floating inputs: the sums, counts of millions of tokens,
    would lose all but 8 bits at each stage. The stage's own unit leaves them as sent."""
    import torch.distributed as dist

    from memx_launch.runtime.fsdp_units import shard_stage

    parts = ModelParts(_mixture("mixtral"))
    stage = parts.stage(1, 1, first=False, last=False, recompute="none")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shard_stage(stage, None, "bf16")
        received = torch.tensor([[1_000_001.0, 3.0, 5.0, 7.0], [0.5, 0.25, 0.125, 2.0]])  # not all bf16 numbers
        x = torch.randn(2, 8, 32, requires_grad=True)
        h, sums = stage(x, received.clone())
        (h.float().sum() + sums.sum()).backward()
    finally:
        dist.destroy_process_group()
    assert h.dtype == torch.bfloat16 and sums.dtype == torch.float32  # the blocks ran in bf16
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0  # sent back as received
    added = sums.detach() - received
    assert torch.equal(added[0], added[0].round()) and added[0].sum().item() == 2 * 8 * 2  # tokens x top-k
    assert added[1].sum().item() == pytest.approx(2 * 8, rel=1e-3)  # each token's probabilities sum to 1
