"""What the ``memx`` subcommands share: the parser with memx's one-line errors, the model,
cluster and training flags, and the checks made before any work starts.
"""

from __future__ import annotations

import argparse
import functools
import math
import os

from memx_launch.errors import ConfigError
from memx_launch.files import check_output_path
from memx_launch.planning.host_time import EAGER_OP_HOST_S, FUSED_BLOCK_HOST_S
from memx_launch.specs.config_file import one_line_error
from memx_launch.specs.inputs import float_flag, int_flag
from memx_launch.specs.setups import OPTION_DEFAULTS, SETUPS
from memx_launch.specs.training import (EXPERT_DISPATCHERS, EXPERT_ROUTINGS, FLASH_ATTENTION_VERSIONS, FP4_RECIPES,
                                        FP8_RECIPES, HOLD_GATHERED, SELECTIVE_POLICIES, TrainingSpec)


class Parser(argparse.ArgumentParser):
    """argparse with the same one-line error format as every other memx error."""

    def error(self, message):
        one_line_error(self, message, "memx")


def add_target_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="catalog name (e.g. llama2-7b) or a Hugging Face config.json")
    p.add_argument("--parallel-blocks", "--parallel_blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="attention and MLP side by side on one normed input (GPT-J, GPT-NeoX, Falcon); "
                        "default: what the model says")
    p.add_argument("--lm-head", "--lm_head", action=argparse.BooleanOptionalAction, default=None,
                   help="an output layer and loss over the vocabulary on the last stage; --no-lm-head: a reward, "
                        "value or classifier model (default: what the model says)")
    p.add_argument("--cluster", required=required, help="cluster YAML file (see examples/clusters/)")
    p.add_argument("--global-batch-size", "--global_batch_size", type=int_flag, help="sequences per iteration")
    p.add_argument("--seq-len", "--seq_len", type=int_flag, help="tokens per sequence (default: the model's)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="training precision (default bf16)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), help="optimizer (default adam)")
    p.add_argument("--distributed-optimizer", "--distributed_optimizer", action="store_true", default=None,
                   help="shard optimizer state over data-parallel ranks (Megatron distributed optimizer, ZeRO-1)")
    p.add_argument("--fully-sharded", "--fully_sharded", action="store_true", default=None,
                   help="shard weights, gradients and optimizer state over data-parallel ranks (FSDP, ZeRO-3)")
    p.add_argument("--fully-sharded-with-tp", "--fully_sharded_with_tp", action=argparse.BooleanOptionalAction,
                   default=None, help="a layout with TP > 1 and DP > 1 runs fully sharded, and is priced so "
                                      "(memx-run's FSDP2: its DDP cannot hold TP's DTensor parameters; default off; "
                                      "--setup memx-run: on)")
    p.add_argument("--setup", choices=tuple(SETUPS),
                   help="the training framework's memory setup (docs/setups.md); explicit flags win")
    p.add_argument("--sequence-parallel", "--sequence_parallel", action=argparse.BooleanOptionalAction,
                   default=None, help="Megatron sequence parallelism (default: on for --setup megatron and torchtitan)")
    add_block_option_args(p)
    p.add_argument("--flash-attention-version", "--flash_attention_version", type=int_flag,
                   choices=FLASH_ATTENTION_VERSIONS, help="FlashAttention generation of the fused attention kernel: "
                   "its speed against the matmuls (default 2)")
    p.add_argument("--grad-dtype", "--grad_dtype", choices=("fp32", "bf16", "fp16"),
                   help="gradient precision (default fp32; bf16/fp16 = the training dtype)")
    p.add_argument("--loss-dtype", "--loss_dtype", choices=("fp32", "bf16", "fp16"),
                   help="precision of the logits for the loss (default fp32)")
    p.add_argument("--optimizer-dtype", "--optimizer_dtype", choices=("fp32", "bf16", "fp16", "bf16-moments",
                                                                       "fp16-moments", "bf16-no-master",
                                                                       "fp16-no-master"),
                   help="precision of the optimizer's master weights and moments (default fp32; bf16/fp16 = the "
                        "training dtype, 6 bytes per parameter with Adam; bf16-moments/fp16-moments: fp32 master "
                        "weights and 16-bit moments, 8 bytes; bf16-no-master/fp16-no-master: 16-bit weights "
                        "updated in place, 16-bit moments, 4 bytes)")
    p.add_argument("--vocab-parallel-loss", "--vocab_parallel_loss", action=argparse.BooleanOptionalAction,
                   default=None, help="Megatron's vocab-parallel cross entropy; off: logits gathered over TP "
                   "(default on)")
    p.add_argument("--vocab-parallel-embedding", "--vocab_parallel_embedding", action=argparse.BooleanOptionalAction,
                   default=None, help="the embedding and output layer split over the vocabulary by TP; off: whole on "
                   "every TP rank (default on; --setup memx-run: off)")
    p.add_argument("--overlap-grad-reduce", "--overlap_grad_reduce", action=argparse.BooleanOptionalAction,
                   default=None, help="DP gradient reduction overlapped with the last backward (default off)")
    for flag, text in (("fused-loss", "one-kernel cross entropy: 16-bit logits and gradient only (default off)"),
                       ("torch-loss-parallel", "the vocab-parallel loss in torch's ops (DTensor's loss_parallel(), "
                        "torchtitan's under TP): 16 bytes per logit where Megatron's holds 8 (default off; --setup "
                        "torchtitan: on)"),
                       ("fused-gate-up", "SwiGLU gate and up as one TP linear: one backward all-reduce, one "
                        "autocast cast kept (default on; --setup scaling, ddp and memx-run: off)"),
                       ("fused-qkv", "q, k and v as one TP linear: one backward all-reduce, one autocast cast kept "
                        "(default on; --setup ddp and memx-run: off)"),
                       ("transformers-blocks", "blocks as Transformers writes them: a mixture's experts keep each "
                        "down projection's output, in the weights' dtype (fp32 under autocast, GEMMs at the fp32 "
                        "rate); a fused q, k, v projection with rotary embedding is kept whole by its views (default "
                        "off; --setup ddp, zero3 and memx-run: on)"),
                       ("overlap-expert-comm", "a mixture of experts' all-to-alls behind another micro-batch's "
                        "compute (Megatron's --overlap-moe-expert-parallel-comm; default off)"),
                       ("fused-activation", "the MLP's activation as one kernel keeping only its input: SwiGLU's "
                        "silu(gate) not kept, one read and one write (Megatron's fusion; default off; --setup "
                        "megatron: on)"),
                       ("keep-stage-outputs", "the pipeline engine keeps each in-flight micro-batch's stage output "
                        "until its gradient returns (default off; --setup scaling, torchtitan and memx-run: on)"),
                       ("keep-previous-logits", "the last stage keeps the previous micro-batch's logits in its "
                        "second buffer (default off; --setup scaling: on)"),
                       ("checkpoint-early-stop", "full recompute stops at the block's last saved tensor "
                        "(torch's non-reentrant checkpoint): its last linear and TP collective not run again "
                        "(default off; --setup torchtitan, ddp and memx-run: on)"),
                       ("torch-pipelining", "torch.distributed.pipelining's own stages: a receive buffer per "
                        "micro-batch for each stage's input and its output's gradient, kept for the job (default "
                        "off; --setup torchtitan: on)"),
                       ("sp-keeps-gathered-input", "sequence parallel linears keep their all-gathered input (default "
                        "off; --setup scaling, torchtitan: on)"),
                       ("tp-comm-overlap", "Megatron's TP communication overlap (userbuffers, needs sequence "
                        "parallelism): TP collectives in chunks behind the linear GEMMs (default off)"),
                       ("async-tp", "torch's AsyncTP (torchtitan's, needs sequence parallelism and compile): the "
                        "first forward's TP collectives in chunks behind its GEMMs, the backward's whole "
                        "(default off)"),
                       ("partitioned-sends", "DeepSpeed's and memx-run's pipeline sends: 1/TP per rank, all-gathered "
                        "over TP on receipt (default off; setup memx-run: on)"),
                       ("partition-where-faster", "with --partitioned-sends: only the edges where that is priced "
                        "faster than whole sends, the plan's send_parts per stage (default off: every edge, as "
                        "DeepSpeed; --setup memx-run: on)"),
                       ("fp32-allreduce", "DeepSpeed's fp32_allreduce: 16-bit gradients reduced over DP in fp32"),
                       ("full-gradient-allreduce", "a sharded optimizer all-reduces the whole gradients over "
                        "DP instead of reduce-scattering them (Aleph Alpha's scaling)"),
                       ("overlap-p2p-comm", "an interleaved pipeline's sends overlap the next chunk's compute "
                        "(Megatron-LM's --overlap-p2p-communication, torch's interleaved schedule); off: each blocks "
                        "(default on)"),
                       ("ddp-bucket-copy", "torch DDP without gradient_as_bucket_view: its buckets hold a second copy "
                        "of the gradients (default off; --setup ddp: on)"),
                       ("grad-accumulation-pass", "each micro-batch after a step's first adds its gradients into the "
                        "held ones in a pass of its own (torch's AccumulateGrad; default off; --setup ddp and "
                        "memx-run: on)"),
                       ("zero-grad-after-forward", "the last step's gradients freed after the forward (Lightning's "
                        "closure: zero_grad between training_step and backward): the forward's peak holds them "
                        "(default off; the Lightning callback: on)"),
                       ("foreach-optimizer", "Adam steps all of a rank's parameters at once, DTensor ones too (torch's "
                        "default on a GPU): a temporary of one moment each beside the gradients; off: fused kernels, "
                        "a for-loop (default off; --setup ddp and memx-run: on)"),
                       ("autocast-per-step", "torch.autocast's region spans the step (memx-run's runtime): each fp32 "
                        "weight cast once a step, not every micro-batch (default off; --setup memx-run: on)"),
                       ("cp-all-gather", "context parallelism as torch's context_parallel runs it: each attention "
                        "pass all-gathers the K and V chunks at once, the backward rings dK and dV in fp32 (default "
                        "off: Transformer Engine's ring; --setup torchtitan: on)"),
                       ("repeat-kv", "the attention kernel receives K and V repeated to the query heads, kept and "
                        "sent over CP at the query width (torchtitan's LLaMA; default off; --setup torchtitan: on)")):
        p.add_argument(f"--{flag}", f"--{flag.replace('-', '_')}", action=argparse.BooleanOptionalAction,
                       default=None, help=text if "default" in text else text + " (default off; --setup scaling: on)")
    p.add_argument("--hold-gathered", "--hold_gathered", choices=HOLD_GATHERED,
                   help="what a fully sharded run keeps gathered: never (each layer gathered and reduce-scattered "
                        "every micro-batch: ZeRO-3, Megatron-FSDP; --setup zero3), weights (from a micro-batch's "
                        "forward to its backward: FSDP2's reshard_after_forward=False), pipelined (weights and "
                        "unsharded gradients through the step on a pipeline's stages, as FSDP2 runs under torch's "
                        "pipelining: torchtitan, AutoModel; default) or always (one stage too: memx-run)")
    p.add_argument("--max-live-params", "--max_live_params", type=float_flag, metavar="N",
                   help="a fully sharded run fetches its weights as DeepSpeed ZeRO-3 does: one all-gather per "
                        "linear, up to N parameters gathered at once (stage3_max_live_parameters), its module hooks "
                        "adding host time (--setup zero3: 1e9); 0: one gather per block, as FSDP (default)")
    p.add_argument("--reduce-bucket-params", "--reduce_bucket_params", type=float_flag, metavar="N",
                   help="with --max-live-params: the gradients reduce-scattered in buckets of N parameters "
                        "(DeepSpeed's reduce_bucket_size; default 5e8; Hugging Face's auto: hidden^2)")
    p.add_argument("--prefetch-bucket-params", "--prefetch_bucket_params", type=float_flag, metavar="N",
                   help="with --max-live-params: a stage within the live budget all-gathers its weights in "
                        "prefetch buckets of N parameters (DeepSpeed's stage3_prefetch_bucket_size; default 5e7; "
                        "Hugging Face's auto: 0.9 hidden^2)")
    p.add_argument("--shard-degree", "--shard_degree", type=int_flag, metavar="N",
                   help="hybrid sharding: what the setup shards (--setup fsdp2, zero3, zero1, megatron, torchtitan) "
                        "spread over N consecutive ranks of each DP group, within a node where they fit, and "
                        "replicated over the DP/N such groups, which all-reduce the reduced gradients' shards "
                        "(PyTorch's HSDP, torchtitan's data_parallel_shard_degree, DeepSpeed's MiCS, Megatron's "
                        "--num-distributed-optimizer-instances DP/N); default: the whole DP group, or where a "
                        "fully sharded one spans communication domains, the most of its ranks in one domain")
    p.add_argument("--hpz-partition-size", "--hpz_partition_size", type=int_flag, metavar="N",
                   help="with --max-live-params: ZeRO++'s hpZ, a second shard of the weights over N ranks (a node's) "
                        "that the backward gathers from, at 1/N of the weights more memory "
                        "(DeepSpeed's zero_hpz_partition_size; default 1: none)")
    p.add_argument("--quantized-weights", "--quantized_weights", action=argparse.BooleanOptionalAction, default=None,
                   help="with --max-live-params: ZeRO++'s qwZ, each fetch all-gathers int8 weights and then their "
                        "fp32 scales, two collectives of half the bytes (DeepSpeed's zero_quantized_weights; "
                        "default off)")
    p.add_argument("--selective-recompute", "--selective_recompute", choices=SELECTIVE_POLICIES,
                   help="what the selective level recomputes: attention (Megatron's attention core, default), op "
                        "(torchtitan's op-level policy: all but the attention output and every other matmul's; "
                        "--setup torchtitan's default) or block (the whole block, as full: memx-run's on blocks "
                        "whose attention core it cannot reach)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="fp32 matmuls as TF32 on NVIDIA Ampere and later: half the 16-bit peak (default off)")
    p.add_argument("--host-ms-per-layer", "--host_ms_per_layer", type=float, metavar="MS",
                   help="host time the framework takes to issue one layer's forward and backward; no layer takes "
                        "less (default: the device type's host_ms_per_layer, measured by calibration on GPUs, "
                        f"else --eager-block's ops at {EAGER_OP_HOST_S * 1e6:g} us each, or a fused block's "
                        f"{FUSED_BLOCK_HOST_S * 1e3:g} ms)")
    p.add_argument("--frozen-fraction", "--frozen_fraction", type=float, metavar="F",
                   help="fine-tuning: share of the parameters frozen, no gradients or optimizer states (default 0)")
    p.add_argument("--lora-rank", "--lora_rank", type=int, metavar="R",
                   help="fine-tuning with LoRA adapters of rank R on every linear of each block, base frozen "
                        "(default 0: none)")
    p.add_argument("--fp8", choices=FP8_RECIPES, default=None,
                   help="FP8 linear layers (Transformer Engine) with delayed, current, MXFP8 (Blackwell) or "
                        "blockwise (DeepSeek-V3's) scaling: their GEMMs at the FP8 peak, FP8 inputs kept, FP8 weight "
                        "copies (default off)")
    p.add_argument("--fp4", choices=FP4_RECIPES, default=None,
                   help="FP4 linear layers with Transformer Engine's NVFP4 recipe (Blackwell): their GEMMs at the "
                        "FP4 peak, NVFP4 inputs and weight copies kept (default off)")
    p.add_argument("--fp8-params", "--fp8_params", action=argparse.BooleanOptionalAction, default=None,
                   help="with --fp8: the linear weights kept in FP8 only (Megatron's --fp8-param-gather): no "
                        "16-bit copy, gathered over DP in one byte (default off)")
    p.add_argument("--fp8-weight-cache", "--fp8_weight_cache", action=argparse.BooleanOptionalAction, default=None,
                   help="with --fp8/--fp4: each linear keeps its quantized weight copies between micro-batches "
                        "(Transformer Engine); off: cast at each GEMM (torchao's Float8Linear; default on; "
                        "--setup torchtitan: off)")
    p.add_argument("--optimizer-offload", "--optimizer_offload", action=argparse.BooleanOptionalAction,
                   default=None, help="optimizer on the host (ZeRO-Offload): no master weights or moments on the "
                   "GPU, gradients and weights over PCIe each step (default off)")
    p.add_argument("--expert-parallel", "--expert_parallel", type=int, metavar="EP",
                   help="a mixture-of-experts model's experts split over EP ranks of each stage, tokens exchanged "
                        "by all-to-all (Megatron's --expert-model-parallel-size; default 1; memx plan without it tries "
                        "the powers of two dividing the experts)")
    p.add_argument("--expert-tensor-parallel", "--expert_tensor_parallel", type=int, metavar="ETP",
                   help="each routed expert's MLP split over ETP ranks, which gather their tokens before it and "
                        "reduce-scatter its output (Megatron's --expert-tensor-parallel-size; default 1; memx plan "
                        "without it tries the powers of two dividing an expert's width, up to a node's devices)")
    p.add_argument("--expert-dispatcher", "--expert_dispatcher", choices=EXPERT_DISPATCHERS,
                   help="how a mixture of experts' tokens reach their experts: alltoall sends every routed copy "
                        "(and sorts a rank's copies into expert order and back); "
                        "flex (DeepEP, HybridEP) sends a token once per rank, and once per node beyond an NVLink "
                        "domain (Megatron's --moe-token-dispatcher-type; default alltoall)")
    p.add_argument("--expert-routing", "--expert_routing", choices=EXPERT_ROUTINGS,
                   help="which experts balanced routing picks for a token, which decides how many ranks and nodes "
                        "flex sends it to: random (Megatron's forced load balancing) or consecutive (token t to "
                        "experts t*k..t*k+k-1: NeMo AutoModel's fake_balanced_gate; default random)")
    p.add_argument("--recompute-modules", "--recompute_modules", metavar="M[,M...]",
                   help="what the selective recompute level runs again, in Megatron's --recompute-modules: "
                        "core_attn, mla_up_proj, layernorm, moe_act, mlp, moe, shared_experts (default: the "
                        "attention core and the MLP's activation; latent attention's up projections)")
    p.add_argument("--activation-offload-layers", "--activation_offload_layers", type=int, metavar="N",
                   help="the activations of up to N layers per stage kept in host memory between forward and "
                        "backward (Megatron's --cpu-offloading-num-layers; default 0)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON (atomically)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")


# How a block runs that changes its time and memory: what a profile's records ran with too.
BLOCK_OPTIONS = {
    "flash_attention": "fused attention, no s x s scores kept (default on)",
    "fused_softmax": "without flash attention: fused softmax, in-place backward (default on)",
    "softmax_in_fp32": "torch's softmax on an fp32 copy of the scores (default off)",
    "dropout": "hidden dropout on: its masks are kept for the backward (default off)",
    "attention_dropout": "dropout on the attention probabilities (default off)",
    "fused_norm": "fused RMSNorm kernel; off: torch ops, as Hugging Face's LlamaRMSNorm (a LayerNorm is torch's "
                  "kernel either way) (default on; --setup torchtitan, ddp, zero3 and memx-run: off)",
    "eager_block": "each block issued as eager PyTorch ops (Megatron-DeepSpeed, Hugging Face, torchtitan uncompiled): "
                   f"the host's time per layer is their count at {EAGER_OP_HOST_S * 1e6:g} us each, not a fused "
                   f"block's {FUSED_BLOCK_HOST_S * 1e3:g} ms; with --fp8/--fp4 its linears cast their own inputs "
                   "(default off; on in every --setup but megatron)",
}


def add_block_option_args(p: argparse.ArgumentParser) -> None:
    for name, text in BLOCK_OPTIONS.items():
        spellings = dict.fromkeys((f"--{name.replace('_', '-')}", f"--{name}"))  # "--dropout" once
        p.add_argument(*spellings, action=argparse.BooleanOptionalAction, default=None, help=text)


def training_from_args(args, model, defaults: TrainingSpec | None = None) -> TrainingSpec:
    base = defaults or TrainingSpec(seq_len=model.seq_len)
    def pick(name):
        value = getattr(args, name, None)
        return getattr(base, name) if value is None else value

    return TrainingSpec(global_batch_size=pick("global_batch_size"), seq_len=pick("seq_len"),
                        dtype=pick("dtype"), optimizer=pick("optimizer"), setup=pick("setup"),
                        **{name: pick(name) for name in RUN_FLAGS},
                        **{name: getattr(args, name, None) for name in SETUP_FLAGS})


# Flags of what is trained and where (fine-tuning, TF32, FP8, the optimizer's place, hybrid sharding's
# degree); no setup presets them.
RUN_FLAGS = ("tf32", "host_ms_per_layer", "frozen_fraction", "lora_rank", "fp8", "fp4", "fp8_params",
             "optimizer_offload", "activation_offload_layers", "expert_parallel", "expert_tensor_parallel",
             "expert_dispatcher", "expert_routing", "recompute_modules", "shard_degree")
# Flags that override one field of a --setup preset (None: the preset or the default decides).
SETUP_FLAGS = tuple(name for name in OPTION_DEFAULTS if name != "sharded_gradients")  # zero2 only: no flag


def add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile-db", "--profile_db", metavar="FILE",
                   help="use the learned predictor fitted on this profile database")
    p.add_argument("--memory-headroom", "--memory_headroom", type=float_flag, default=0.0, metavar="F",
                   help="share of every device's memory a plan must leave free (default 0; memx-run keeps "
                        "the memory monitor's 0.10)")


def check_headroom(args) -> None:
    if not 0 <= args.memory_headroom < 1:
        raise ConfigError("--memory-headroom", f"must be in [0, 1), got {args.memory_headroom}", "e.g. 0.1")


def check_new_file(path: str | None, flag: str, force: bool) -> None:
    """Refuse before any work is done, not after a long search."""
    if path is not None:
        check_output_path(path, flag, force)


def check_finite(value: float | None, flag: str) -> None:
    if value is not None and not math.isfinite(value):
        raise ConfigError(flag, f"must be a finite number, got {value}", "give a plain number")


def cost_model_from_args(args, model, cluster, training):
    if not getattr(args, "profile_db", None):
        return None
    if not os.path.exists(args.profile_db):
        raise ConfigError("--profile-db", f"{args.profile_db} does not exist", "run memx profile first")
    from memx_launch.profiling.predictor import load_cost_model

    return load_cost_model(args.profile_db, model, cluster, training)


def profile_cost_models(profile_db: str):
    """``cost_model_for(model, cluster, training)`` of ``memx estimate --cases``: every setup's
    cost model on the one profile DB, read and fitted at the first setup, not once per setup.
    A profile that cannot be read is each asking row's error."""
    from memx_launch.profiling.predictor import FittedProfile

    fitted = functools.cache(lambda: FittedProfile(profile_db))  # an error is not kept: the next row tries again
    return lambda model, cluster, training: fitted().cost_model(model, cluster, training)


def progress_from_args(args):
    if args.quiet:
        return None
    from memx_launch.planning.search import progress_to_stderr

    return progress_to_stderr


def model_from_args(args):
    """``--model`` (a catalog name or a config.json), with the flags that override a field of it
    given (the --cases columns of the same names: ``MODEL_COLUMNS``)."""
    from dataclasses import replace

    from memx_launch.planning.cases import MODEL_COLUMNS
    from memx_launch.specs.catalog import get_model

    return replace(get_model(args.model), **{name: getattr(args, name) for name in MODEL_COLUMNS
                                             if getattr(args, name) is not None})
