"""Memory terms of what a framework keeps beyond Korthikanti's per-layer tensors: sequence
parallelism that keeps gathered inputs, unfused attention's backward working set, pipeline
buffers that keep stage outputs and the previous micro-batch's logits, torch's receive buffers."""

import dataclasses
import os

import numpy as np
import pytest

from estimates import cluster_file, estimated_plan
from memx_launch.errors import ConfigError
from memx_launch.planning import activation_ops
from memx_launch.planning import costmodel as cm
from memx_launch.planning import elementwise
from memx_launch.planning import matmuls as mm
from memx_launch.planning import schedules
from memx_launch.planning.loss import LOSS_BYTES_PER_LOGIT, SOFTCAP_PASSES, logits_bytes
from memx_launch.planning.model_states import last_stage_params, weight_copy_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.peaks import SUSTAINED_HBM_SHARE, hbm_gbps
from memx_launch.planning.plan import layer_recompute_levels
from memx_launch.planning.pipeline_buffers import kept_stage_output_bytes, torch_receive_buffer_bytes
from memx_launch.profiling.saved_tensors import saved_storage_bytes
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import FLASH_ATTENTION_VERSIONS, TrainingSpec

S, H, T = 8192, 5120, 4
MODEL = get_model("llama2-13b")
HF_LLAMA = os.path.join(os.path.dirname(__file__), "..", "examples", "models", "hf-llama-tiny")
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_sequence_parallel_that_keeps_gathered_inputs_splits_only_the_norm_inputs():
    megatron = float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE, sequence_parallel=True).activation_bytes)
    gathered = float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE, sequence_parallel=True,
                                         sp_keeps_gathered_input=True).activation_bytes)
    off = float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE).activation_bytes)
    # The two normed tensors fed to the linears (4 sbh) stay whole; the norm inputs split.
    assert gathered - megatron == pytest.approx(4 * S * H * (1 - 1 / T))
    assert megatron < gathered < off
    # Without sequence parallelism the option changes nothing.
    same = float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE, sp_keeps_gathered_input=True).activation_bytes)
    assert same == off


def test_unfused_attention_backward_holds_score_gradients():
    a = MODEL.num_heads
    flash = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=True).working_bytes
    fused = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=False).working_bytes
    torch_softmax = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=False,
                                        fused_softmax=False).working_bytes
    score = 2.0 * a / T * S * S  # one 16-bit s x s tensor per head on this rank
    stream = 2.0 * S * H  # a 16-bit gradient of the block's input or output
    mlp_tensors = 4 * 2.0 * S * MODEL.ffn_hidden_size / T  # gate, up, silu(gate) and their product, on this rank
    # Attention's phase: both stream gradients and the scores', the MLP's tensors freed by then;
    # flash attention has no scores, and the MLP's phase is its larger: the output's gradient and
    # two f-wide gradients on this rank.
    assert float(fused) == pytest.approx(2 * stream + score - mlp_tensors)
    assert float(torch_softmax - fused) == pytest.approx(score)
    mlp_phase = stream + 2 * 2.0 * S * MODEL.ffn_hidden_size / T
    assert float(flash) == pytest.approx(mlp_phase) and mlp_phase > 2 * stream
    # Full recompute rebuilds the kept probabilities as well.
    full = cm.activation_bytes(MODEL, 1, S, T, cm.FULL, flash_attention=False).working_bytes
    assert float(full - fused) == pytest.approx(
        float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=False).activation_bytes))


def test_selective_recompute_runs_each_part_again_in_its_own_phase():
    """The attention-core policy runs the attention core again in the attention's backward and the
    MLP's activation in the MLP's: with unfused attention at 8k tokens the attention's phase is
    the peak, where the block holds what it holds without recompute (the scores run again, the
    MLP's tensors freed either way), so one block's peak is the same at both levels; counted with
    the product beside the scores, Gemma 2's block at selective measured 0.80 of its count."""
    none, selective = (cm.activation_bytes(MODEL, 1, S, T, level, flash_attention=False)
                       for level in (cm.NONE, cm.SELECTIVE))
    product = 2.0 * S * MODEL.ffn_hidden_size / T  # the down projection's 16-bit input, which selective drops
    assert float(none.activation_bytes - selective.activation_bytes) > 10 * product  # the scores
    assert float(selective.activation_bytes + selective.working_bytes) == pytest.approx(
        float(none.activation_bytes + none.working_bytes))


def test_kept_stage_outputs_and_the_previous_logits():
    b, pp = 2, 4
    inflight = schedules.inflight_microbatches(np.arange(pp), pp, 16)
    off = kept_stage_output_bytes(MODEL, TrainingSpec(), b, S, T, inflight, 16)
    assert not off.any()
    kept = kept_stage_output_bytes(MODEL, TrainingSpec(setup="scaling"), b, S, T, inflight, 16)
    assert list(kept[:-1]) == pytest.approx([(pp - i) * b * S * H * 2 for i in range(pp - 1)])
    outputs = kept_stage_output_bytes(MODEL, TrainingSpec(keep_stage_outputs=True), b, S, T, inflight, 16)
    assert list(outputs) == pytest.approx(list(kept[:-1]) + [0])  # no previous logits without their buffer
    two = schedules.inflight_microbatches(np.arange(pp), pp, 16, 2)  # two chunks a rank: each chunk micro-batch's
    chunks = kept_stage_output_bytes(MODEL, TrainingSpec(keep_stage_outputs=True), b, S, T, two, 16, 2)
    assert list(chunks) == pytest.approx([2 * n * b * S * H * 2 for n in two])
    assert kept[-1] == 2 * b * S * MODEL.vocab_size  # gathered 16-bit logits of the previous micro-batch
    vocab_parallel = kept_stage_output_bytes(MODEL, TrainingSpec(setup="scaling", vocab_parallel_loss=True),
                                                b, S, T, inflight, 16)
    assert vocab_parallel[-1] == kept[-1] / T
    single = kept_stage_output_bytes(MODEL, TrainingSpec(setup="scaling"), b, S, T, inflight[:1], 1)
    assert single[-1] == 0  # one micro-batch: no previous logits


def test_torch_receive_buffers_beyond_the_inputs_in_flight():
    b, pp, g = 2, 4, 8
    boundary = b * S * H * 2
    torch_stages = TrainingSpec(torch_pipelining=True)
    inflight = schedules.inflight_microbatches(np.arange(pp), pp, g)  # 4, 3, 2, 1
    buffers = torch_receive_buffer_bytes(MODEL, torch_stages, b, S, T, inflight, g)
    # (inputs not in flight + gradient buffers) per stage: the first receives no input, the last no gradient
    assert list(buffers / boundary) == pytest.approx([0 + 8, 5 + 8, 6 + 8, 7 + 0])
    # Two chunks a rank: twice the buffers, the first chunk's input and the last chunk's gradient excepted.
    two = schedules.inflight_microbatches(np.arange(pp), pp, g, 2)
    chunks = torch_receive_buffer_bytes(MODEL, torch_stages, b, S, T, two, g, 2)
    idle = 1 - two / g
    assert list(chunks / boundary) == pytest.approx([8 * idle[0] + 16, 16 * idle[1] + 16, 16 * idle[2] + 16,
                                                      16 * idle[3] + 8])
    sequence_parallel = torch_receive_buffer_bytes(MODEL, TrainingSpec(torch_pipelining=True, sequence_parallel=True),
                                                   b, S, T, inflight, g)
    assert list(sequence_parallel) == pytest.approx(list(buffers / T))  # each TP rank's 1/T of the sequence
    autocast = torch_receive_buffer_bytes(MODEL, TrainingSpec(torch_pipelining=True, weights_dtype="fp32"),
                                          b, S, T, inflight, g)
    assert list(autocast) == pytest.approx(list(2 * buffers))  # fp32 hidden states over fp32 weights
    assert not torch_receive_buffer_bytes(MODEL, TrainingSpec(), b, S, T, inflight, g).any()
    assert not torch_receive_buffer_bytes(MODEL, torch_stages, b, S, T, inflight[:1], g).any()  # no pipeline


def test_torch_receive_buffers_are_the_estimate_s_pipeline_part():
    cluster = ClusterSpec.from_dict({
        "version": 1, "device_types": {"a100": {"vendor": "nvidia", "memory_gib": 79.3, "peak_tflops": 312,
                                                "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}], "inter_node_gbps": 25})
    plans = {on: evaluate_layout(MODEL, cluster, TrainingSpec(global_batch_size=16, seq_len=4096, torch_pipelining=on),
                                 tp=2, pp=4, dp=1, micro_batch_size=1) for on in (False, True)}
    g = plans[True].num_microbatches
    inflight = schedules.inflight_microbatches(np.arange(4), 4, g)
    buffers = torch_receive_buffer_bytes(MODEL, TrainingSpec(torch_pipelining=True), 1, 4096, 2, inflight, g)
    for stage, off, on in zip(range(4), plans[False].stages, plans[True].stages):
        assert on.memory_parts_gib["pipeline_buffers"] - off.memory_parts_gib["pipeline_buffers"] == pytest.approx(
            buffers[stage] / 2**30)
        assert on.predicted_peak_memory_gib - off.predicted_peak_memory_gib == pytest.approx(buffers[stage] / 2**30,
                                                                                             abs=0.01)


def test_the_scaling_setup_turns_a_fit_into_an_oom():
    """LLaMA-2-13B, 8k tokens, TP 4 PP 2, micro-batch 4, sequence parallelism: ZeRO-1's states
    alone fit in an A100; with the scaling codebase's gathered linear inputs and buffers it does not."""
    cluster = ClusterSpec.from_dict({
        "version": 1, "device_types": {"a100": {"vendor": "nvidia", "memory_gib": 79.3, "peak_tflops": 312,
                                                "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300} for _ in range(8)], "inter_node_gbps": 25})
    peaks = {}
    for setup in ("zero1", "scaling"):
        training = TrainingSpec(global_batch_size=512, seq_len=S, setup=setup, sequence_parallel=True,
                                vocab_parallel_loss=False)
        plan = evaluate_layout(MODEL, cluster, training, tp=4, pp=2, dp=8, micro_batch_size=4,
                               references=(1.0, 1.0, 1.0))
        peaks[setup] = max(s.predicted_peak_memory_gib for s in plan.stages)
    assert peaks["zero1"] < 79.3 < peaks["scaling"]


# --------------------------------------------------------------------------- recompute of K of n layers


def hf_decoder_layer(folder: str, seq: int, batch: int):
    """The decoder layer of the Hugging Face config in ``folder`` as Transformers builds it (a
    mixture's experts as its causal LM builds them: grouped GEMMs; SDPA, eager where the family
    has none), weights drawn with std 0.02, an input of ``batch`` x ``seq`` tokens and its rotary
    tables."""
    import importlib

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(folder)
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    prefix = type(config).__name__.removesuffix("Config")
    sdpa = getattr(module, f"{prefix}PreTrainedModel")._supports_sdpa
    config._attn_implementation, config._experts_implementation = "sdpa" if sdpa else "eager", "grouped_mm"
    torch.manual_seed(0)
    layer = getattr(module, f"{prefix}DecoderLayer")(config, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    return layer, x, getattr(module, f"{prefix}RotaryEmbedding")(config)(x, torch.arange(seq)[None])


def hf_layer_kept_bytes(layer, x, rotary, dtype: str) -> int:
    """What autograd saves for a Transformers decoder layer (:func:`hf_decoder_layer`) as memx-run
    trains it: fp32 weights, under bf16 autocast for ``dtype`` bf16; its parameters, their casts
    (each expert's of a mixture's 3-D weights too) and the rotary tables aside. The layer reads
    ``x`` as an op's output, as in a model: autocast caches its casts of leaves that need a
    gradient, which would give the linears that read a leaf input (OLMo 2's: its norms come after
    them) one cast between them."""
    import torch

    weights = {tuple(s[::k]) for p in layer.parameters() for s in (p.shape, p.shape[1:]) for k in (1, -1)}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        return saved_storage_bytes(lambda: layer(x * 1.0, position_embeddings=rotary, attention_mask=None),
                                   owned=(*layer.parameters(), *rotary), skip_shapes=weights)


# What _a100s' element-wise kernels move per second: the datasheet's 2,039 GB/s at NVIDIA's sustained share.
A100_BYTES_PER_S = 2039e9 * SUSTAINED_HBM_SHARE["nvidia"]


def _a100s():
    return ClusterSpec.from_dict({
        "version": 1, "device_types": {"a100": {"vendor": "nvidia", "memory_gib": 79.3, "peak_tflops": 312,
                                                "memory_bandwidth_gbps": 2039}},
        "nodes": [{"devices": {"a100": 8}, "intra_node_gbps": 300}]})


def _estimate(recompute):
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron")
    return evaluate_layout(MODEL, _a100s(), training, tp=2, pp=2, dp=2, micro_batch_size=1,
                           recompute=recompute, references=(1.0, 1.0, 1.0))


def test_recomputing_k_of_a_stages_layers_lies_between_none_and_full():
    none, full = _estimate("none"), _estimate("full")
    n = none.stages[0].num_layers
    part = _estimate(f"full:{n // 2},full:{n // 2}")
    for i in range(2):
        assert none.stages[i].predicted_peak_memory_gib > part.stages[i].predicted_peak_memory_gib \
            > full.stages[i].predicted_peak_memory_gib
        assert none.stages[i].predicted_stage_time_s < part.stages[i].predicted_stage_time_s \
            < full.stages[i].predicted_stage_time_s
    assert [s.recompute for s in part.stages] == [f"full:{n // 2}"] * 2
    # K = n is full recompute, K = 0 none; the per-layer terms are linear in K.
    assert _estimate(f"full:{n}").stages[0].predicted_peak_memory_gib == full.stages[0].predicted_peak_memory_gib
    assert _estimate("full:0").stages[0].predicted_peak_memory_gib == none.stages[0].predicted_peak_memory_gib
    quarter = _estimate(f"full:{n // 4}").stages[1].predicted_stage_time_s
    assert quarter - none.stages[1].predicted_stage_time_s == pytest.approx(
        (part.stages[1].predicted_stage_time_s - none.stages[1].predicted_stage_time_s) * (n // 4) / (n // 2))


def _own_gpt_peak(recomputed) -> int:
    """The guard's peak of a step of examples/train_own_model.py's GPT shaped by
    lightning-gpt/config.json (8 blocks, fp32, AdamW, one process), the blocks ``recomputed``
    (a stage's recompute text) names checkpointed (torch's non-reentrant checkpoint): the step
    after the first, whose optimizer states and gradients are allocated."""
    import importlib.util
    import math

    import torch

    from memx_launch.profiling.emulation import EmulatedDevice

    spec = importlib.util.spec_from_file_location("own_model", os.path.join(EXAMPLES, "train_own_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build(os.path.join(EXAMPLES, "models", "lightning-gpt"), 0)
    levels = layer_recompute_levels(recomputed, len(model.blocks))
    for block in (b for b, level in zip(model.blocks, levels) if level == "full"):
        forward = block.forward
        block.forward = lambda x, forward=forward: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (8, 65), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with EmulatedDevice("probe", math.inf) as device:
            device.track([*model.parameters(), *(t for s in optimizer.state.values() for t in s.values() if t.dim())])
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return device.peak_bytes


def test_a_stage_recomputing_some_layers_holds_its_last_recomputed_one_beside_the_kept_ones_before_it(
        tmp_path, monkeypatch):
    """Megatron's block method (``full:K``): the backward runs the kept layers first, then each
    recomputed one after those freed that micro-batch's activations, so one recomputed layer's
    activations do not come on top of every kept layer's. Measured on the own GPT (8 blocks, 3
    recomputed, one process): memx's ``--setup ddp`` estimate is within 8% over the guard's peak
    (over 15% when it added them), the same model with none recomputed within 6%. torchtitan's
    layer checkpointing (``full:everyN``) recomputes its last checkpointed layer beside every kept
    one before it: every other block within 10% over (asked as the first half, ``full:4``, under
    it), every third within 8%."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(EXAMPLES)  # the example's own imports
    cluster = cluster_file(tmp_path, {"version": 1, "nodes": [{"devices": {"small": 1}, "intra_node_gbps": 2}],
                                      "device_types": {"small": {"vendor": "cpu", "memory_gib": 0.0234,
                                                                 "peak_tflops": 0.03, "memory_bandwidth_gbps": 5}}})
    counted = {}
    for recompute in ("none", "full:3", "full:4", "full:every2", "full:every3"):
        plan = estimated_plan(tmp_path, recompute.replace(":", ""), [
            "--model", os.path.join(EXAMPLES, "models", "lightning-gpt"), "--cluster", cluster, "--setup", "ddp",
            "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch-size", "8", "--global-batch-size", "8",
            "--seq-len", "64", "--dtype", "fp32", "--recompute", recompute])
        counted[recompute] = plan["stages"][0]["predicted_peak_memory_gib"] * 2**30
    measured = {recompute: _own_gpt_peak(recompute) for recompute in counted}
    assert 1.0 <= counted["none"] / measured["none"] < 1.06
    assert 1.0 <= counted["full:3"] / measured["full:3"] < 1.08
    assert 1.0 <= counted["full:every2"] / measured["full:every2"] < 1.10
    assert 1.0 <= counted["full:every3"] / measured["full:every3"] < 1.08  # the 7th and 8th freed before the 6th
    assert measured["full:4"] < measured["full:every2"] and counted["full:4"] < measured["full:every2"]
    # Counted before: one recomputed layer's activations and phases beside every kept layer's.
    spec, training = get_model(os.path.join(EXAMPLES, "models", "lightning-gpt")), TrainingSpec(
        global_batch_size=8, seq_len=64, setup="ddp", dtype="fp32")
    full, none = (cm.training_activation_bytes(spec, training, 8, 64, 1, level) for level in (cm.FULL, cm.NONE))
    on_top = float(full.working_bytes) - max(float(none.working_bytes),
                                             float(full.working_bytes) - 5 * float(none.activation_bytes))
    assert (counted["full:3"] + on_top) / measured["full:3"] > 1.15


def test_recompute_of_k_layers_is_validated_and_exported_as_the_block_method():
    from memx_launch.errors import ConfigError
    from memx_launch.planning.exporters import megatron_args
    for bad in ("full:99", "selective:2", "full:x", "half", "full:every0", "full:every", "selective:every2"):
        with pytest.raises(ConfigError, match="--recompute"):
            _estimate(bad)
    n = MODEL.num_layers // 2
    args = megatron_args(_estimate(f"full:3,full:{n // 2}")).args
    assert args[args.index("--recompute-method") + 1] == "block"
    assert args[args.index("--recompute-num-layers") + 1] == str(n // 2)


def test_a_gathered_loss_costs_every_tp_rank_the_whole_vocabulary():
    """The head's time: FLOPs over TP either way; a gathered loss adds the logits' all-gather
    and runs the cross entropy's passes over all of them, not over 1/TP."""
    cluster = _a100s()
    device, mbs = np.zeros(1, int), np.ones(1)
    times = {}
    for vocab_parallel in (True, False):
        model = cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(vocab_parallel_loss=vocab_parallel))
        times[vocab_parallel] = {t: float(model.head_time(device, np.full(1, t), mbs, np.full(1, S))[0])
                                 for t in (1, 4)}
    assert times[True][1] == pytest.approx(times[False][1])  # one rank: the same work
    logits = S * MODEL.vocab_size
    passes = LOSS_BYTES_PER_LOGIT * logits * (1 - 1 / 4) / A100_BYTES_PER_S
    gather = cm.collective_time(2.0 * logits, 4, 300.0 * cluster.link_efficiency)
    assert times[False][4] - times[True][4] == pytest.approx(passes + float(gather), rel=1e-6)


def test_torch_softmax_moves_three_more_passes_over_the_scores():
    """Clone of the scores' view, out-of-place mask fill and its backward: 12 bytes per score."""
    cluster = _a100s()
    args = (np.zeros(1, int), np.full(1, T), np.ones(1), np.full(1, S), np.zeros(1))
    times = {fused: float(cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(
        flash_attention=False, fused_softmax=fused)).layer_costs(*args).time_s[0]) for fused in (True, False)}
    scores = MODEL.num_heads / T * S * S
    assert times[False] - times[True] == pytest.approx(12.0 * scores / A100_BYTES_PER_S, rel=1e-6)


def test_torch_op_norms_move_more_bytes_than_a_fused_kernel():
    cluster = _a100s()
    def layer_time(recompute=cm.NONE, **options):
        args = (np.zeros(1, int), np.full(1, T), np.ones(1), np.full(1, S), np.full(1, recompute))
        return float(cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(**options)).layer_costs(*args).time_s[0])
    extra = 2 * 120 * S * H / A100_BYTES_PER_S  # 32 + 88 bytes per element per norm at 16 bits
    assert layer_time(fused_norm=False) - layer_time() == pytest.approx(extra, rel=1e-6)
    # With sequence parallelism each rank normalises its 1/TP of the sequence.
    sp = layer_time(fused_norm=False, sequence_parallel=True) - layer_time(sequence_parallel=True)
    assert sp == pytest.approx(extra / T, rel=1e-6)
    # Full recompute runs the two norms' forward (32 bytes each) again.
    recomputed = layer_time(fused_norm=False, recompute=cm.FULL) - layer_time(recompute=cm.FULL)
    assert recomputed - (layer_time(fused_norm=False) - layer_time()) == pytest.approx(2 * 32 * S * H / A100_BYTES_PER_S)


def _traced_bytes(fn, *inputs):
    """Bytes eager PyTorch's ops read and write (their tensor inputs and outputs) running
    ``fn`` forward, then backward from a random gradient."""
    torch = pytest.importorskip("torch")
    from traced import byte_counter

    with byte_counter() as forward:
        out = fn(*inputs)
    grad = torch.randn_like(out)
    with byte_counter() as backward:
        out.backward(grad)
    return forward.total, backward.total


def test_torch_op_norm_traffic_is_what_eager_pytorch_reads_and_writes():
    """Every aten op of Hugging Face's LlamaRMSNorm, forward and backward, traced: the bytes of
    its tensor inputs and outputs, per element, less a fused kernel's (2d forward, 4d backward),
    are what the cost model charges."""
    torch = pytest.importorskip("torch")

    def hf_rms_norm(x, weight):
        hidden = x.float()
        return weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)

    rows, width = 256, 2048
    for dtype, d in ((torch.bfloat16, 2), (torch.float32, 4)):
        x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
        weight = torch.ones(width, dtype=dtype, requires_grad=True)
        forward, backward = _traced_bytes(hf_rms_norm, x, weight)
        forward_extra, backward_extra = elementwise.unfused_norm_extra_bytes(d)
        # The per-row statistics and the weight add a few bytes per row, not per element.
        assert forward / x.numel() - elementwise.FUSED_NORM_BYTES[0] * d == pytest.approx(forward_extra, abs=0.1)
        assert backward / x.numel() - elementwise.FUSED_NORM_BYTES[1] * d == pytest.approx(backward_extra, abs=0.1)


def test_element_wise_bytes_are_what_memx_blocks_ops_read_and_write():
    """The rotary embedding and SwiGLU of memx's own LLaMA block (``models/llama.py``), traced in
    16 bits: their bytes per element are ROPE_BYTES and SWIGLU_BYTES (the rotary tables, shared
    by every head, add a little)."""
    torch = pytest.importorskip("torch")
    from memx_launch.models import llama

    heads, seq, head_dim, width = 8, 256, 64, 1376
    cos, sin = llama._rope_tables(seq, head_dim, "cpu", torch.bfloat16)
    q = torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)
    forward, backward = _traced_bytes(lambda x: llama._apply_rope(x, cos, sin), q)
    assert forward / q.numel() == pytest.approx(elementwise.ROPE_BYTES[0] * 2, rel=0.05)
    assert backward / q.numel() == pytest.approx(elementwise.ROPE_BYTES[1] * 2, rel=0.05)
    gate, up = (torch.randn(seq, width, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    forward, backward = _traced_bytes(llama._swiglu, gate, up)
    assert forward / gate.numel() == pytest.approx(elementwise.SWIGLU_BYTES[0] * 2)
    assert backward / gate.numel() == pytest.approx(elementwise.SWIGLU_BYTES[1] * 2)


def test_megatron_core_s_eager_expert_activation_moves_the_counted_bytes():
    """megatron-core 0.16's TEGroupedMLP without ``bias_activation_fusion`` (GPT-OSS's recipe):
    its grouped fc1's output chunked into gate and up, SwiGLU, then the product with the fp32
    routing weights cast back to 16 bits, traced per element of the expert's width: SWIGLU_BYTES
    and EAGER_ROUTED_EXTRA_BYTES together; the separate gate and up linears of memx's block move
    SWIGLU_BYTES alone (the chunk's backward writes both halves' gradients anew)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    rows, width = 256, 1376
    fc1 = torch.randn(rows, 2 * width, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(rows, 1, dtype=torch.float32)

    def eager_experts(x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return (F.silu(gate) * up * probs).to(torch.bfloat16)

    forward, backward = _traced_bytes(eager_experts, fc1)
    expected = [(swiglu + extra) * 2 for swiglu, extra in zip(elementwise.SWIGLU_BYTES,
                                                              elementwise.EAGER_ROUTED_EXTRA_BYTES)]
    assert forward / (rows * width) == pytest.approx(expected[0], abs=0.01)
    assert backward / (rows * width) == pytest.approx(expected[1], abs=0.01)


def _megatron_glu(x, clamp):
    """megatron-core 0.16's TEGroupedMLP glu (``moe/experts.py``) as GPT-OSS's recipe runs it, the
    activation a kernel that keeps only its input (as its compiled quick_gelu does; silu here)."""
    import torch.nn.functional as F

    gate, linear = x.chunk(2, dim=-1)
    if clamp:
        gate, linear = gate.clamp(min=None, max=7.0), linear.clamp(min=-7.0, max=7.0)
    return F.silu(gate) * (linear + 1.0)


@pytest.mark.parametrize("dtype_bytes", [4, 2])
def test_gpt_oss_s_clamped_glu_moves_and_keeps_what_memx_counts(dtype_bytes):
    """Per element of an expert's width: megatron-core's eager clamps move CLAMP_BYTES (d forward,
    d and their 1-byte masks backward) and keep the clamped gate, one tensor more
    (``experts.CLAMPED_GLU_KEPT``); Transformers' GptOssExperts gate moves CLAMPED_GLU_OPS_EXTRA_BYTES
    more than its default SwiGLU gate on the same gate-and-up output (itself SwiGLU's and the chunk's
    TRANSFORMERS_CHUNK_BYTES) and keeps three tensors more."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.moe import _default_apply_gate
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from memx_launch.planning import experts as experts_module
    from memx_launch.profiling.saved_tensors import saved_storage_bytes

    rows, width = 256, 96
    dtype = {4: torch.float32, 2: torch.bfloat16}[dtype_bytes]
    gate_up = torch.randn(rows, 2 * width, dtype=dtype, requires_grad=True)
    per_element = rows * width

    def moved(fn):  # on a fresh leaf: a held gradient would add its accumulation's pass
        forward, backward = _traced_bytes(fn, gate_up.detach().clone().requires_grad_(True))
        return forward / per_element, backward / per_element

    def kept(fn):
        return saved_storage_bytes(lambda: fn(gate_up), owned=(gate_up,)) / (per_element * dtype_bytes)

    clamped, plain = moved(lambda x: _megatron_glu(x, True)), moved(lambda x: _megatron_glu(x, False))
    forward, backward, masks = elementwise.CLAMP_BYTES
    assert clamped[0] - plain[0] == pytest.approx(forward * dtype_bytes, abs=0.01)
    assert clamped[1] - plain[1] == pytest.approx(backward * dtype_bytes + masks, abs=0.01)
    assert kept(lambda x: _megatron_glu(x, True)) - kept(lambda x: _megatron_glu(x, False)) == \
        experts_module.CLAMPED_GLU_KEPT["megatron"]

    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=width, num_local_experts=2)
    experts = GptOssExperts(config)
    experts.act_fn = torch.nn.functional.silu
    gpt_oss, default = (lambda x: experts._apply_gate(x)), (lambda x: _default_apply_gate(experts, x))
    forward, backward, masks = elementwise.CLAMPED_GLU_OPS_EXTRA_BYTES
    (gpt_oss_f, gpt_oss_b), (default_f, default_b) = moved(gpt_oss), moved(default)
    assert (default_f, default_b) == pytest.approx([(glu + chunk) * dtype_bytes for glu, chunk in zip(
        elementwise.SWIGLU_BYTES, elementwise.TRANSFORMERS_CHUNK_BYTES)], abs=0.01)
    assert gpt_oss_f - default_f == pytest.approx(forward * dtype_bytes, abs=0.01)
    assert gpt_oss_b - default_b == pytest.approx(backward * dtype_bytes + masks, abs=0.01)
    assert kept(gpt_oss) - kept(default) == experts_module.CLAMPED_GLU_KEPT["transformers"]


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_megatron_core_s_expert_biases_move_what_memx_counts(dtype_bytes):
    """megatron-core 0.16's own TEGroupedMLP._apply_bias (GPT-OSS's experts' down-projection biases, each
    weighed by the fp32 routing probability, then the experts' cat and the cast back), traced per element
    of the routed copies' hidden width: EXPERT_BIAS_BYTES; an expert-biased block's element-wise traffic
    is that much above the unbiased one's under ``--setup megatron`` and none, others' not (not priced)."""
    torch = pytest.importorskip("torch")
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from traced import byte_counter

    from memx_launch.specs.catalog import get_model

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    rows, h, local = 512, 256, 4
    copies = torch.randn(rows, h, dtype=dtype, requires_grad=True)
    biases = [torch.randn(h, dtype=dtype, requires_grad=True) for _ in range(local)]
    probs = torch.rand(rows, 1, dtype=torch.float32, requires_grad=True)
    with byte_counter() as forward:
        out = TEGroupedMLP._apply_bias(copies, biases, [rows // local] * local, probs)
    gradient = torch.randn_like(out)
    with byte_counter() as backward:
        torch.autograd.grad(out, [copies, probs, *biases], gradient)
    per_element = rows * h
    assert (forward.total / per_element, backward.total / per_element) == pytest.approx(
        elementwise.EXPERT_BIAS_BYTES[dtype_bytes], abs=0.2)  # each op's read of a bias: 1/128 of a row's

    gpt_oss = get_model("gpt-oss-20b")
    unbiased = dataclasses.replace(gpt_oss, expert_biases=False)
    dtype_name = {2: "bf16", 4: "fp32"}[dtype_bytes]
    for setup, priced in (("megatron", True), (None, True), ("memx-run", False), ("fsdp2", False)):
        training = TrainingSpec(setup=setup, dtype=dtype_name)
        biased, plain = (float(elementwise.elementwise_traffic_bytes(m, training, 1, 1024, 2, cm.NONE))
                         for m in (gpt_oss, unbiased))
        assert biased - plain == pytest.approx(priced * 1024 * 4 * 2880 / 2 * sum(
            elementwise.EXPERT_BIAS_BYTES[dtype_bytes]))


def test_recompute_moves_the_forwards_element_wise_bytes_again():
    """Full recompute runs every element-wise op's forward again; selective only the attention
    core's (rotary embedding, scores) and the MLP activation's. LLaMA-2-13B, 8k tokens, TP 4,
    bf16, worked out by hand: rotary 18 bytes x (5120 + 5120) / 4 and SwiGLU 10 bytes x 13824 / 4
    per token, 80,640; two residual adds and fused norms 2 x (6 + 4) bytes x 5120 per token,
    102,400; per score 8 bytes over 40 / 4 heads x 8192^2."""
    def traffic(level, flash=True):
        return float(elementwise.elementwise_traffic_bytes(MODEL, TrainingSpec(), 1, S, T, level, flash))
    assert traffic(cm.SELECTIVE) - traffic(cm.NONE) == 8192 * 80_640 == 660_602_880
    assert traffic(cm.FULL) - traffic(cm.NONE) == 8192 * (80_640 + 102_400)
    assert traffic(cm.SELECTIVE, False) - traffic(cm.NONE, False) == 660_602_880 + 8 * 10 * 8192 ** 2


def test_torch_op_norms_keep_an_fp32_copy_and_the_normalised_tensor():
    """x.float() is saved by pow and by the rsqrt multiply, the cast-back result by the weight
    multiply; the 16-bit input a fused kernel keeps is not: 2 x (4 + 2) bytes against 2 x 2."""
    def kept(dtype_bytes=2, **options):
        return float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE, dtype_bytes=dtype_bytes, **options).activation_bytes)
    assert kept(fused_norm=False) - kept() == pytest.approx(2 * 4 * S * H)
    # In fp32 the upcast is the input itself: input and normalised tensor, 2 x (4 + 4) against 2 x 4.
    assert kept(4, fused_norm=False) - kept(4) == pytest.approx(2 * 4 * S * H)
    # With sequence parallelism each rank keeps its 1/TP of the sequence.
    assert kept(fused_norm=False, sequence_parallel=True) - kept(sequence_parallel=True) == \
        pytest.approx(2 * 4 * S * H / T)


def test_what_autograd_saves_for_a_torch_op_norm_is_what_the_model_keeps():
    """Measured, not read: the tensors autograd saves for the 2023 scaling code's torch-op
    RMSNorm (``self._norm(x.float()).type_as(x) * weight``), by storage, are what
    ``activation_bytes`` keeps for a torch-op norm: 4 + d bytes per element (the fp32 copy and
    the normalised tensor)."""
    torch = pytest.importorskip("torch")

    def scaling_rms_norm(x, weight):
        hidden = x.float()
        return (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * weight

    rows, width = 256, 2048
    for dtype, d in ((torch.bfloat16, 2), (torch.float32, 4)):
        x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
        weight = torch.ones(width, dtype=dtype, requires_grad=True)
        kept = saved_storage_bytes(lambda: scaling_rms_norm(x, weight), owned=(x, weight))
        # The model's bytes per element of one torch-op norm: the difference to fused norms over
        # the two norms of a block, plus the d bytes of input a fused kernel keeps.
        unfused, fused = (float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE, dtype_bytes=d, fused_norm=f).activation_bytes)
                          for f in (False, True))
        per_norm = (unfused - fused) / (2 * S * H) + d
        # The input is the caller's here; in fp32 ``x.float()`` is x, which the model counts as
        # the norm's own.
        assert kept / x.numel() == pytest.approx(per_norm - (d if d == 4 else 0), abs=0.05)
        assert per_norm == pytest.approx(4 + d)


def test_softmax_in_fp32_keeps_fp32_probabilities_and_their_16_bit_copy():
    a = MODEL.num_heads
    score = a / T * S * S  # scores per layer on this rank

    def costs(dtype_bytes=2, **options):
        return cm.activation_bytes(MODEL, 1, S, T, cm.NONE, dtype_bytes=dtype_bytes, flash_attention=False,
                                   fused_softmax=False, **options)
    plain, fp32 = costs(), costs(softmax_in_fp32=True)
    assert float(fp32.activation_bytes - plain.activation_bytes) == pytest.approx(4 * score)  # 6 - 2 bytes
    # Backward: the fp32 gradient in and out of the softmax less the freed 16-bit probabilities
    # (4 + 4 - 2) against torch's two 16-bit gradients.
    assert float(fp32.working_bytes - plain.working_bytes) == pytest.approx((6 - 4) * score)
    # A fused kernel reads and writes 16 bits, and fp32 training has nothing to upcast.
    fused = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=False, softmax_in_fp32=True)
    assert float(fused.activation_bytes) == float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE,
                                                                      flash_attention=False).activation_bytes)
    assert float(costs(4, softmax_in_fp32=True).activation_bytes) == float(costs(4).activation_bytes)
    # Flash attention keeps no scores at all.
    flash = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, fused_softmax=False, softmax_in_fp32=True)
    assert float(flash.activation_bytes) == float(cm.activation_bytes(MODEL, 1, S, T, cm.NONE).activation_bytes)


def test_separate_gate_and_up_linears_all_reduce_once_more_per_layer():
    """Two column-parallel linears on the same input each all-reduce its gradient over TP."""
    cluster = _a100s()
    args = (np.zeros(1, int), np.full(1, T), np.ones(1), np.full(1, S), np.zeros(1))
    def layer_time(**options):
        model = cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(**options))
        return float(model.layer_costs(*args).time_s[0]), model
    fused, model = layer_time()
    separate, _ = layer_time(fused_gate_up=False)
    one = float(cm.allreduce_time(S * H * 2.0, T, model.tp_gbps(np.zeros(1, int), np.full(1, T))[0]))
    # Besides the all-reduce, gate and up run as two GEMMs of half the width: timed by their shape.
    device = cluster.device_types[0]
    gemm = (device.effective_tflops_for("bf16") * 1e12, hbm_gbps(device) * 1e9,
            mm.streaming_multiprocessors(device.vendor, device.compute_capability), 2)

    def split(tp):
        ffn = MODEL.ffn_hidden_size / tp
        return float(mm.forward_backward_seconds(S, [(ffn, H), (ffn, H)], *gemm)
                     - mm.forward_backward_seconds(S, [(2 * ffn, H)], *gemm))
    assert separate - fused == pytest.approx(one + split(T), rel=1e-6)
    assert TrainingSpec(setup="scaling").fused_gate_up is False and TrainingSpec().fused_gate_up is True
    # One TP rank: nothing to all-reduce, only the two GEMMs.
    single = (np.zeros(1, int), np.ones(1), np.ones(1), np.full(1, S), np.zeros(1))
    apart = cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(fused_gate_up=False)).layer_costs(*single).time_s[0]
    together = cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec()).layer_costs(*single).time_s[0]
    assert apart - together == pytest.approx(split(1), rel=1e-6, abs=1e-12)


def test_flash_attention_1_runs_its_flops_slower_and_keeps_the_same_memory():
    """FlashAttention reaches 25-40% of A100 peak, FlashAttention-2 50-73% (Dao 2023): the
    kernel's forward, backward (2.5 x) and recomputed forward run at its own share of the rate."""
    cluster = _a100s()
    def costs(version, recompute=cm.NONE):
        args = (np.zeros(1, int), np.full(1, T), np.ones(1), np.full(1, S), np.full(1, recompute))
        return cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(flash_attention_version=version)).layer_costs(*args)
    attention_flops = 2.0 * S * S * MODEL.hidden_size / T
    tflops = cluster.device_types[0].effective_tflops * 1e12
    for recompute, passes in ((cm.NONE, 3.5), (cm.FULL, 4.5)):
        slower = float(costs(1, recompute).time_s[0] - costs(2, recompute).time_s[0])
        expected = passes * attention_flops / tflops * (1 / cm.FLASH_ATTENTION_SPEED[1] - 1 / cm.FLASH_ATTENTION_SPEED[2])
        assert slower == pytest.approx(expected, rel=1e-6) and slower > 0
        assert float(costs(1, recompute).activation_bytes[0]) == float(costs(2, recompute).activation_bytes[0])
    # Never faster than the matmuls themselves, and a speed for every version a run can name.
    assert all(0 < speed <= 1 for speed in cm.FLASH_ATTENTION_SPEED.values())
    assert set(cm.FLASH_ATTENTION_SPEED) == set(FLASH_ATTENTION_VERSIONS)
    for bad in (4, True):
        with pytest.raises(ConfigError, match="--flash-attention-version"):
            TrainingSpec(flash_attention_version=bad)


@pytest.mark.parametrize("head_dim", [0, 128])  # 0: 512 / 8 heads; 128: heads wider than h / a (Qwen3, Gemma)
def test_what_autograd_saves_for_memx_block_is_the_activation_model(head_dim):
    """memx's own LLaMA block (GQA, SwiGLU) in bf16 on CPU, every tensor autograd saves counted
    once by storage, against ``activation_bytes`` with torch-op norms. Two differences are this
    CPU run's, named here: torch's ``nn.RMSNorm`` keeps its normalised tensor in fp32 (2 bytes
    more per element per norm than Hugging Face's norm), and the CPU attention kernel returns
    [b, heads, s, d], so ``wo`` keeps a reshaped copy beside the kernel's own saved output (on
    CUDA the flash kernel's output is already laid out as [b, s, heads, d] and the reshape is a
    view). Full recompute keeps the block input only, which the caller owns here."""
    torch = pytest.importorskip("torch")
    from memx_launch.models.llama import TransformerBlock
    from memx_launch.specs.model import ModelSpec

    h, seq = 512, 256
    spec = ModelSpec("t", 1, h, 8, 2, 1376, 1000, seq, attention_head_dim=head_dim)
    elements = seq * h
    rope_tables = 2 * seq * spec.head_dim // 2 * 2  # cos and sin, kept by the rotary multiplies
    for level, cpu_extra in (("none", 2 * 2 * elements + 2 * seq * spec.q_hidden_size + rope_tables),
                             ("selective", 2 * 2 * elements), ("full", -2 * elements)):
        block = TransformerBlock(spec, recompute=level).to(torch.bfloat16)
        x = torch.randn(1, seq, h, dtype=torch.bfloat16, requires_grad=True)
        kept = saved_storage_bytes(lambda: block(x), owned=(*block.parameters(), x))
        model = float(cm.activation_bytes(spec, 1, seq, 1, cm.RECOMPUTE_LEVELS.index(level), 2, True,
                                          fused_norm=False).activation_bytes)
        assert kept == pytest.approx(model + cpu_extra, rel=0.01), level


def test_autocast_over_fp32_weights_keeps_fp32_norm_inputs_and_a_cast_per_linear():
    """Hugging Face's LlamaDecoderLayer in bf16 on CPU, under autocast over fp32 weights (DDP's,
    Lightning's "bf16-mixed", memx-run's) and on bf16 weights, what autograd saves measured with
    saved-tensor hooks: autocast keeps 10 bytes more per element (each norm's fp32 input and
    normalised tensor, a 16-bit cast per linear: q, k, v, gate and up), as ``activation_bytes``
    counts it. Its parameters, their casts and the rotary tables (shared by the layers) aside; the
    layer's input counts, as the first norm keeps it under autocast."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig.from_pretrained(HF_LLAMA)
    config._attn_implementation = "sdpa"
    spec, b, seq = get_model(HF_LLAMA), 2, 256
    kept = {}
    for autocast in (False, True):
        dtype = torch.float32 if autocast else torch.bfloat16
        layer = LlamaDecoderLayer(config, 0).to(dtype)
        x = torch.randn(b, seq, config.hidden_size, dtype=dtype, requires_grad=True)
        weights = {tuple(p.shape[::k]) for p in layer.parameters() for k in (1, -1)}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            rotary = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None])
            kept[autocast] = saved_storage_bytes(lambda: layer(x, position_embeddings=rotary, attention_mask=None),
                                                 owned=(*layer.parameters(), *rotary), skip_shapes=weights)
    counted = {autocast: float(cm.activation_bytes(spec, b, seq, 1, cm.NONE, 2, True, fused_norm=False,
                                                   autocast=autocast, fused_gate_up=False,
                                                   fused_qkv=False).activation_bytes)
               for autocast in (False, True)}
    assert kept[True] - kept[False] == counted[True] - counted[False] == 10 * b * seq * config.hidden_size
    # DeepSpeed ZeRO-3 over the model's bf16 weights (--setup zero3) counts its torch-op norms so
    zero3 = TrainingSpec(setup="zero3", dtype="bf16")
    assert float(cm.training_activation_bytes(spec, zero3, b, seq, 1, cm.NONE).activation_bytes) == counted[False]
    # memx-run's own stages hand on an fp32 hidden state under autocast: its pipeline sends and buffers
    from memx_launch.models.llama import LlamaStage
    stage = LlamaStage(get_model("llama-tiny"), 1, first=True, last=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stage(torch.zeros(1, 8, dtype=torch.long)).dtype == torch.float32
    runtime = TrainingSpec(dtype="bf16", weights_dtype="fp32")
    assert runtime.autocast and runtime.residual_bytes == 4
    assert not TrainingSpec(dtype="bf16", weights_dtype="fp32", fully_sharded=True).autocast  # 16-bit gathers


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_what_autograd_saves_for_hugging_face_s_llama_layer_is_what_memx_run_counts(dtype):
    """Hugging Face's LlamaDecoderLayer as memx-run trains it (fp32 weights, under bf16 autocast in
    16-bit training), every tensor autograd saves counted once by storage, its parameters, their
    casts and the rotary tables aside, against memx-run's setup's count and ``--setup ddp``'s: their
    torch-op RMSNorms keep the fp32 input and the normalised tensor (a fused norm's count is 11%
    short in fp32, 22% in bf16)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig.from_pretrained(HF_LLAMA)
    config._attn_implementation = "sdpa"
    spec, b, seq = get_model(HF_LLAMA), 2, 256
    layer = LlamaDecoderLayer(config, 0)
    x = torch.randn(b, seq, config.hidden_size, requires_grad=True)
    weights = {tuple(p.shape[::k]) for p in layer.parameters() for k in (1, -1)}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        rotary = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None])
        kept = saved_storage_bytes(lambda: layer(x, position_embeddings=rotary, attention_mask=None),
                                   owned=(*layer.parameters(), *rotary), skip_shapes=weights)
    for setup in ("memx-run", "ddp"):  # each trains Hugging Face's blocks under autocast over fp32 weights
        counted = float(cm.training_activation_bytes(spec, TrainingSpec(setup=setup, dtype=dtype), b, seq, 1,
                                                     cm.NONE).activation_bytes)
        assert kept == pytest.approx(counted, rel=0.005), setup
    memx_run = TrainingSpec(setup="memx-run", dtype=dtype)
    # Autocast's 16-bit weight casts, saved beside: a copy of every linear's weight, a model state.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        with_casts = saved_storage_bytes(lambda: layer(x, position_embeddings=rotary, attention_mask=None),
                                         owned=(*layer.parameters(), *rotary))
    copies = float(weight_copy_bytes(spec, memx_run, 1)[0])
    assert with_casts - kept == pytest.approx(copies, rel=0.005) and (copies > 0) == (dtype == "bf16")
    fused = float(cm.training_activation_bytes(spec, TrainingSpec(setup="memx-run", dtype=dtype, fused_norm=True),
                                               b, seq, 1, cm.NONE).activation_bytes)
    assert kept / fused > 1.1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_what_autograd_saves_for_gpt_2_s_mlp_is_what_memx_counts(act, dtype):
    """GPT-2's MLP (Transformers' GPT2MLP: Conv1D, the activation, Conv1D) as memx-run trains it.
    Transformers' gelu_new, GPT-2's default, is GELU's tanh form in eight torch ops: five tensors of
    the MLP's width kept (its input, the tanh's output, the two factors of its last product, and
    its output, the second linear's input), where torch's GELU kernel keeps two; memx reads which
    from the config (``tanh_gelu_ops``). Counted as the kernel, GPT-2's block measured 1.5x its count."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    from memx_launch.planning.activations import mlp_bytes
    from memx_launch.specs.hf_config import model_from_hf_dict

    config = GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=128, vocab_size=97, activation_function=act,
                        resid_pdrop=0.0)
    mlp = GPT2MLP(4 * 64, config)
    x = torch.randn(2, 128, 64, requires_grad=True)
    weights = {tuple(p.shape) for p in mlp.parameters()}  # and their casts, and the input's cast (as c_proj's)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        kept = saved_storage_bytes(lambda: mlp(x), owned=(x, *mlp.parameters()), skip_shapes=weights)
    spec = model_from_hf_dict(config.to_dict(), "gpt2-mlp")
    assert spec.tanh_gelu_ops == (act == "gelu_new") and not spec.gated_mlp
    assert kept == float(mlp_bytes(spec, TrainingSpec(setup="memx-run", dtype=dtype), 2, 128, 1))
    assert kept == (5 if act == "gelu_new" else 2) * 2 * 128 * 256 * (4 if dtype == "fp32" else 2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_what_autograd_saves_for_gpt_2_s_block_is_what_memx_run_counts(dtype):
    """Hugging Face's GPT2Block as memx-run trains it, every tensor autograd saves counted once by
    storage (its parameters and their casts aside) against memx-run's count, its q, k and v one
    linear as memx-run reads GPT-2's c_attn (models/block_reading.py; its setup's three linears
    count two casts too many in bf16, 6% over): torch's LayerNorm kernel keeps its input whatever memx-run's
    torch-op RMSNorms keep (``activations.training_as_run``; counted as torch ops, 7% over), and
    its gelu_new keeps five MLP-wide tensors (counted as GELU's kernel, 25% under)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from memx_launch.models.block_reading import own_block_training
    from memx_launch.specs.hf_config import model_from_hf_dict

    config = GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=256, vocab_size=97, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "sdpa"
    block = GPT2Block(config, 0)
    x = torch.randn(2, 256, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        kept = saved_storage_bytes(lambda: block(x), owned=tuple(block.parameters()),
                                   skip_shapes={tuple(p.shape) for p in block.parameters()})
    spec = model_from_hf_dict(config.to_dict(), "gpt2-block")
    training, _ = own_block_training(TrainingSpec(setup="memx-run", dtype=dtype), block, spec)
    counted = float(cm.training_activation_bytes(spec, training, 2, 256, 1, cm.NONE).activation_bytes)
    assert kept == pytest.approx(counted, rel=0.005)


@pytest.mark.parametrize("autocast", [False, True])
def test_squared_relu_and_xielu_as_ops_keep_and_move_what_memx_counts(autocast):
    """Transformers' MLP (Apertus's: up, activation, down) with relu2 and with xIELU (its Python ops),
    against GELU's, in fp32 and under bf16 autocast over fp32 weights, per element of the MLP's width:
    what autograd saves beyond GELU's (squared ReLU nothing, xIELU ``XIELU_OPS_KEPT``) and what their
    ops read and write (``activation_ops.hbm_bytes`` beyond ``GELU_BYTES``)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from traced import byte_counter

    from memx_launch.profiling.saved_tensors import saved_storage_bytes
    from memx_launch.specs.model import ModelSpec

    tokens, h, f, d = 160, 128, 352, 2 if autocast else 4
    measured = {}
    for act in ("gelu", "relu2", "xielu"):
        config = transformers.AutoConfig.for_model("apertus", hidden_size=h, intermediate_size=f, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                                   hidden_act=act)
        torch.manual_seed(0)
        mlp = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp
        weights = {tuple(p.shape[::k]) for p in mlp.parameters() for k in (1, -1)}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            x = torch.randn(tokens, h, requires_grad=True)
            kept = saved_storage_bytes(lambda: mlp(x * 1.0), owned=tuple(mlp.parameters()), skip_shapes=weights)
            with byte_counter() as forward:
                out = mlp(x * 1.0)
            gradient = torch.randn_like(out)
            with byte_counter() as backward:
                torch.autograd.grad(out, [x], gradient)
        measured[act] = np.array([kept, forward.total, backward.total]) / (tokens * f)
    ungated = ModelSpec("m", 1, h, 4, 2, f, 64, tokens, gated_mlp=False)
    for act, flag, kept in (("relu2", "squared_relu_ops", 0.0),
                            ("xielu", "xielu_ops", activation_ops.XIELU_OPS_KEPT[d])):
        moved = activation_ops.hbm_bytes(dataclasses.replace(ungated, **{flag: True}), False, d)
        expected = [kept, *((m - g) * d for m, g in zip(moved, activation_ops.GELU_BYTES))]
        assert (measured[act] - measured["gelu"]).tolist() == pytest.approx(expected, abs=0.01), act


def test_gpt_2_s_tanh_gelu_ops_move_what_memx_times():
    """Transformers' gelu_new, eight torch ops on a linear's output, traced: 18 elements of the
    MLP's width read and written forward and 28 backward, where GELU's kernel moves 2 and 3; the
    cost model times an eager GPT-2 block's MLP so (``activation_ops.TANH_GELU_OPS_BYTES``)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from traced import byte_counter
    from transformers.activations import NewGELUActivation

    from memx_launch.specs.model import ModelSpec

    x = torch.randn(4, 64, 512, requires_grad=True) * 1.0
    with byte_counter() as forward:
        y = NewGELUActivation()(x)
    gradient = torch.ones_like(y)
    with byte_counter() as backward:
        torch.autograd.grad(y, x, gradient)
    per_element = x.numel() * x.element_size()
    assert (forward.total / per_element, backward.total / per_element) == activation_ops.TANH_GELU_OPS_BYTES
    gpt = ModelSpec("g", 1, 64, 4, 4, 256, 97, 128, gated_mlp=False)
    ops, kernel = (float(elementwise.elementwise_traffic_bytes(m, TrainingSpec(), 2, 128, 1, cm.NONE))
                   for m in (ModelSpec(**{**gpt.__dict__, "tanh_gelu_ops": True}), gpt))
    assert ops - kernel == 2 * 128 * 256 * 2 * (18 + 28 - 2 - 3)


def test_a_memx_run_stage_under_autocast_holds_a_16_bit_copy_of_the_weights_its_linears_read():
    """Each stage's parameters part: its fp32 weights and, in 16-bit training, autocast's copies of
    its blocks' and head's weights (the embedding's lookup is not cast); the head whole on each TP
    rank, as memx-run runs it."""
    head = last_stage_params(MODEL, 2)
    parts = {}
    for dtype in ("fp32", "bf16"):
        training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="memx-run", dtype=dtype)
        plan = evaluate_layout(MODEL, _a100s(), training, tp=4, pp=2, dp=1, micro_batch_size=1, recompute="full",
                               references=(1.0, 1.0, 1.0))
        parts[dtype] = [(s.num_layers, s.memory_parts_gib["parameters"] * cm.GIB) for s in plan.stages]
    for i, ((layers, fp32), (_, bf16)) in enumerate(zip(parts["fp32"], parts["bf16"])):
        copies = 2 * (layers * MODEL.layer_params / 4 + (head if i == 1 else 0))
        assert bf16 - fp32 == pytest.approx(copies, rel=1e-6)


def test_what_autograd_saves_for_torch_softmax_attention_is_the_model():
    """Unfused attention as the scaling code runs it (``masked_softmax.py``: optional fp32 upcast,
    in-place mask fill, torch's softmax, cast back, then AV), measured with saved-tensor hooks:
    2 bytes per score kept in 16 bits, 6 with the softmax in fp32 (the fp32 probabilities and
    their 16-bit copy), as ``activation_bytes`` counts them."""
    torch = pytest.importorskip("torch")
    heads, seq, head_dim = 4, 128, 32
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)

    def attention(q, k, v, in_fp32):
        scores = torch.matmul(q, k.transpose(-1, -2))
        x = scores.float() if in_fp32 else scores
        x = x * head_dim ** -0.5
        x.masked_fill_(mask, -10000.0)
        probs = torch.softmax(x, dim=-1)
        return torch.matmul(probs.to(q.dtype) if in_fp32 else probs, v)

    spec_scores = heads * seq * seq
    for in_fp32, per_score in ((False, 2), (True, 6)):
        q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        kept = saved_storage_bytes(lambda: attention(q, k, v, in_fp32), owned=(q, k, v, mask))
        assert kept / spec_scores == pytest.approx(per_score, rel=0.01)
        model = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=False, fused_softmax=False,
                                    softmax_in_fp32=in_fp32)
        flash = cm.activation_bytes(MODEL, 1, S, T, cm.NONE, flash_attention=True)
        lse = 4.0 * MODEL.num_heads / T * S  # the flash kernel's fp32 logsumexp, not kept unfused
        per_score_model = (float(model.activation_bytes - flash.activation_bytes) + lse) / (MODEL.num_heads / T * S * S)
        assert per_score_model == pytest.approx(per_score)


def test_the_gathered_losss_live_peak_is_what_the_model_counts():
    """The scaling code's loss on 16-bit logits (``.float()``, torch's cross entropy, the
    accuracy's argmax), forward and backward, on CPU: the live-tensor peak from the profiler's
    memory timeline is 14 bytes per logit (the logits, which the pipeline's output buffer holds,
    the fp32 copy, the log-softmax and its gradient), what ``logits_bytes`` counts for a gathered
    fp32 loss."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    tokens, vocab, width = 1024, 8192, 64
    hidden = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(vocab, width, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    weights = torch.ones(tokens)

    def loss_step():
        logits = hidden @ head.t()
        flat = logits.float().reshape(-1, vocab)
        losses = torch.nn.functional.cross_entropy(flat, target, reduction="none")
        (flat.argmax(-1) == target).float().mean()
        return torch.sum(losses * weights) / weights.sum(), logits

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss, logits_in_the_output_buffer = loss_step()  # the pipeline engine holds the stage output
        loss.backward()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    peak_per_logit = np.asarray(sizes).sum(axis=1).max() / (tokens * vocab)
    training = TrainingSpec(vocab_parallel_loss=False, loss_dtype="fp32")
    spec = get_model("llama2-7b")
    modelled = float(logits_bytes(spec, 1, 1, 1, training)) / spec.vocab_size
    # The gradients of the hidden states and the head weight add 0.14 bytes per logit here.
    assert peak_per_logit == pytest.approx(modelled, abs=0.3)


def test_ampere_attention_kernels_reach_a_smaller_share_of_hopper_s_peak():
    """FlashAttention-2 reaches about 35% of H100's peak, against about 60% of A100's (Shah et
    al. 2024): on compute capability 9.0 FlashAttention 1 and 2 run slower against the matmuls;
    FlashAttention-3, written for Hopper, does not."""
    def layer_time(capability, version):
        # One efficiency and SM count for both capabilities: what differs is the attention kernel alone.
        cluster = ClusterSpec.from_dict({"version": 1, "device_types": {"h100": {
            "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "compute_capability": capability,
            "efficiency": 0.75, "sm_count": 132}}, "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]})
        args = (np.zeros(1, int), np.ones(1), np.ones(1), np.full(1, 8192), np.zeros(1))
        model = cm.AnalyticalCostModel(MODEL, cluster, TrainingSpec(flash_attention_version=version))
        return float(model.layer_costs(*args).time_s[0])
    for version in (1, 2):
        assert layer_time(9.0, version) > layer_time(8.0, version) == layer_time(None, version)
        assert cm.fused_attention_speed(version, 9.0) < cm.FLASH_ATTENTION_SPEED[version]
    assert layer_time(9.0, 3) < layer_time(9.0, 2)
    # On an H100 at its default efficiency each kernel's forward runs at its published share of the peak.
    h100 = ClusterSpec.from_dict({"version": 1, "device_types": {"h100": {
        "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "compute_capability": 9.0}},
        "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]})
    for version, share in ((2, 0.35), (3, 0.6)):
        model = cm.AnalyticalCostModel(MODEL, h100, TrainingSpec(flash_attention_version=version))
        forward, _ = model.attention_seconds(0, 1, 1, 8192)
        assert cm.causal_attention_flops(MODEL, 1, 8192, 1) / forward == pytest.approx(share * 989e12)


def _gemma2_attention(cap, dtype):
    """Transformers' eager attention as Gemma 2 runs it (GQA, 4 heads over 2 KV heads, soft cap
    ``cap``): (the core as a function of q, k and v, q, k, v, the number of scores)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    b, heads, kv_heads, seq, head_dim = 2, 4, 2, 128, 16
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    mask = torch.zeros(b, 1, seq, seq, dtype=dtype).masked_fill(
        torch.ones(seq, seq, dtype=torch.bool).triu(1), torch.finfo(dtype).min)
    q, k, v = (torch.randn(b, n, seq, head_dim, dtype=dtype, requires_grad=True) for n in (heads, kv_heads, kv_heads))

    def core(q, k, v):
        return eager_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=head_dim ** -0.5, softcap=cap)[0]
    return core, (q, k, v, mask), b * heads * seq * seq


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_a_soft_capped_attention_keeps_the_tanh_s_output_beside_its_probabilities(dtype_bytes):
    """Gemma 2's attention (Transformers' eager attention: SDPA has no soft cap), what autograd
    saves by storage, K and V repeated to the query heads aside: per score the fp32 softmax's
    output and its 16-bit copy, and with the cap the tanh's output, as ``activation_bytes``
    counts the scores of a soft-capped model (``training_as_run``: unfused, softmax in fp32)."""
    torch = pytest.importorskip("torch")
    from memx_launch.specs.model import ModelSpec

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    spec = ModelSpec("g", 1, 64, 4, 2, 128, 1000, 128, attention_softcapping=True)
    b, seq = 2, 128
    for cap in (None, 50.0):
        core, inputs, scores = _gemma2_attention(cap, dtype)
        repeated_kv = 2 * b * spec.num_heads * seq * spec.head_dim * dtype_bytes
        kept = (saved_storage_bytes(lambda: core(*inputs[:3]), owned=inputs) - repeated_kv) / scores
        flags = dict(dtype_bytes=dtype_bytes, fused_softmax=False, softmax_in_fp32=True, repeat_kv=True,
                     softcapped_scores=cap is not None)
        unfused, fused = (float(cm.activation_bytes(spec, b, seq, 1, cm.NONE, flash_attention=flash,
                                                    **flags).activation_bytes) for flash in (False, True))
        logsumexp = 4 * b * spec.num_heads * seq  # what the fused kernel keeps instead
        assert kept == pytest.approx((unfused - fused + logsumexp) / scores)
        probabilities = 4 + (dtype_bytes if dtype_bytes < 4 else 0)  # fp32, and their 16-bit copy
        assert kept == probabilities + (dtype_bytes if cap else 0)  # 6 / 8 bytes in bf16, 4 / 8 in fp32
    # A soft-capped model's blocks are priced so whatever the setup's kernel, and traced the same.
    training = TrainingSpec(setup="memx-run", dtype={2: "bf16", 4: "fp32"}[dtype_bytes])
    as_run = cm.training_activation_bytes(spec, training, b, seq, 1, cm.NONE)
    counted = cm.activation_bytes(spec, b, seq, 1, cm.NONE, flash_attention=False, autocast=training.autocast,
                                  fused_gate_up=False, fused_qkv=False, fused_norm=False, **flags)
    assert float(as_run.activation_bytes) == float(counted.activation_bytes)


def test_a_soft_cap_moves_its_passes_over_the_scores():
    """Gemma 2's eager attention traced with and without its soft cap, in bf16: the cap's divide,
    tanh and multiply move SOFTCAP_PASSES elements a score forward and backward, and the
    cost model charges them on an unfused attention's scores."""
    torch = pytest.importorskip("torch")
    from memx_launch.specs.model import ModelSpec

    traced = {}
    for cap in (None, 50.0):
        core, inputs, scores = _gemma2_attention(cap, torch.bfloat16)
        traced[cap] = np.array(_traced_bytes(core, *inputs[:3])) / scores
    assert (traced[50.0] - traced[None]).tolist() == pytest.approx([2 * p for p in SOFTCAP_PASSES])
    spec = ModelSpec("g", 1, 64, 4, 2, 128, 1000, 128)
    training = TrainingSpec(flash_attention=False, fused_softmax=False, softmax_in_fp32=True)
    capped, plain = (float(elementwise.elementwise_traffic_bytes(m, training, 2, 128, 1, cm.NONE, False))
                     for m in (ModelSpec(**{**spec.__dict__, "attention_softcapping": True}), spec))
    assert capped - plain == pytest.approx(2 * 4 * 128 * 128 * 2 * sum(SOFTCAP_PASSES))


def test_a_soft_capped_model_is_priced_unfused_whatever_the_setup_s_kernel():
    import dataclasses

    capped = dataclasses.replace(MODEL, attention_softcapping=True)
    args = (np.zeros(1, int), np.full(1, T), np.ones(1), np.full(1, S), np.zeros(1))
    eager = TrainingSpec(flash_attention=False, fused_softmax=False, softmax_in_fp32=True, repeat_kv=True)
    costs = {(m.attention_softcapping, tr.flash_attention): cm.AnalyticalCostModel(m, _a100s(), tr).layer_costs(*args)
             for m in (MODEL, capped) for tr in (TrainingSpec(), eager)}
    for part in ("time_s", "activation_bytes", "working_bytes"):
        assert getattr(costs[True, True], part)[0] == getattr(costs[True, False], part)[0], part
        assert getattr(costs[True, True], part)[0] > getattr(costs[False, True], part)[0], part


GEMMA_2_TINY = dict(model_type="gemma2", num_hidden_layers=1, hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=352, vocab_size=512,
                    max_position_embeddings=64, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=2,
                    eos_token_id=1)


@pytest.mark.parametrize("block", ["memx", "hugging-face-llama", "gemma-2"])
def test_a_calibrated_block_s_peak_is_what_its_ratio_is_learned_against(block):
    """One block as calibration measures it (forward and backward, its peak above the resting
    state) against the count its learned memory ratio is taken against, at every recompute level.
    The MLP's backward, a block's first, holds its intermediate gradients beside what it keeps (a
    SwiGLU's product's, gate's and up's, while gate, silu(gate) and up are still kept): counted as
    two stream-wide gradients instead, the blocks measured 12-21% above the count. Gemma 2's
    sandwich norms run the MLP's output norm's backward first (its torch-op temporaries beside all
    the block keeps), and its attention's phase comes after the MLP's tensors are freed: counted
    beside them, its block measured 0.80-0.93 of the count."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config

    from memx_launch.models.adapters import ModelParts
    from memx_launch.profiling.features import training_rows
    from memx_launch.profiling.kernel import calibrate
    from memx_launch.profiling.space import Sample
    from memx_launch.specs.cluster import DeviceType
    from memx_launch.specs.hf_config import model_from_hf_dict

    if block == "gemma-2":
        config = Gemma2Config(**{k: v for k, v in GEMMA_2_TINY.items() if k != "model_type"})
        spec = model_from_hf_dict(GEMMA_2_TINY, "gemma2-tiny")
    else:
        config = AutoConfig.from_pretrained(HF_LLAMA)
        config.num_hidden_layers = 1
        spec = get_model(HF_LLAMA)
    probe = None if block == "memx" else ModelParts(AutoModelForCausalLM.from_config(config)).block_probe
    cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
    records = calibrate(spec, cpu, [Sample(1, 4, spec.seq_len, level, spec.num_kv_heads)
                                    for level in ("none", "selective", "full")],
                        num_blocks=1, repeats=1, block_factory=probe)
    ratios = np.exp(training_rows(records).Y[:, 1])
    assert ((ratios > 0.92) & (ratios < 1.06)).all(), ratios


def test_a_torch_op_rms_norm_s_backward_holds_what_memx_counts():
    """Hugging Face's RMSNorms as torch ops (Llama's, Gemma 2's): their backward holds
    TORCH_NORM_BACKWARD_HELD fp32 tensors of their width above what they keep and the gradient
    they receive, in fp32 and under autocast (they compute in fp32 either way)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from memx_launch.planning.activations import TORCH_NORM_BACKWARD_HELD
    from memx_launch.profiling.emulation import EmulatedDevice

    for norm in (LlamaRMSNorm(128), Gemma2RMSNorm(128)):
        for autocast in (False, True):
            x = torch.randn(4, 64, 128, requires_grad=True) * 1.0
            device = EmulatedDevice("x", 1.0)
            device.track([x, *norm.parameters()])
            with device:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = norm(x)
                gradient = torch.ones_like(y)
                device.reset_peak()
                held = device.live_bytes
                torch.autograd.grad(y, x, gradient)
            fp32_tensors = (device.peak_bytes - held) / (x.numel() * 4)
            assert fp32_tensors == pytest.approx(TORCH_NORM_BACKWARD_HELD, abs=0.05), (type(norm).__name__, autocast)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_query_and_key_norms_under_autocast_keep_a_16_bit_normalised_tensor(dtype):
    """Transformers' Qwen3 layer as memx-run trains it: its query and key norms read the
    projections' 16-bit outputs under autocast, so each keeps an fp32 copy and a 16-bit normalised
    tensor (6 bytes an element), not the block norms' fp32 pair; memx-run's count holds what
    autograd saves to 1%."""
    folder, b, seq = os.path.join(os.path.dirname(__file__), "..", "examples", "models", "hf-qwen3-tiny"), 2, 80
    kept = hf_layer_kept_bytes(*hf_decoder_layer(folder, seq, b), dtype)
    counted = float(cm.training_activation_bytes(get_model(folder), TrainingSpec(setup="memx-run", dtype=dtype),
                                                 b, seq, 1, cm.NONE).activation_bytes)
    assert kept == pytest.approx(counted, rel=0.01)
