"""The loss on the last stage: torch's loss parallel (DTensor's ``loss_parallel()``) against
Megatron's vocab-parallel kernel, in memory and in HBM bytes."""

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning.loss import (LOSS_BYTES_PER_LOGIT, LOSS_PARALLEL_BYTES_PER_LOGIT, logits_bytes,
                                       loss_hbm_bytes_per_logit)
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec


def test_torch_loss_parallel_peak_per_logit_is_measured_on_cpu():
    """torchtitan's loss under TP (``.float()`` of the vocabulary-sharded logits, torch's cross
    entropy inside ``loss_parallel()``, the logits deleted before the backward), forward and
    backward on a one-rank mesh: the live-tensor peak of the profiler's memory timeline is 16
    bytes per logit of the rank's shard, what ``logits_bytes`` counts (Megatron's kernel: 8)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    tokens, vocab, width = 1024, 8192, 64
    hidden = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(vocab, width, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            logits = DTensor.from_local(hidden @ head.t(), mesh, [Shard(-1)], run_check=False)
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(logits.float(), target)
                del logits  # torchtitan frees them before the backward
                loss.backward()
    finally:
        dist.destroy_process_group()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    peak_per_logit = np.asarray(sizes).sum(axis=1).max() / (tokens * vocab)
    spec = get_model("llama2-7b")
    training = TrainingSpec(vocab_parallel_loss=True, torch_loss_parallel=True)
    modelled = float(logits_bytes(spec, 1, 1, 2, training)) * 2 / spec.vocab_size  # per logit of a TP 2 shard
    # The gradients of the hidden states and the head weight add 0.14 bytes per logit here.
    assert peak_per_logit == pytest.approx(modelled, abs=0.3)
    megatron = float(logits_bytes(spec, 1, 1, 2, TrainingSpec(vocab_parallel_loss=True))) * 2 / spec.vocab_size
    assert modelled == 2 * megatron


def test_each_tp_rank_holds_its_share_and_moves_more_bytes_than_megatron_s_kernel():
    model = get_model("llama3-8b")
    parallel = TrainingSpec(vocab_parallel_loss=True, torch_loss_parallel=True)
    logits = 2 * 4096 * model.output_vocab
    assert float(logits_bytes(model, 2, 4096, 8, parallel)) == 16 * logits / 8
    assert float(logits_bytes(model, 2, 4096, 8, TrainingSpec(vocab_parallel_loss=True, torch_loss_parallel=True,
                                                               loss_dtype="bf16"))) == 8 * logits / 8
    assert loss_hbm_bytes_per_logit(model, parallel, 8) == LOSS_PARALLEL_BYTES_PER_LOGIT > LOSS_BYTES_PER_LOGIT
    assert loss_hbm_bytes_per_logit(model, TrainingSpec(vocab_parallel_loss=True), 8) == LOSS_BYTES_PER_LOGIT
    assert loss_hbm_bytes_per_logit(model, TrainingSpec(fused_loss=True, torch_loss_parallel=True), 8) == 6.0
    # Without a TP group there is nothing to parallelize: torchtitan's loss is torch's cross entropy.
    gathered = TrainingSpec(vocab_parallel_loss=False)
    assert float(logits_bytes(model, 2, 4096, 1, parallel)) == float(logits_bytes(model, 2, 4096, 1, gathered))
    assert loss_hbm_bytes_per_logit(model, parallel, 1) == LOSS_BYTES_PER_LOGIT


def test_torch_loss_parallel_needs_a_vocab_parallel_loss():
    with pytest.raises(ConfigError, match="--torch-loss-parallel"):
        TrainingSpec(vocab_parallel_loss=False, torch_loss_parallel=True)
    with pytest.raises(ConfigError, match="--torch-loss-parallel"):
        TrainingSpec(setup="fsdp2", torch_loss_parallel=True)  # fsdp2 gathers the logits unless told
    assert TrainingSpec(setup="fsdp2", vocab_parallel_loss=True, torch_loss_parallel=True).torch_loss_parallel
    assert TrainingSpec(setup="torchtitan").torch_loss_parallel


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_where_few_tokens_meet_a_large_vocabulary_the_head_s_fresh_gradient_is_the_peak(dtype, monkeypatch):
    """memx's LLaMA last stage (one block of hidden 512, recomputed, a vocabulary of 32,768), 64 tokens, a
    second micro-batch with gradients held (``--setup ddp``: a region of autocast per forward):
    the output layer's backward makes its weight's fp32 gradient (in fp32 beside the logits' fp32
    gradient; in bf16 the cast of its 16-bit gradient, once the weight's 16-bit copy is freed),
    twice the loss's own peak. The step's rise, less that copy (a parameter part), within 1% of the
    count; the loss's peak alone under half of it."""
    import math
    from dataclasses import replace

    torch = pytest.importorskip("torch")
    from memx_launch.models.llama import LlamaStage
    from memx_launch.planning import loss
    from memx_launch.profiling.emulation import EmulatedDevice

    spec = replace(get_model("llama-small"), vocab_size=32768)
    torch.manual_seed(0)
    stage = LlamaStage(spec, 1, first=False, last=True, recompute="full")  # the block keeps its input alone
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    x, target = torch.randn(1, 64, spec.hidden_size), torch.randint(0, spec.vocab_size, (64,))
    with EmulatedDevice("probe", math.inf) as device:
        device.track([*stage.parameters(), *(p.grad for p in stage.parameters())])
        for _ in range(2):  # micro-batches
            device.reset_peak()
            before = device.live_bytes
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = stage(x.clone().requires_grad_(True))
                value = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target)
            value.backward()
    copy = 2 * spec.vocab_size * spec.hidden_size if dtype == "bf16" else 0
    training = TrainingSpec(setup="ddp", dtype=dtype)
    assert device.peak_bytes - before - copy == pytest.approx(float(logits_bytes(spec, 1, 64, 1, training)), rel=0.01)
    monkeypatch.setattr(loss, "head_gradient_bytes", lambda *args: 0.0)
    assert float(logits_bytes(spec, 1, 64, 1, training)) < 0.5 * (device.peak_bytes - before - copy)
