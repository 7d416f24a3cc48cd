"""memx's runtime trains sliding-window and chunked attention where the model has it (Mistral,
Gemma, GPT-OSS's and Llama 4's local blocks), in the blocks the families place it, as the plan
priced it: not full attention. No processes."""

import dataclasses

import torch

from memx_launch.models.llama import LlamaStage, _attention_core, local_attention_mask
from memx_launch.specs.catalog import get_model
from memx_launch.specs.local_attention import attends_locally

TINY = get_model("llama-tiny")


def test_the_masks_keep_each_query_within_its_window_or_chunk():
    window = local_attention_mask(5, 2, 0, "cpu").int().tolist()
    assert window == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    chunk = local_attention_mask(5, 0, 2, "cpu").int().tolist()
    assert chunk == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]


def test_windowed_attention_is_softmax_over_the_window_only():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    out = _attention_core(q, k, v, window=4)
    # The attention weights themselves: the same call with the identity as values.
    weights = _attention_core(q, k, torch.eye(12).expand(1, 2, 12, 12), window=4)
    assert (weights.triu(1) == 0).all() and (weights.tril(-4) == 0).all()  # causal, the last 4 keys
    assert torch.allclose(weights.sum(-1), torch.ones(1, 2, 12), atol=1e-5)
    assert torch.allclose(out, weights @ v, atol=1e-5)
    full = _attention_core(q, k, v)
    assert torch.allclose(out[..., :4, :], full[..., :4, :], atol=1e-6)  # within the first window: the same
    assert not torch.allclose(out, full, atol=1e-3)  # beyond it, not
    assert torch.allclose(_attention_core(q, k, v, window=12), full)  # a window as wide as the sequence


def test_the_local_blocks_are_where_the_families_put_them():
    def local(model):
        return [attends_locally(model, i) for i in range(model.num_layers)]

    gemma3 = dataclasses.replace(TINY, num_layers=62, sliding_window=1024, full_attention_layers=10)
    assert [i for i, loc in enumerate(local(gemma3)) if not loc] == list(range(5, 62, 6))  # (i + 1) % 6 == 0
    gpt_oss = get_model("gpt-oss-120b")
    assert [i for i, loc in enumerate(local(gpt_oss)) if not loc] == list(range(1, 36, 2))
    scout = get_model("llama4-scout")
    assert [i for i, loc in enumerate(local(scout)) if not loc] == list(range(3, 48, 4))  # its NoPE blocks
    assert all(local(dataclasses.replace(TINY, sliding_window=4096)))  # Mistral: every block
    assert not any(local(TINY))


def test_a_stage_of_a_windowed_model_runs_its_blocks_as_the_whole_model_does():
    spec = dataclasses.replace(TINY, sliding_window=8, full_attention_layers=4)
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    whole = LlamaStage.full(spec)
    assert [b.attention.window for b in whole.layers.values()] == [8, 0] * 4
    stages = [LlamaStage(spec, 3, first=True, last=False), LlamaStage(spec, 5, first=False, last=True, layer_offset=3)]
    assert [b.attention.window for b in stages[1].layers.values()] == [0, 8, 0, 8, 0]
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, whole(tokens))
    assert not torch.allclose(whole(tokens), LlamaStage.full(TINY)(tokens))


def test_calibration_times_the_model_s_share_of_local_blocks(monkeypatch):
    from memx_launch.models import llama
    from memx_launch.profiling import kernel
    from memx_launch.profiling.space import Sample

    alternate = dataclasses.replace(TINY, sliding_window=8, full_attention_layers=4)  # half local
    assert kernel.local_blocks(alternate, 2) == [True, False]
    assert kernel.local_blocks(alternate, 4) == [True, True, False, False]
    assert kernel.local_blocks(dataclasses.replace(TINY, sliding_window=8), 2) == [True, True]
    assert kernel.local_blocks(TINY, 2) == [False, False]
    built = []
    original = llama.TransformerBlock

    def recording(*args, **kwargs):
        block = original(*args, **kwargs)
        built.append(block.attention.window)
        return block

    monkeypatch.setattr(llama, "TransformerBlock", recording)
    sample = Sample(tp=1, micro_batch_size=1, seq_len=16, recompute="none", num_kv_heads=alternate.num_kv_heads)
    seconds = kernel._run_sample(alternate, sample, torch.device("cpu"), None, "fp32", 2, 1, 1)[0]
    assert built == [8, 0] and seconds > 0
