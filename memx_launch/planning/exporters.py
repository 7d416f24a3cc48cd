"""A plan as Megatron-LM's arguments (its torchrun lines and MEMX_* variables: ``launch_lines.py``).

Pure functions of a :class:`~memx_launch.planning.plan.Plan`; nothing here imports torch. Whatever
the target cannot express (per-stage recompute in Megatron-LM, for one) comes back as a
note next to the arguments instead of being dropped silently.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from memx_launch.planning.hybrid_export import deltanet_args, mamba_stack_args, megatron_blocks, split_notes_of
from memx_launch.planning.layer_split import chunk_layers
from memx_launch.planning.layouts import stage_device_types
from memx_launch.planning.model_states import holds_weights
from memx_launch.planning.plan import RECOMPUTE_LEVELS, Plan, parse_recompute
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.hybrid import layers_per_block
from memx_launch.specs.training import TrainingSpec


@dataclass
class Export:
    """Arguments for one tool plus what they could not say."""

    args: list[str]
    notes: list[str] = field(default_factory=list)

    def command_line(self) -> str:
        return shlex.join(self.args)


# --------------------------------------------------------------------------- Megatron-LM


def first_chunk_at_least(chunks: list[int], n: int) -> list[int]:
    """``chunks`` (one stage's, :func:`~memx_launch.planning.layer_split.chunk_layers`) with the
    first taking layers from the largest others until it holds ``n`` (a mixture of experts'
    dense first blocks, all in the first stage's first chunk)."""
    chunks = list(chunks)
    while chunks[0] < n:
        donor = max(range(1, len(chunks)), key=chunks.__getitem__)
        chunks[donor], chunks[0] = chunks[donor] - 1, chunks[0] + 1
    return chunks


def pipeline_layout(plan: Plan) -> str:
    """Megatron-Core ``--pipeline-model-parallel-layout`` of the plan's uneven split.

    The string lists pp * v chunks separated by ``|``, virtual-stage major (chunk k sits on
    pipeline rank k mod pp), ``E`` the embedding, ``t*N`` N decoder layers, ``L`` the loss
    head: 8 then 24 layers over two stages read ``Et*8|t*24L``; ``m`` a multi-token prediction
    module, before the loss. A Gated DeltaNet model's layers count in its blocks (two a block).
    """
    v = plan.virtual_stages
    unit = layers_per_block(plan.model_spec)
    per_stage = (chunk_layers([s.num_layers for s in plan.stages], v) // unit).tolist()
    per_stage[0] = first_chunk_at_least(per_stage[0], plan.model_spec.dense_layers)
    chunks = []
    for vpp in range(v):
        for pp_rank in range(plan.pp):
            n = per_stage[pp_rank][vpp]
            chunks.append(f"t*{n}" if n > 1 else "t" * n)
    chunks[0] = "E" + chunks[0]
    chunks[-1] = chunks[-1] + "m" * plan.model_spec.mtp_layers + "L"
    return "|".join(chunks)


def _megatron_recompute(plan: Plan) -> tuple[list[str], list[str]]:
    levels = [s.recompute for s in plan.stages]
    partial = [parse_recompute(s.recompute, s.num_layers) for s in plan.stages if s.recompute.startswith("full:")]
    if partial and all(s.recompute.startswith("full:") or s.recompute == "none" for s in plan.stages):
        # Block method: the first K layers of every pipeline stage recompute fully, one K for all.
        k = -(-max(count for _, count, _ in partial) // layers_per_block(plan.model_spec))  # Megatron counts blocks
        notes = [] if not any(every for *_, every in partial) else [
            "every N-th layer's recompute (full:everyN) has no form in Megatron-LM: its block method recomputes "
            "as many layers, the first ones, in the same time and with no more memory"]
        notes += [] if len(set(levels)) == 1 else [
            "per-stage recompute (" + ", ".join(f"stage {i}: {lvl}" for i, lvl in enumerate(levels))
            + f") cannot be expressed in Megatron-LM, which recomputes the first K layers of every "
            f"stage; these arguments use K={k} everywhere: memory-safe, but slower than the plan predicts"]
        return ["--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", str(k)], notes
    levels = ["full" if lvl.startswith("full:") else lvl for lvl in levels]
    # Megatron-LM applies one recompute setting to every stage; take the strongest one
    # any stage needs so that no stage gets less memory relief than the plan assumed.
    strongest = max(levels, key=RECOMPUTE_LEVELS.index)
    notes = []
    if len(set(levels)) > 1:
        notes.append(
            "per-stage recompute (" + ", ".join(f"stage {i}: {lvl}" for i, lvl in enumerate(levels))
            + f") cannot be expressed in Megatron-LM, which applies one setting to every stage; "
            f"these arguments use '{strongest}' everywhere: memory-safe, but slower than the "
            "plan predicts (memx-run applies the per-stage levels)")
    if strongest == "none":
        return [], notes
    modules = plan.training.get("recompute_modules")
    if strongest == "selective" and (modules or plan.model_spec.kv_lora_rank) and \
            plan.training.get("selective_recompute") != "op":
        return ["--recompute-granularity", "selective", "--recompute-modules", *(modules or ["mla_up_proj"])], notes
    if strongest == "selective":
        notes.append("selective recompute maps to Megatron's default recompute module (core_attn); "
                     "memx's selective level also recomputes the SwiGLU activation")
        if plan.training.get("selective_recompute") == "op":
            notes.append("the plan's selective level is torchtitan's op-level policy, which Megatron-LM does not "
                         "have: its core_attn recompute keeps more memory and recomputes less than planned")
        return ["--recompute-granularity", "selective"], notes
    # Uniform with one layer per unit checkpoints every layer's input: memx's "full".
    return ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"], notes


def _megatron_model(plan: Plan) -> tuple[list[str], list[str]]:
    """The model's shape in Megatron-LM's words: a LLaMA-style decoder (no biases, RMSNorm, RoPE,
    SwiGLU unless the model has a plain MLP) or a GPT-2 style one (LayerNorm, biases, a learned
    position table) with grouped-query attention when KV heads are fewer, its RoPE base and norm
    epsilon (Megatron's defaults, 10000 and 1e-5, are not every model's)."""
    spec, notes = megatron_blocks(plan.model_spec), []
    args = ["--num-layers", str(spec.num_layers), "--hidden-size", str(spec.hidden_size),
            "--ffn-hidden-size", str(spec.ffn_hidden_size), "--num-attention-heads", str(spec.num_heads)]
    if spec.num_kv_heads != spec.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(spec.num_kv_heads)]
    if spec.attention_head_dim:  # heads not hidden_size / num_heads wide
        args += ["--kv-channels", str(spec.attention_head_dim)]
    if spec.qk_norm:
        args += ["--qk-layernorm"]
    if spec.kv_lora_rank:
        args += ["--multi-latent-attention", "--kv-lora-rank", str(spec.kv_lora_rank), "--qk-head-dim",
                 str(spec.head_dim), "--qk-pos-emb-head-dim", str(spec.rope_head_dim),
                 "--v-head-dim", str(spec.v_head_dim or spec.head_dim)]
        args += ["--q-lora-rank", str(spec.q_lora_rank)] if spec.q_lora_rank else []
    if spec.mtp_layers:
        args += ["--mtp-num-layers", str(spec.mtp_layers)]
    learned = spec.position_embeddings > 0
    args += ["--seq-length", str(plan.seq_len), "--max-position-embeddings",
             str(spec.position_embeddings if learned else max(plan.seq_len, spec.seq_len)),
             "--vocab-size", str(spec.vocab_size),
             "--position-embedding-type",
             "learned_absolute" if learned else "none" if spec.hybrid_pattern or spec.alibi_attention else "rope",
             "--normalization", "LayerNorm" if spec.layer_norm else "RMSNorm"]
    if not spec.linear_biases:
        args += ["--disable-bias-linear", *(["--add-qkv-bias"] if spec.qkv_bias else [])]
    if spec.clamped_glu:  # GPT-OSS's experts' GLU at its published clamp (swiglu_limit 7) and up's offset (1)
        args += ["--quick-geglu", "--activation-func-clamp-value", "7.0", "--glu-linear-offset", "1.0"]
    elif spec.gated_mlp:
        args.append("--swiglu")
    if spec.attention_sink_scale:
        notes.append("the model's attention sinks scale the attention's output after the softmax (Granite SWA's), "
                     "as the plan counted; Megatron-LM has no such option: add your build's")
    elif spec.attention_sinks:  # a learned logit per head in each softmax (Transformer Engine's cuDNN kernel)
        args += ["--softmax-type", "learnable"]
    # What the plan counted that Megatron-LM's blocks have no option for: said, not dropped.
    for present, what in ((spec.alibi_attention, "ALiBi attention biases (BLOOM's; exported without positions)"),
                          (spec.value_norm, "a norm on every value head (Gemma 4's)"),
                          (spec.per_layer_input_size, "per-layer inputs (Gemma 4's)")):
        if present:
            notes.append(f"the model's {what}, as the plan counted; Megatron-LM has no such option: add your build's")
    if not spec.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if spec.attention_output_gate:
        args.append("--attention-output-gate")
    if spec.hybrid_pattern:  # pretrain_mamba.py's hybrid stack; Nemotron-H's attention has no positions
        hybrid_args, hybrid_notes = mamba_stack_args(spec)
    elif "G" in plan.model_spec.hybrid_pattern:  # Gated DeltaNet blocks (megatron_blocks made them GPT blocks)
        hybrid_args, hybrid_notes = deltanet_args(plan.model_spec)
    else:
        hybrid_args, hybrid_notes = [], []
    args += hybrid_args
    notes += hybrid_notes
    if not (learned or spec.hybrid_pattern):  # Megatron-LM reads --rotary-base as an integer.
        args += ["--rotary-base", str(round(spec.rope_theta))]
    args += ["--norm-epsilon", f"{spec.norm_eps:g}"]
    if spec.num_experts:  # grouped GEMMs and the dispatcher the plan times (flex: HybridEP, which spans NVL72)
        flex = plan.training.get("expert_dispatcher") == "flex"
        args += ["--num-experts", str(spec.num_experts), "--moe-router-topk", str(spec.experts_per_token),
                 "--moe-ffn-hidden-size", str(spec.moe_ffn_hidden_size), "--moe-grouped-gemm",
                 "--moe-token-dispatcher-type", "flex" if flex else "alltoall",
                 *(["--moe-flex-dispatcher-backend", "hybridep"] if flex else []),
                 "--expert-model-parallel-size", str(plan.training.get("expert_parallel", 1)),
                 # Megatron-Core's default would split each expert over TP: the planned degree, 1 unless given.
                 "--expert-tensor-parallel-size", str(plan.training.get("expert_tensor_parallel", 1)),
                 # Megatron's softmax router over one chosen expert has no gradient: it asks for pre-softmax.
                 *(["--moe-router-pre-softmax"] if spec.experts_per_token == 1 else [])]
        if spec.expert_groups:
            args += ["--moe-router-num-groups", str(spec.expert_groups),
                     "--moe-router-group-topk", str(spec.expert_groups_per_token)]
        if spec.shared_expert_ffn_hidden_size:
            args += ["--moe-shared-expert-intermediate-size", str(spec.shared_expert_ffn_hidden_size),
                     *(["--moe-shared-expert-gate"] if spec.shared_expert_gate else [])]
        if spec.dense_layers:  # the first blocks dense, of --ffn-hidden-size
            args += ["--moe-layer-freq", f"([0]*{spec.dense_layers}+[1]*{spec.num_layers - spec.dense_layers})"]
        elif spec.moe_layer_step > 1:  # dense blocks of --ffn-hidden-size between the expert ones
            step, rest = spec.moe_layer_step, spec.num_layers % spec.moe_layer_step
            pattern = f"([0]*{step - 1}+[1])*{spec.num_layers // step}" + f"+[0]*{rest}" * bool(rest)
            args += ["--moe-layer-freq", pattern]
        if plan.training.get("overlap_expert_comm"):
            args += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if spec.sliding_window or spec.attention_chunk_size:
        local = spec.num_layers - spec.full_attention_layers
        within = (f"{spec.sliding_window} tokens" if spec.sliding_window
                  else f"chunks of {spec.attention_chunk_size} tokens")
        notes.append(f"{local} of the model's {spec.num_layers} blocks attend within {within}, as the plan timed "
                     "them; these arguments do not say so: add your Megatron-LM's options for them")
    if not learned and spec.rope_theta != round(spec.rope_theta):
        notes.append(f"the model's RoPE base {spec.rope_theta:g} is not an integer; Megatron-LM's --rotary-base "
                     f"takes one ({round(spec.rope_theta)} here)")
    if not spec.lm_head:
        notes.append("the model has no LM head; Megatron-LM's GPT builds one on the last stage (its output "
                     "layer, logits and loss), which the plan did not count")
    if spec.post_norms:
        which = "too (Gemma's sandwich" if spec.pre_norms else "and not their inputs (OLMo 2's"
        notes.append(f"the model's blocks normalise their attention's and MLP's outputs {which} norms), which the "
                     "plan counted; Megatron-LM's GPT has no such norms: add your build's")
    if spec.relu_mlp:  # Megatron-LM's command line has no plain ReLU
        notes.append("the model's MLP is ReLU (OPT), which Megatron-LM builds as GELU: set your build's activation")
    if spec.parallel_blocks:
        notes.append("the model's attention and MLP run side by side (parallel blocks); Megatron-LM builds them "
                     "one after the other: two norms and four TP all-reduces per layer where the plan counted one "
                     "norm and two")
    return args, notes


# memx's FP8 recipe: Megatron's --fp8-format (E4M3 forward and E5M2 gradients, or E4M3 for all,
# as its MXFP8 runs) and --fp8-recipe (current scaling is "tensorwise").
MEGATRON_FP8_RECIPES = {"delayed": ("hybrid", "delayed"), "current": ("hybrid", "tensorwise"),
                        "mxfp8": ("e4m3", "mxfp8"), "blockwise": ("e4m3", "blockwise")}


def megatron_args(plan: Plan, cluster: ClusterSpec | None = None) -> Export:
    """Megatron-LM training arguments: the model's shape, precision, dropout, attention kernel and
    optimizer sharding the plan's predictions assumed, the plan's parallel layout, batch and
    recompute. ``cluster`` (the plan's) tells which device types run fused attention.

    The uneven layer split always goes through ``--pipeline-model-parallel-layout``, which
    also fixes the virtual-stage count (Megatron derives it from the number of chunks), so
    ``--num-layers-per-virtual-pipeline-stage`` is never given alongside it.
    """
    tp = plan.uniform_tp("Megatron-LM (one --tensor-model-parallel-size for all stages)")
    plan.uniform_dp("Megatron-LM (one data-parallel degree for all stages)")
    plan.within_one_domain("Megatron-LM")
    args, notes = _megatron_model(plan)
    training_args, training_notes = _megatron_training(plan, cluster)
    args += training_args
    notes += training_notes
    args += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(plan.pp)]
    if plan.cp > 1:  # Megatron's rank order (tp-cp-dp-pp) is the plan's; its default exchange is the p2p ring
        args += ["--context-parallel-size", str(plan.cp)]
    # pretrain_mamba.py's hybrid stack splits evenly, and Gated DeltaNet blocks cannot be cut: said, not given.
    split_notes = split_notes_of(plan) if plan.pp > 1 else []
    notes += split_notes
    mamba_stack = megatron_blocks(plan.model_spec).hybrid_pattern  # what _megatron_model exported
    if plan.pp > 1 and not (split_notes or mamba_stack):
        args += ["--pipeline-model-parallel-layout", pipeline_layout(plan)]
        if plan.virtual_stages > 1 and plan.num_microbatches % plan.pp:
            notes.append(f"{plan.num_microbatches} micro-batches is not a multiple of pp={plan.pp}; "
                         "older Megatron-LM releases reject that with the interleaved schedule")
    args += ["--micro-batch-size", str(plan.micro_batch_size),
             "--global-batch-size", str(plan.global_batch_size)]
    recompute_args, recompute_notes = _megatron_recompute(plan)
    args += recompute_args
    notes += recompute_notes
    notes.append("--vocab-size is the model's; with a real tokenizer (--tokenizer-type) Megatron-LM takes the "
                 "tokenizer's instead: add the data and tokenizer flags of your run")
    if len({s.device_type for s in plan.stages}) > 1:
        notes.append("stages run on different device types: start Megatron with the torchrun lines "
                     "made for it, whose node order puts each stage on its devices")
    return Export(args, notes)


def _megatron_training(plan: Plan, cluster: ClusterSpec | None) -> tuple[list[str], list[str]]:
    """The precision, dropout, attention kernel, optimizer and state sharding the plan's memory and
    time were predicted for, as Megatron flags (Megatron's defaults differ: dropout 0.1, its own
    choice of attention backend)."""
    tr = plan.training
    args, notes = [], []
    dtype = tr.get("dtype", "bf16")
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(dtype, [])
    if dtype == "fp16" and tr.get("grad_dtype", "fp32") == "fp32":  # with --bf16 Megatron does this itself
        args.append("--accumulate-allreduce-grads-in-fp32")
    # No dropout unless the plan kept its masks; with them, Megatron's own rate (0.1).
    args += [] if tr.get("dropout") else ["--hidden-dropout", "0"]
    args += [] if tr.get("attention_dropout") else ["--attention-dropout", "0"]
    attention_args, attention_notes = _megatron_attention(plan, cluster)
    args += attention_args
    notes += attention_notes
    if tr.get("optimizer", "adam") != "adam":
        args += ["--optimizer", tr["optimizer"]]
    if tr.get("fully_sharded"):
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
        spec = TrainingSpec(**tr)
        if plan.dp > 1 and holds_weights(spec, plan.pp):
            notes.append("Megatron-FSDP gathers and reduce-scatters every micro-batch, where the plan holds "
                         f"what it gathers (hold_gathered={spec.hold_gathered}): less memory and more gathers than "
                         "predicted; plan with --hold-gathered never to predict it")
    elif tr.get("distributed_optimizer"):
        args.append("--use-distributed-optimizer")
    if tr.get("shard_degree") and plan.dp > tr["shard_degree"]:  # HSDP (Megatron-FSDP) or the partial distributed optimizer
        args += ["--num-distributed-optimizer-instances", str(plan.dp // tr["shard_degree"])]
    if tr.get("sequence_parallel") and plan.tp > 1:
        args.append("--sequence-parallel")
    if tr.get("overlap_grad_reduce"):
        args.append("--overlap-grad-reduce")
    if tr.get("tp_comm_overlap") and plan.tp > 1:
        args.append("--tp-comm-overlap")
    if tr.get("overlap_p2p_comm") is False and plan.schedule == "interleaved":
        args.append("--no-overlap-p2p-communication")
    if tr.get("fused_loss"):
        args.append("--cross-entropy-loss-fusion")
    if tr.get("fused_activation") is False:  # the activation as eager ops, as the plan timed it
        swiglu = plan.model_spec.gated_mlp and not plan.model_spec.clamped_glu
        args.append("--no-bias-swiglu-fusion" if swiglu else "--no-bias-gelu-fusion")
    if tr.get("fp8"):
        fp8_format, recipe = MEGATRON_FP8_RECIPES[tr["fp8"]]
        args += ["--fp8-format", fp8_format, "--fp8-recipe", recipe]
    if tr.get("fp4"):
        args += ["--fp4-format", "e2m1", "--fp4-recipe", tr["fp4"]]
    if tr.get("fp8_params"):
        args.append("--fp8-param-gather")
    if tr.get("activation_offload_layers"):
        args += ["--cpu-offloading", "--cpu-offloading-num-layers", str(tr["activation_offload_layers"])]
        if plan.pp > 1 or any(s.recompute != "none" for s in plan.stages):
            notes.append("Megatron-LM offloads activations only without pipeline parallelism and without "
                         "recompute: plan with --pp 1 and --recompute-levels none, or run without "
                         "--cpu-offloading (the plan counted the offloaded layers' activations on the host)")
    if tr.get("optimizer_dtype") == "training_no_master":
        notes.append("the plan keeps no master copy of the weights (16-bit weights updated in place); Megatron-LM "
                     "keeps one: more memory than planned")
    if tr.get("optimizer_dtype") in ("training", "training_moments"):
        moments = "fp16" if dtype == "fp16" else "bf16"
        # Megatron's 16-bit main parameters are fp16 only.
        main = "fp16" if tr["optimizer_dtype"] == "training" else "fp32"
        args += ["--use-precision-aware-optimizer", "--main-params-dtype", main, "--exp-avg-dtype", moments,
                 "--exp-avg-sq-dtype", moments]
    if not tr:
        notes.append("the plan does not record its precision and optimizer (made before memx stored them): "
                     "add --bf16 or --fp16 and --use-distributed-optimizer as trained")
    if tr.get("setup") not in (None, "megatron"):
        notes.append(f"the plan was predicted for --setup {tr['setup']}; Megatron-LM keeps its own "
                     "model states (6 + 12/DP bytes per parameter with --use-distributed-optimizer)")
    if tr.get("fully_sharded") or tr.get("sharded_gradients") or tr.get("grad_dtype") == "training":
        notes.append("Megatron-LM keeps fp32 main gradients whole on every rank: its memory differs "
                     "from the plan's sharded or 16-bit gradients")
    return args, notes


def _megatron_attention(plan: Plan, cluster: ClusterSpec | None) -> tuple[list[str], list[str]]:
    """The attention kernel the plan timed: fused (FlashAttention) where the run asked for it and
    the device type has it, else the unfused one keeping the s x s scores."""
    tr = plan.training
    known = {d.name: d for d in cluster.device_types} if cluster is not None else {}
    # A stage on several types names them a+b (planning.layouts); a whole type name may hold a "+".
    types = {t for s in plan.stages for t in ([s.device_type] if s.device_type in known
                                              else stage_device_types(s.device_type))}
    fused = {t: tr.get("flash_attention", True) and (t not in known or known[t].flash_attention) for t in types}
    notes = [] if cluster is not None or not all(fused.values()) else [
        "--attention-backend flash assumes every device type runs fused attention: pass --cluster to check"]
    if len(set(fused.values())) > 1:
        on = ", ".join(sorted(t for t in types if fused[t]))
        notes.append(f"the plan times fused attention on {on} and unfused on "
                     + ", ".join(sorted(t for t in types if not fused[t])) + "; Megatron-LM takes one "
                     f"--attention-backend for all: unfused here, which every device runs; on {on} it keeps the "
                     "s x s attention scores: more memory and time than the plan predicts there")
    if all(fused.values()):  # FlashAttention has no sinks: Transformer Engine's cuDNN kernel takes them
        sinks = plan.model_spec.attention_sinks and not plan.model_spec.attention_sink_scale
        return ["--attention-backend", "fused" if sinks else "flash"], notes
    args = ["--attention-backend", "unfused"]
    if not tr.get("fused_softmax", True):
        args.append("--no-masked-softmax-fusion")
    if tr.get("softmax_in_fp32"):
        args.append("--attention-softmax-in-fp32")
    return args, notes
