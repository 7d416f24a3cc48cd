"""The user's own model under a plan: blocks found, stages cut and recomputed, TP where memx knows the
block, and 4 gloo processes matching the single-process reference over 3 optimizer steps."""

import os
from dataclasses import replace

import pytest
import torch
from torch import nn

from memx_launch.errors import ConfigError
from memx_launch.models.adapters import ModelParts, find_blocks
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.profiling.emulation import EmulatedDevice
from memx_launch.runtime.batches import default_loss
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec
from benchmarks import hf_block_memory
from ranks import spawn_ranks
from test_cross_vendor import TWO_VENDORS
from toy_models import TOY_SPEC, NoBlocks, ToyModel, hf_example, hf_llama

pytest.importorskip("transformers")

LOSS_ATOL = 1e-5  # fp32 on CPU: splits only reorder sums (test_runtime.py explains the margin)
BF16_LOSS_ATOL = 0.03  # bf16 autocast, its TP partial sums rounded apart: 8 mantissa bits in every matmul
# At 1e-2 Adam's first, sign-sized steps grew bf16's rounding into a loss 0.4 apart by step 3 on
# some batches (which ones moves with the README the padded cases read); at 3e-3 it stays near 1e-3.
LR, CLIP = 3e-3, 0.5


def _split_forward(parts, x, layers, recompute, policy="attention"):
    offset, h = 0, x
    for i, (n, level) in enumerate(zip(layers, recompute)):
        h = parts.stage(offset, n, first=i == 0, last=i == len(layers) - 1, recompute=level,
                        selective_policy=policy)(h)
        offset += n
    return h


@pytest.mark.parametrize("policy", ["attention", "op"])
@pytest.mark.parametrize("make", [hf_llama, ToyModel], ids=["hf-llama", "own-block"])
def test_uneven_stages_with_mixed_recompute_reproduce_the_model(make, policy):
    model = make()
    x = torch.randint(0, 128, (2, 16))
    ref = model(x)
    ref = getattr(ref, "logits", ref)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    parts = ModelParts(model)
    n = parts.num_layers
    out = _split_forward(parts, x, [n // 2 + 1, 1, n - n // 2 - 2], ["full", "selective", "none"], policy)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    out.sum().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-6, rtol=0), name


@pytest.mark.parametrize("make", [hf_llama, lambda: hf_example("hf-mixtral-tiny")], ids=["llama", "mixtral"])
def test_recompute_levels_lower_the_peak_of_hf_blocks(make):
    """Selective reaches the attention core of the Llama family's blocks and of a mixture's (whose
    experts keep their activations), between no recompute and the whole block's."""
    model, x = make(), torch.randint(0, 512, (4, 64))
    parts = ModelParts(model)
    assert parts.kind.knows_attention
    peaks = {}
    for level in ("none", "selective", "full"):
        stage = parts.stage(0, parts.num_layers, first=True, last=True, recompute=level)
        device = EmulatedDevice("cpu", 1.0)
        device.track(stage.parameters())
        with device:
            default_loss(stage(x[:, :-1]), x[:, 1:]).backward()
        peaks[level] = device.peak_bytes
        model.zero_grad(set_to_none=True)
    assert peaks["none"] > peaks["selective"] > peaks["full"]


def test_blocks_are_found_where_models_keep_them():
    assert find_blocks(hf_llama()) == "model.layers"
    assert find_blocks(ToyModel()) == "blocks"
    from memx_launch.models.llama import LlamaStage
    parts = ModelParts(LlamaStage.full(get_model("llama-tiny")))
    assert (parts.path, [n for n, _ in parts.before], [n for n, _ in parts.after]) == \
        ("layers", ["tok_embeddings"], ["norm", "output"])


def test_a_model_built_with_one_block_has_it_found_where_its_full_model_keeps_them():
    """Calibration builds the user's model with one block (runtime/prepare.py): GPT-NeoX's, OPT's and
    MPT's, kept where no BLOCK_PATHS names, were not found at all with one."""
    from transformers import AutoModelForCausalLM

    from memx_launch.runtime.prepare import _blocks_up_to

    for kind in hf_block_memory.FAMILIES:
        found = []
        for cut in (False, True):
            config = hf_block_memory.family_config(kind)
            if cut:
                _blocks_up_to(config, 1)
            with torch.device("meta"):
                found.append(find_blocks(AutoModelForCausalLM.from_config(config)))
        assert found[0] == found[1], kind


def test_a_module_without_blocks_is_a_one_line_error():
    with pytest.raises(ConfigError) as info:
        ModelParts(NoBlocks())
    assert "\n" not in str(info.value) and "blocks=" in str(info.value)
    with pytest.raises(ConfigError, match="no non-empty ModuleList"):
        ModelParts(ToyModel(), blocks="head")


def test_a_forward_memx_cannot_read_is_caught():
    class Scaled(ToyModel):
        def forward(self, tokens):
            return super().forward(tokens) * 2  # something the parts do not do

    with pytest.raises(ConfigError, match="does not reproduce its forward"):
        ModelParts(Scaled()).verify()
    ModelParts(ToyModel()).verify()


def _hf_config(family):
    import transformers as T

    small = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=97)
    return {"gpt2": lambda: T.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
                                         bos_token_id=0, eos_token_id=0),
            "opt": lambda: T.OPTConfig(**small, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=16,
                                       pad_token_id=1, bos_token_id=0, eos_token_id=0),
            "qwen2": lambda: T.Qwen2Config(**small, num_key_value_heads=2, intermediate_size=64,
                                           tie_word_embeddings=True),
            "gemma": lambda: T.GemmaConfig(**small, num_key_value_heads=1, head_dim=8, intermediate_size=64,
                                           pad_token_id=0, bos_token_id=0, eos_token_id=0),
            # Windows shorter than the test's sequence: each block must get its own type's mask.
            # Its attention soft-capped at 0.01, where the tiny model's scores bend (its default is 50).
            "gemma2": lambda: T.Gemma2Config(**small, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                             sliding_window=4, attn_logit_softcapping=0.01, pad_token_id=0,
                                             bos_token_id=0, eos_token_id=0),
            "gemma3": lambda: T.Gemma3TextConfig(**small, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                                 sliding_window=4, sliding_window_pattern=2, pad_token_id=0,
                                                 bos_token_id=0, eos_token_id=0),
            "mistral": lambda: T.MistralConfig(**small, num_key_value_heads=2, intermediate_size=64, sliding_window=4),
            "cohere": lambda: T.CohereConfig(**small, intermediate_size=64, logit_scale=0.5, pad_token_id=0),
            "granite": lambda: T.GraniteConfig(**small, intermediate_size=64, logits_scaling=4.0),
            "phi": lambda: T.PhiConfig(**small, intermediate_size=64),
            "qwen3": lambda: T.Qwen3Config(**small, num_key_value_heads=2, intermediate_size=64, head_dim=8),
            # Mixtures of experts, each expert whole (transformers 5 keeps a block's experts in 3-D tensors).
            "mixtral": lambda: T.MixtralConfig(**small, num_key_value_heads=2, intermediate_size=48,
                                               num_local_experts=4, num_experts_per_tok=2),
            "qwen3_moe": lambda: T.Qwen3MoeConfig(**small, num_key_value_heads=2, intermediate_size=64, head_dim=8,
                                                  moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2),
            "qwen2_moe": lambda: T.Qwen2MoeConfig(**small, num_key_value_heads=2, intermediate_size=64,
                                                  moe_intermediate_size=24, shared_expert_intermediate_size=48,
                                                  num_experts=4, num_experts_per_tok=2)}[family]()


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("opt", True), ("qwen2", True), ("gemma", True),
                                         ("phi", False), ("mixtral", False), ("qwen3_moe", False),
                                         ("qwen2_moe", False), ("gemma2", True), ("gemma3", True),
                                         ("mistral", False), ("cohere", True), ("granite", False),
                                         ("qwen3", False)])
def test_hugging_face_causal_lms_split_into_stages_reproduce_the_model(family, tied):
    """Learned positions (GPT-2, OPT), embedding scaling (Gemma), a projection after the final norm
    (OPT), parallel blocks (Phi), sliding windows (Mistral's on every block, Gemma 2 and 3's on
    some, Gemma 3's rotary table per attention type), the head's logits soft-capped (Gemma 2 and 3)
    or scaled (Cohere, Granite) and tied embeddings: the model's own forward, cut in two, with and
    without a padding mask."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family))
    parts = ModelParts(model)
    parts.verify()
    x = torch.randint(1, 97, (2, 8))
    model.eval()
    first = parts.stage(0, 1, first=True, last=False, recompute="none")
    last = parts.stage(1, 2, first=False, last=True, recompute="full")
    assert torch.allclose(last(first(x)), model(x).logits, atol=1e-6, rtol=0)
    mask = torch.ones_like(x)
    mask[1, 6:] = 0
    kept = mask.bool()  # OPT places padding's positions apart; only the tokens' logits are trained
    assert torch.allclose(last(first(x, attention_mask=mask), attention_mask=mask)[kept],
                          model(x, attention_mask=mask).logits[kept], atol=1e-6, rtol=0)
    assert len(parts.tied) == tied
    # each end of a split holds its copy of the tied weight; a stage holding both ends holds one
    assert len(parts.tied_names(first)) == len(parts.tied_names(last)) == tied
    assert parts.tied_names(parts.stage(0, 3, first=True, last=True, recompute="none")) == []


@pytest.mark.parametrize("kind", list(hf_block_memory.FAMILIES))
def test_every_family_memx_reads_runs_as_its_own_forward_cut_after_its_first_block(kind):
    """Each Transformers family the memory benchmark measures (Llama 4's decoder where get_decoder()
    does not look, Gemma 4's key-value store, BLOOM's and MPT's ALiBi biases, nanochat's norm before
    its blocks, ModernBERT's head transform, ...), two layers of its own config, cut after its first
    layer: its logits with and without a padding mask, as ``verify`` checks it, and each end holding
    its copy of a tied embedding. Gemma 4's E models (per-layer inputs) run as one stage and refuse a cut."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_block_memory.family_config(kind)).eval()
    parts = ModelParts(model)
    parts.verify()
    x = torch.randint(1, hf_block_memory.SHAPE["vocab_size"], (2, 16))
    mask = torch.ones_like(x)
    mask[1, 12:] = 0
    kept = mask.bool()
    if parts.one_stage:
        with pytest.raises(ConfigError, match="--pp 1"):
            parts.stage(0, 1, first=True, last=False, recompute="none")
        stages = [parts.stage(0, 2, first=True, last=True, recompute="none")]
    else:
        stages = [parts.stage(0, 1, first=True, last=False, recompute="none"),
                  parts.stage(1, 1, first=False, last=True, recompute="full")]
        assert len(parts.tied_names(stages[0])) == len(parts.tied_names(stages[1])) == len(parts.tied)
    got, got_masked = x, x
    for stage in stages:
        got, got_masked = stage(got), stage(got_masked, attention_mask=mask)
    assert torch.allclose(got, model(x).logits, atol=1e-5, rtol=0)
    assert torch.allclose(got_masked[kept], model(x, attention_mask=mask).logits[kept], atol=1e-5, rtol=0)


def test_gemma_4_s_per_layer_inputs_and_shared_keys_and_values_train_on_one_stage():
    """Gemma 4's E models: each block takes a per-layer input made from the token ids, and the last
    layers reuse earlier layers' keys and values. One stage holding every block is the model, its
    forward and (full recompute included) its gradients; a split is refused, naming --pp 1; and
    calibration's probe of one block runs (given a per-layer input of zeros)."""
    import copy

    model = hf_example("hf-gemma4-tiny")
    assert model.config.kv_sharing_modes.count("reuse") == 4  # what the example exercises
    parts = ModelParts(model)
    parts.verify()
    assert len(parts.one_stage) == 2
    x = torch.randint(1, 512, (2, 24))
    mask = torch.ones_like(x)
    mask[1, 18:] = 0
    reference = copy.deepcopy(model)
    for recompute in ("none", "full"):
        whole = parts.stage(0, parts.num_layers, first=True, last=True, recompute=recompute)
        got = whole(x, attention_mask=mask)
        want = reference(x, attention_mask=mask).logits
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
        model.zero_grad(), reference.zero_grad()
        got.pow(2).mean().backward()
        want.pow(2).mean().backward()
        grads = dict(reference.named_parameters())
        assert all(p.grad is not None and torch.allclose(p.grad, grads[n].grad, atol=1e-6, rtol=0)
                   for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match=r"per-layer inputs made from the token ids and layers reusing earlier "
                                          r"layers' keys and values.*--pp 1"):
        parts.stage(0, 4, first=True, last=False, recompute="none")
    probe = parts.block_probe("full")
    h = torch.randn(2, 24, model.config.hidden_size, requires_grad=True)
    probe(h).sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


# --------------------------------------------------------------------------- 4 gloo processes


def make_plan(spec, stages, tp=1, dp=1, micro_batch_size=1, global_batch_size=8, seq_len=32):
    plans = [StagePlan("cpu", list(r), n, level, 0.0, 0.0) for r, n, level in stages]
    plan = Plan(spec.name, spec, "test", tp, len(plans), dp, micro_batch_size, global_batch_size, seq_len,
                "1f1b", 1, plans, 0.0, Objective(1.0, "default", (0.4, 0.2, 0.4)))
    plan.validate()
    return plan


MODELS = os.path.join(os.path.dirname(__file__), "..", "examples", "models")
HF_SPEC = get_model(os.path.join(MODELS, "hf-llama-tiny"))
QWEN2_SPEC = get_model(os.path.join(MODELS, "hf-qwen2-tiny"))  # tied embeddings, TP-able blocks
QWEN3_SPEC = get_model(os.path.join(MODELS, "hf-qwen3-tiny"))  # a norm on each query and key head
MIXTRAL_SPEC = get_model(os.path.join(MODELS, "hf-mixtral-tiny"))  # 4 experts, 2 a token, each whole on a rank
# Its config with the load-balancing loss on (output_router_logits), its coefficient large enough to tell.
ROUTER_LOSS = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
GPT2_SPEC = get_model(os.path.join(MODELS, "hf-gpt2-tiny"))  # tied embeddings, learned positions
# Biases, LayerNorm, attention and MLP side by side, one q, k, v linear: split by Transformers' TP plan.
GPT_NEOX_SPEC = get_model(os.path.join(MODELS, "hf-gpt-neox-tiny"))
# Maverick's layout: a dense block before each expert one (every token through each of its 4 experts),
# chunked attention, a layer in four without RoPE.
LLAMA4_SPEC = get_model(os.path.join(MODELS, "hf-llama4-tiny"))
PADDED = "hf pp=2 x dp=2 (DDP) left-padded dict batches from a DataLoader, memx's token-mean loss"


def _across_vendors(spec, layers, recompute, training=None, **layout):
    """memx estimate's plan of a two-stage layout on two emulated vendors (the first stage's
    ranks NVIDIA's, the second's AMD's), its crossings counted."""
    training = TrainingSpec(**{"global_batch_size": 8, "seq_len": 32, "dtype": "fp32", "setup": "memx-run",
                               **(training or {})})
    return evaluate_layout(spec, TWO_VENDORS, training, pp=2, micro_batch_size=1, layers_per_stage=layers,
                           recompute=recompute, stage_devices=["nv-small", "amd-big"], references=(1.0, 1.0, 1.0),
                           **layout)


def _in_bf16(plan):
    plan.training = {"dtype": "bf16"}  # the Runtime's precision follows the plan's training dtype
    return plan


# (model, plan, data parallel, cluster: None is one domain). The TP cases take fewer micro-batches:
# DTensor's per-operator dispatch on CPU made them most of this test's time.
CASES = {
    "hf pp=4 uneven 3/1/2/2 full/none/selective/none":
        ("hf", make_plan(HF_SPEC, [((0,), 3, "full"), ((1,), 1, "none"), ((2,), 2, "selective"),
                                   ((3,), 2, "none")], micro_batch_size=2), "auto", None),
    "qwen2 tied pp=2 x dp=2 (DDP) uneven 5/3 selective/full":
        ("hf-qwen2-tiny", make_plan(QWEN2_SPEC, [((0, 1), 5, "selective"), ((2, 3), 3, "full")], dp=2,
                                    micro_batch_size=2), "auto", None),
    "qwen2 tied pp=2 x dp=2 (DDP), its embeddings frozen (fine-tuning): no tied gradient to sum":
        ("hf-qwen2-tiny-frozen-embeddings", make_plan(QWEN2_SPEC, [((0, 1), 4, "none"), ((2, 3), 4, "none")], dp=2,
                                                      micro_batch_size=2), "auto", None),
    "qwen2 tied tp=2 x pp=2 uneven 6/2, the stages on two vendors (tied gradients over the bridge)":
        ("hf-qwen2-tiny", _across_vendors(QWEN2_SPEC, [6, 2], ["selective", "none"], tp=2, dp=1,
                                          training={"global_batch_size": 4}), "auto", TWO_VENDORS),
    "qwen2 tied tp=2 x pp=2, its parameters in bf16 (from_pretrained's default), the stages on two vendors":
        ("hf-qwen2-tiny-bf16", _across_vendors(QWEN2_SPEC, [6, 2], ["selective", "none"], tp=2, dp=1,
                                               training={"global_batch_size": 4, "dtype": "bf16",
                                                         "optimizer_dtype": "bf16-no-master", "grad_dtype": "bf16"}),
         "auto", TWO_VENDORS),
    "qwen3 tp=2 x pp=2 uneven 3/5 selective/none (its per-head query and key norms on each rank's heads)":
        ("hf-qwen3-tiny", make_plan(QWEN3_SPEC, [((0, 1), 3, "selective"), ((2, 3), 5, "none")], tp=2,
                                    micro_batch_size=2, global_batch_size=4), "auto", None),
    "gpt-neox tp=2 x pp=2 uneven 5/3 selective/full (its plan from Transformers: biases, fused q, k, v)":
        ("hf-gpt-neox-tiny", make_plan(GPT_NEOX_SPEC, [((0, 1), 5, "selective"), ((2, 3), 3, "full")], tp=2,
                                       micro_batch_size=2, global_batch_size=4), "auto", None),
    "mixtral pp=2 x dp=2 (FSDP2) uneven 5/3 selective/full":
        ("hf-mixtral-tiny", make_plan(MIXTRAL_SPEC, [((0, 1), 5, "selective"), ((2, 3), 3, "full")], dp=2,
                                      micro_batch_size=2), "fsdp", None),
    "mixtral with its load-balancing loss pp=2 x dp=2 (DDP) uneven 3/5 none/full, the stages on two vendors":
        ("hf-mixtral-router-loss", _across_vendors(replace(MIXTRAL_SPEC, router_aux_loss=True), [3, 5],
                                                   ["none", "full"], tp=1, dp=2), "auto", TWO_VENDORS),
    "llama4 pp=2 x dp=2 (DDP) uneven 5/3 full/selective, dense blocks between its expert ones, its blocks' "
    "arguments rebuilt on the second stage":
        ("hf-llama4-tiny", make_plan(LLAMA4_SPEC, [((0, 1), 5, "full"), ((2, 3), 3, "selective")], dp=2,
                                     micro_batch_size=2), "auto", None),
    "own block pp=2 x dp=2 uneven 3/1 full/selective":
        ("toy", make_plan(TOY_SPEC, [((0, 1), 3, "full"), ((2, 3), 1, "selective")], dp=2), "auto", None),
    "gpt2 tied pp=2 x dp=2 (FSDP2) uneven 3/5 full/none, the stages on two vendors":
        ("hf-gpt2-tiny", _across_vendors(GPT2_SPEC, [3, 5], ["full", "none"], tp=1, dp=2,
                                         training={"fully_sharded": True}), "fsdp", TWO_VENDORS),
    PADDED:
        ("hf-padded", make_plan(HF_SPEC, [((0, 1), 5, "none"), ((2, 3), 3, "full")], dp=2, micro_batch_size=2),
         "auto", None),
    "hf tp=2 x pp=2 in bf16 autocast, the padded DataLoader (memx-run --dtype bf16 picks TP 2)":
        ("hf-padded", _in_bf16(make_plan(HF_SPEC, [((0, 1), 4, "selective"), ((2, 3), 4, "none")], tp=2,
                                         micro_batch_size=2, global_batch_size=4)), "auto", None),
}
STEPS = 3


def _model(kind):
    if kind == "hf-mixtral-router-loss":
        return hf_example("hf-mixtral-tiny", **ROUTER_LOSS)
    if kind == "hf-qwen2-tiny-bf16":
        return hf_example("hf-qwen2-tiny").to(torch.bfloat16)
    if kind == "hf-qwen2-tiny-frozen-embeddings":
        model = hf_example("hf-qwen2-tiny")
        model.get_input_embeddings().weight.requires_grad_(False)  # the head's too: one tied weight
        return model
    if kind.startswith("hf-") and kind != "hf-padded":
        return hf_example(kind)
    return hf_llama() if kind.startswith("hf") else ToyModel()


def _batches(plan, vocab):
    """One batch, every step: the loss must fall."""
    tokens = torch.randint(0, vocab, (plan.global_batch_size, plan.seq_len + 1),
                           generator=torch.Generator().manual_seed(7))
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _padded(plan):
    """examples/finetune_padded.py's DataLoader: README lines of every length, padded on the left,
    in the order of the first seed whose first batch has a padded row (lines longer than the
    sequence are cut, so which batches hold padding moves as the README is edited)."""
    from finetune_padded import loader

    for seed in range(100):
        probe = loader(plan.global_batch_size, plan.seq_len, seed=seed, side="left")  # iterating draws its order
        if (next(iter(probe))["attention_mask"] == 0).any():
            return loader(plan.global_batch_size, plan.seq_len, seed=seed, side="left")
    raise AssertionError(f"no first batch of {plan.global_batch_size} README lines has one shorter than {plan.seq_len}")


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _worker(rank, port, cases, queue):
    import torch.distributed as dist
    from memx_launch.runtime.communication import init_distributed
    from memx_launch.runtime.prepare import prepare

    # the test plans predict no time (the watchdog's floor, 60 s): a loaded machine is slow, not hung
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4",
                      MEMX_STRICT_DOMAINS="1", MEMX_STEP_TIMEOUT_S="600")
    torch.set_num_threads(1)
    results = []
    try:
        for generation, (kind, plan, data_parallel, cluster) in enumerate(cases):
            os.environ["MEMX_GENERATION"] = str(generation)  # a fresh key prefix per process group
            init_distributed(plan, cluster)
            torch.set_num_threads(1)
            model = _model(kind)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
            padded = kind == "hf-padded"
            try:
                job = prepare(model, optimizer, data=_padded(plan) if padded else None,
                              loss_fn=None if padded else default_loss, lr_scheduler=_schedule, max_grad_norm=CLIP,
                              plan=plan, emulated=EmulatedDevice("cpu", 1.0), data_parallel=data_parallel,
                              cluster=cluster)
            except ConfigError as exc:
                results.append(str(exc))
                # Every rank refuses at once; wait for the last one's rendezvous before rank 0,
                # which holds the store, can exit (a slow rank 3 once failed to connect).
                dist.barrier()
                dist.destroy_process_group()
                continue
            batches = job.data if padded else [job.local_batch(pair)
                                               for pair in _batches(plan, plan.model_spec.vocab_size)]
            stats = [job.step(batch) for _, batch in zip(range(STEPS), batches)]
            results.append(([s.loss for s in stats], sum(s.bridge_messages for s in stats), stats[0].bridge_bytes))
            dist.destroy_process_group()
    finally:
        queue.put((rank, results))
        if dist.is_initialized():
            dist.destroy_process_group()


def _reference(kind, plan):
    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scheduler = _schedule(optimizer)
    losses = []
    if kind == "hf-padded":  # Hugging Face's own loss: the mean over the global batch's labelled tokens
        batches = [(batch, None) for _, batch in zip(range(STEPS), _padded(plan))]
    else:
        batches = _batches(plan, plan.model_spec.vocab_size)
    # A bf16 plan's forward runs under bf16 autocast in memx's runtime: the reference does too, so
    # that Adam's large early steps do not amplify the 8-bit mantissa's rounding into the comparison.
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.training.get("dtype") == "bf16")
    for x, y in batches:
        with autocast:
            if y is None:
                loss = model(**x).loss
            elif kind == "hf-mixtral-router-loss":  # the load-balancing loss is each micro-batch's own
                loss = torch.stack([_with_router_loss(model, *pair) for pair in
                                    zip(x.split(plan.micro_batch_size), y.split(plan.micro_batch_size))]).mean()
            else:
                out = model(x)
                loss = default_loss(getattr(out, "logits", out), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _with_router_loss(model, x, y, router_loss=True):
    """The loss Transformers' mixture adds up with labels: the tokens' and its load-balancing term."""
    out = model(x)
    return default_loss(out.logits, y) + router_loss * model.router_aux_loss_coef * out.aux_loss


@pytest.mark.slow
def test_user_models_match_the_single_process_reference_over_three_steps():
    """Tied embeddings included: the first and last stage's copies take the same step as the one
    weight of the single process only if their gradients are summed (steps 2 and 3 tell)."""
    toy_tp = make_plan(TOY_SPEC, [((0, 1), 2, "none"), ((2, 3), 2, "none")], tp=2)
    cases = [*CASES.values(), ("toy", toy_tp, "auto", None)]
    results = spawn_ranks(_worker, 4, cases, timeout=480)
    for i, (name, (kind, plan, _, cluster)) in enumerate(CASES.items()):
        ref = _reference(kind, plan)
        # One batch every step must train to a lower loss; the padded cases step through the README's
        # lines, whose next batch may be harder (which ones moves with every edit of the README).
        falls = kind != "hf-padded"
        for rank in range(4):
            got, bridge_messages, bridge_bytes = results[rank][i]
            atol = BF16_LOSS_ATOL if plan.training.get("dtype") == "bf16" else LOSS_ATOL
            assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, ref)) < atol, (name, rank, got, ref)
            assert not falls or got[-1] < got[0], (name, rank, got)
            assert (bridge_messages > 0) == (cluster is not None), (name, rank)
            if cluster is not None:  # the pipeline's sends and the tied gradients' sum, as the plan counts them
                assert bridge_bytes == pytest.approx(plan.bridge_bytes_per_step, rel=1e-3), (name, rank, bridge_bytes)
        assert not falls or ref[-1] < ref[0], name
    # The padding mask moves the loss far beyond what the ranks are held to, so they must apply it.
    first = next(iter(_padded(CASES[PADDED][1])))
    model = hf_llama()
    assert abs(model(**first).loss - model(input_ids=first["input_ids"], labels=first["labels"]).loss) > 10 * LOSS_ATOL
    # So does the load-balancing loss: the ranks must carry it.
    router_plan = next(plan for kind, plan, *_ in CASES.values() if kind == "hf-mixtral-router-loss")
    x, y = _batches(router_plan, MIXTRAL_SPEC.vocab_size)[0]
    mixture = _model("hf-mixtral-router-loss")
    assert abs(_with_router_loss(mixture, x[:1], y[:1]) - _with_router_loss(mixture, x[:1], y[:1], False)) > 0.1
    for rank in range(4):  # TP on a block type memx does not know: every rank names the fix
        assert "no tensor-parallel plan for OwnBlock" in results[rank][-1] and "tp=1" in results[rank][-1]


@pytest.mark.parametrize("make", [hf_llama, ToyModel], ids=["hf-llama", "own-block"])
def test_calibration_measures_a_copy_of_the_users_block(make):
    from memx_launch.profiling.kernel import calibrate
    from memx_launch.profiling.space import Sample
    from memx_launch.specs.cluster import DeviceType

    model = make()
    parts = ModelParts(model)
    spec = HF_SPEC if make is hf_llama else TOY_SPEC
    cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
    samples = [Sample(1, 2, 32, level, spec.num_kv_heads) for level in ("none", "full")]
    # Three blocks: full recompute keeps only the inputs of the blocks not being recomputed
    none, full = calibrate(spec, cpu, samples, num_blocks=3, repeats=1, block_factory=parts.block_probe)
    assert none.peak_memory_bytes > full.peak_memory_bytes > 0 and none.time_s > 0
    assert all(p.grad is None for p in model.parameters())  # the user's own weights were not touched


def test_a_hugging_face_model_inside_a_wrapper_is_found_and_calibrated():
    from memx_launch.profiling.kernel import calibrate
    from memx_launch.profiling.space import Sample
    from memx_launch.specs.cluster import DeviceType

    wrapper = nn.Module()
    wrapper.model = hf_llama()  # as a LightningModule holds it
    parts = ModelParts(wrapper)
    assert parts.path == "model.model.layers"
    assert [n for n, _ in parts.after] == ["model.model.norm", "model.lm_head"]
    cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
    [m] = calibrate(HF_SPEC, cpu, [Sample(1, 1, 16, "selective", HF_SPEC.num_kv_heads)], num_blocks=1, repeats=1,
                    block_factory=parts.block_probe)
    assert m.feasible and m.peak_memory_bytes > 0


def test_a_mixture_of_experts_is_calibrated_with_its_own_hugging_face_block():
    """memx's LLaMA block has no experts (it refuses to build one): memx-run measures the model's own."""
    from memx_launch.models.llama import TransformerBlock
    from memx_launch.profiling.kernel import calibrate
    from memx_launch.profiling.space import Sample
    from memx_launch.runtime.prepare import user_block_parts
    from memx_launch.specs.cluster import DeviceType

    parts = user_block_parts({"MEMX_MODEL": os.path.join(MODELS, "hf-mixtral-tiny")})
    assert type(next(iter(parts.block_probe("none").blocks.values()))).__name__ == "MixtralDecoderLayer"
    cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
    none, full = calibrate(MIXTRAL_SPEC, cpu, [Sample(1, 2, 32, level, MIXTRAL_SPEC.num_kv_heads)
                                               for level in ("none", "full")], num_blocks=3, repeats=1,
                           block_factory=parts.block_probe)
    assert none.peak_memory_bytes > full.peak_memory_bytes > 0 and none.time_s > 0
    with pytest.raises(ConfigError, match="model.num_experts"):
        TransformerBlock(MIXTRAL_SPEC)


def test_memx_s_runtime_takes_a_mixture_of_experts_with_each_expert_whole_on_a_rank():
    import dataclasses

    from memx_launch.planning.runtime_support import check_runnable, runnable_model

    plan = make_plan(MIXTRAL_SPEC, [((0, 1), 4, "none"), ((2, 3), 4, "full")], dp=2)
    assert check_runnable(plan) is plan
    tp2 = make_plan(MIXTRAL_SPEC, [((0, 1), 4, "none"), ((2, 3), 4, "full")], tp=2)
    with pytest.raises(ConfigError, match=r"TP 1, EP 1\); plan with --tp 1 --expert-parallel 1"):
        check_runnable(tp2)
    plan.training = {"expert_parallel": 2}
    with pytest.raises(ConfigError, match="expert parallelism over 2 rank"):
        check_runnable(plan)
    # Dense blocks among the expert ones run too: calibration measures the first expert block.
    maverick = dataclasses.replace(MIXTRAL_SPEC, moe_layer_step=2)
    assert runnable_model(maverick) is maverick
    # A plan priced with multi-token prediction modules, which the model memx-run trains has none of.
    mtp = make_plan(dataclasses.replace(MIXTRAL_SPEC, mtp_layers=1), [((0, 1), 4, "none"), ((2, 3), 4, "full")], dp=2)
    with pytest.raises(ConfigError, match="prices 1 multi-token prediction module.*plan with --setup memx-run"):
        check_runnable(mtp)


@pytest.mark.parametrize("family,fields,dense", [
    ("llama4_text", {"interleave_moe_layer_step": 2}, [0]),  # Maverick's: a dense block before each expert one
    ("glm4_moe", {"first_k_dense_replace": 2, "num_nextn_predict_layers": 1}, [0, 1]),  # GLM-4.5's, with MTP
    ("deepseek_v3", {"first_k_dense_replace": 2, "num_nextn_predict_layers": 1}, [0, 1]),  # and latent attention
])
def test_a_mixture_s_first_expert_block_is_calibrated_beside_its_dense_ones(family, fields, dense, tmp_path):
    """A mixture whose first blocks, or every other one, are dense: memx-run builds its config up to
    its first expert block, which calibration measures (a profile times the repeated block; the
    dense ones are priced beside it at its learned ratio), and trains it without the multi-token
    prediction modules Transformers does not build."""
    from memx_launch.planning.runtime_support import as_memx_run_trains, runnable_model
    from memx_launch.runtime.prepare import user_block_parts

    config = hf_block_memory.family_config(family, num_hidden_layers=4, **fields)
    config.save_pretrained(tmp_path)
    spec = as_memx_run_trains(runnable_model(get_model(str(tmp_path))))
    assert spec.dense_block_count == 2 and spec.mtp_layers == 0
    parts = user_block_parts({"MEMX_MODEL": str(tmp_path)})
    assert parts.num_layers == len(dense) + 1 and parts.repeated_block == len(dense)
    params = [sum(p.numel() for p in block.parameters()) for block in parts.blocks]
    assert all(params[i] < params[-1] for i in dense)  # the dense ones hold no experts
    probe = parts.block_probe("full")
    (block,) = probe.blocks.values()
    assert sum(p.numel() for p in block.parameters()) == params[-1]
    h = torch.randn(2, 8, hf_block_memory.SHAPE["hidden_size"], requires_grad=True)
    probe(h).sum().backward()
    assert h.grad is not None
    # The Lightning callback reads the whole model: the same block, by the spec (first_repeated_block).
    from transformers import AutoModelForCausalLM

    from memx_launch.planning.extra_blocks import first_repeated_block

    whole = ModelParts(AutoModelForCausalLM.from_config(config))
    assert first_repeated_block(spec) == len(dense) and whole.num_layers == 4
    assert sum(p.numel() for p in whole.blocks[first_repeated_block(spec)].parameters()) == params[-1]


def test_a_gelu_config_is_calibrated_with_its_own_hugging_face_block():
    """memx's LLaMA cannot stand in for GPT-2's block: without --model-builder, memx-run measures
    the model's own block, built from its config.json; Llama-shaped configs keep memx's block."""
    from memx_launch.runtime.prepare import user_block_parts

    env = {"MEMX_MODEL": os.path.join(MODELS, "hf-gpt2-tiny")}
    probe = user_block_parts(env).block_probe("none")
    assert type(next(iter(probe.blocks.values()))).__name__ == "GPT2Block"
    h = torch.randn(2, 8, GPT2_SPEC.hidden_size)
    assert probe(h).shape == h.shape
    assert user_block_parts({"MEMX_MODEL": os.path.join(MODELS, "hf-llama-tiny")}) is None
    assert user_block_parts({"MEMX_MODEL": "llama-tiny"}) is None


def test_a_layer_norm_config_is_calibrated_with_its_own_hugging_face_block(tmp_path):
    """StableLM's block is gated like LLaMA's but normalises with LayerNorm, which memx's LLaMA does not build."""
    import json

    from memx_launch.runtime.prepare import user_block_parts

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "stablelm", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 97, "use_qkv_bias": True}))
    probe = user_block_parts({"MEMX_MODEL": str(tmp_path)}).block_probe("none")
    assert type(next(iter(probe.blocks.values()))).__name__ == "StableLmDecoderLayer"
    h = torch.randn(2, 8, 32)
    assert probe(h).shape == h.shape


def test_a_config_whose_block_fuses_its_linears_is_calibrated_with_its_own(tmp_path):
    """Phi-3's block is LLaMA's parts, its q, k and v one linear and its gate and up another: memx's
    LLaMA of the shape would be measured with five, so the model's own block is (read on the meta
    device first). SmolLM3's block of LLaMA's five linears keeps memx's."""
    import json

    from memx_launch.runtime.prepare import user_block_parts

    def parts(model_type):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "model_type": model_type, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 97, "pad_token_id": 0,
            "bos_token_id": 0, "eos_token_id": 0}))
        return user_block_parts({"MEMX_MODEL": str(folder)})

    probe = parts("phi3").block_probe("none")
    assert type(next(iter(probe.blocks.values()))).__name__ == "Phi3DecoderLayer"
    h = torch.randn(2, 8, 32)
    assert probe(h).shape == h.shape
    assert parts("smollm3") is None


def test_a_config_of_custom_code_is_never_run_and_keeps_memx_s_block_where_it_can(tmp_path):
    """A config.json whose model needs its own code (auto_map; transformers would ask whether to
    run it) is not built: memx's LLaMA stands in where it can, and where it cannot the job stops
    with one line that says what to pass."""
    import json

    from memx_launch.runtime.prepare import user_block_parts

    def config(**fields):
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "internlm2", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 97,
            "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"}, **fields}))
        return {"MEMX_MODEL": str(tmp_path)}

    assert user_block_parts(config()) is None
    with pytest.raises(ConfigError, match="^--model: transformers cannot build .* a block with a GELU MLP; "
                                          "pass --model-builder") as info:
        user_block_parts(config(hidden_act="gelu"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family,block", [("gemma2", "Gemma2DecoderLayer"), ("qwen3", "Qwen3DecoderLayer"),
                                          ("gemma3_text", "Gemma3DecoderLayer")])
def test_blocks_memx_s_llama_does_not_build_are_calibrated_with_their_own(tmp_path, family, block):
    """Gemma 2's soft-capped attention keeps its scores, Gemma 2's and 3's norms after attention
    and MLP and Qwen3's and Gemma 3's query and key norms keep their inputs: memx's own LLaMA block
    of the shape measures none of it, and a ratio learned from it against the model's count pulled
    a Gemma 2 plan's stages under what they held. The model's own block is calibrated instead."""
    import json

    from memx_launch.runtime.prepare import user_block_parts

    config = _hf_config("gemma3" if family == "gemma3_text" else family).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": family}))
    probe = user_block_parts({"MEMX_MODEL": str(tmp_path)}).block_probe("none")
    assert type(next(iter(probe.blocks.values()))).__name__ == block
    h = torch.randn(2, 8, 32)
    assert probe(h).shape == h.shape


def test_the_plan_not_the_model_decides_what_is_recomputed(caplog):
    """A model with Transformers' gradient checkpointing on recomputes every block whatever the
    plan says: memx turns it off, and a stage at "none" keeps what the plan counted."""
    from memx_launch.profiling.emulation import EmulatedDevice

    peaks = []
    for checkpointed in (False, True):
        model = hf_llama()
        if checkpointed:
            model.gradient_checkpointing_enable()
        with caplog.at_level("WARNING", logger="memx"):
            parts = ModelParts(model)
        assert not any(block.gradient_checkpointing for block in parts.blocks)
        assert ("gradient checkpointing is off" in caplog.text) == checkpointed
        stage = parts.stage(0, parts.num_layers, first=True, last=True, recompute="none")
        device = EmulatedDevice("x", 1.0)
        device.track(list(model.parameters()))
        device.reset_peak()
        before = device.live_bytes
        with device:
            stage(torch.randint(0, 128, (4, 64))).float().square().mean().backward()
        peaks.append(device.peak_bytes - before)
    assert peaks[0] == peaks[1]


def test_gemma_2_s_own_attention_recomputes_its_core_at_the_selective_level():
    """Gemma 2's soft-capped attention runs as its own (Transformers' eager attention), registered
    under memx's name: cut into stages at every level its logits and gradients are the model's,
    and "selective" drops what its core keeps, the scores (8 bytes each in fp32: the softmax's
    output and the tanh's), between no recompute and the whole block's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config("gemma2"))
    x = torch.randint(1, 97, (4, 64))
    ref = model(x).logits
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    parts = ModelParts(model)
    assert parts.kind.name == "Hugging Face Llama family, its own attention" and parts.kind.knows_attention
    assert model.config._attn_implementation == "memx_own_eager"
    out = _split_forward(parts, x, [1, 1, 1], ["selective", "none", "full"])
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-6, rtol=0), name
    peaks = {}
    for level in ("none", "selective", "full"):
        model.zero_grad(set_to_none=True)
        stage = parts.stage(0, parts.num_layers, first=True, last=True, recompute=level)
        device = EmulatedDevice("cpu", 1.0)
        device.track(stage.parameters())
        with device:
            stage(x).square().mean().backward()
        peaks[level] = device.peak_bytes
    scores = 4 * model.config.num_attention_heads * 64 * 64
    assert peaks["none"] - peaks["selective"] >= (parts.num_layers - 1) * 8 * scores > 0
    assert peaks["selective"] > peaks["full"]


def _user_block_calibration_worker(rank, port, queue):
    """Gemma 2's own block calibrated at TP 1 and at TP 2 over the two ranks, and a block memx has
    no TP plan for asked at TP 2."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from memx_launch.profiling.kernel import calibrate
    from memx_launch.profiling.space import Sample
    from memx_launch.specs.cluster import DeviceType
    from memx_launch.specs.hf_config import model_from_hf_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        cpu = DeviceType("cpu", "cpu", 8.0, 1.0, efficiency=1.0, memory_bandwidth_gbps=10)
        config = _hf_config("gemma2")
        torch.manual_seed(0)
        parts = ModelParts(AutoModelForCausalLM.from_config(config))
        spec = model_from_hf_dict(config.to_dict(), "gemma2-tiny")
        records = [calibrate(spec, cpu, [Sample(tp, 2, 32, "none", 2)], tp_group=group, repeats=1,
                             block_factory=parts.block_probe, block_tensor_parallel=parts.apply_tensor_parallel)[0]
                   for tp, group in ((1, None), (2, dist.group.WORLD))]
        try:
            calibrate(TOY_SPEC, cpu, [Sample(2, 2, 32, "none", 2)], tp_group=dist.group.WORLD, repeats=1,
                      block_factory=ModelParts(ToyModel()).block_probe)
            refused = ""
        except ConfigError as exc:
            refused = str(exc)
        queue.put((rank, ([(m.tp, m.feasible, m.peak_memory_bytes) for m in records], refused)))
    finally:
        dist.destroy_process_group()


def test_the_user_s_own_block_is_calibrated_split_by_tp_as_it_trains():
    """A plan at TP 2 was priced from the user's block measured whole, TP 2 extrapolated: Gemma 2's
    step at TP 2 came out predicted a third of what it took on the emulated cluster. Blocks memx
    splits by TP are now measured split, on a rank's heads and FFN share; the others only at TP 1."""
    results = spawn_ranks(_user_block_calibration_worker, 2, timeout=120)
    for rank in range(2):
        [(tp1, fits1, whole), (tp2, fits2, split)], refused = results[rank]
        assert (tp1, tp2) == (1, 2) and fits1 and fits2
        # A rank keeps half the heads' scores, Q, K, V and half the FFN; the norms' inputs stay whole.
        assert 0.5 * whole < split < 0.8 * whole, (rank, whole, split)
        assert "no tensor-parallel plan" in refused and "tp=1" in refused
