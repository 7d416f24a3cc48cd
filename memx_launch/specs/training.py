"""How it is trained: TrainingSpec (batch, sequence, precision, optimizer, state sharding and the
memory-relevant options of the framework). The named setups users run (``--setup``), presets of
its fields, and what each keeps per parameter: :mod:`memx_launch.specs.setups`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number, require_type
from memx_launch.specs.model import MAX_DIMENSION
from memx_launch.specs.setups import OPTION_DEFAULTS, SETUPS
from memx_launch.specs.training_checks import check_combinations


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

OPTIMIZERS = ("adam", "sgd")
# Transformer Engine's FP8 recipes: delayed scaling (scales from an amax history), current
# (per-tensor, just-in-time) scaling and MXFP8 (a scale per 32 elements, Blackwell); Megatron's
# --fp8-recipe delayed / tensorwise / mxfp8 / blockwise. Its FP4 recipe: NVFP4 (Megatron's --fp4-recipe nvfp4).
FP8_RECIPES = ("delayed", "current", "mxfp8", "blockwise")
# A mixture of experts' token dispatchers (Megatron's --moe-token-dispatcher-type alltoall / flex).
EXPERT_DISPATCHERS = ("alltoall", "flex")
# Balanced routing: random (Megatron's --moe-router-force-load-balancing), or token t to experts t*k.. (AutoModel's)
EXPERT_ROUTINGS = ("random", "consecutive")
FP4_RECIPES = ("nvfp4",)
# When a fully sharded run holds its weights gathered through a step (TrainingSpec.hold_gathered).
HOLD_GATHERED = ("never", "weights", "pipelined", "always")
FLASH_ATTENTION_VERSIONS = (1, 2, 3)
# What the selective recompute level runs again: Megatron's attention core, torchtitan's op-level
# policy (planning/op_checkpointing.py), or the whole block (memx-run's on a block it cannot see into).
SELECTIVE_POLICIES = ("attention", "op", "block")
# Megatron's --recompute-modules that memx prices (its selective level with them).
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "moe_act", "mlp", "moe", "shared_experts")


_PRECISIONS = ("fp32", "training")


@dataclass(frozen=True)
class TrainingSpec:
    global_batch_size: int = 512
    seq_len: int = 4096
    dtype: str = "bf16"
    optimizer: str = "adam"
    setup: str | None = None
    """A named preset of the fields below (see :data:`SETUPS`); explicit fields win."""
    distributed_optimizer: bool | None = None
    """Shard the master weights and optimizer state over DP ranks (Megatron's distributed optimizer, ZeRO-1)."""
    sharded_gradients: bool | None = None
    """Also shard the gradients (ZeRO-2: reduce-scatter into each rank's partition)."""
    fully_sharded: bool | None = None
    """Shard weights, gradients and optimizer state over data-parallel ranks (FSDP, ZeRO-3)."""
    fully_sharded_with_tp: bool | None = None
    """A layout with TP > 1 and DP > 1 runs fully sharded (memx-run: DDP cannot hold TP's DTensor
    parameters, so its FSDP2 shards them), and is priced so. Default off (``memx-run``: on)."""
    weights_dtype: str | None = None
    """"training" (16-bit weights, fp32 master copy in the optimizer) or "fp32" (fp32 weights
    computed in 16 bits by autocast or a mixed-precision policy: no separate master copy).
    Default: fp32 when fully sharded, else the training dtype."""
    grad_dtype: str | None = None
    """"fp32" (Megatron's main grads, FSDP's fp32 reduce) or "training" (DeepSpeed's bf16 grads). Default fp32."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism: the norm and dropout activations split over TP."""
    flash_attention: bool | None = None
    """Fused attention: no s x s score tensors kept. Default on (a device type without the
    kernel turns it off for its stages)."""
    flash_attention_version: int | None = None
    """Generation of the fused attention kernel (FlashAttention 1, 2 or 3): how fast it runs
    against the device's matmuls, slower for 1 and 2 on Hopper and later
    (:func:`~memx_launch.planning.costmodel.fused_attention_speed`). Memory is the same for all
    three. Default 2."""
    loss_dtype: str | None = None
    """"fp32" (logits cast to fp32 for the loss, Megatron's cross entropy) or "training"
    (logits and their gradient in the training dtype). Default fp32."""
    optimizer_dtype: str | None = None
    """"fp32" (Adam's master weights and moments, 12 bytes per trained parameter), "training" (all
    three in the training dtype, 6 bytes: Apex's DistributedFusedAdam with ``dtype: bf16``, which
    keeps a 16-bit remainder of each master weight; Megatron's precision-aware optimizer in bf16),
    "training_moments" (fp32 master weights, 16-bit moments, 8 bytes: NVIDIA's DeepSeek-V3 recipes;
    ``bf16-moments``) or "training_no_master" (16-bit weights updated in place, 16-bit moments, 4
    bytes: torch's Adam on bf16 parameters, NeMo AutoModel's MoEs; ``bf16-no-master``). Default fp32."""
    dropout: bool | None = None
    """Hidden dropout on (GPT style): a 1-byte mask after attention and after the MLP. Default off."""
    attention_dropout: bool | None = None
    """Dropout on the attention probabilities: without fused attention its mask and output
    (s x s each) are kept. Default off (OPT trains without it)."""
    overlap_grad_reduce: bool | None = None
    """The data-parallel gradient reduction runs during the last micro-batch's backward (DDP
    buckets, FSDP, ZeRO-3, Megatron's --overlap-grad-reduce); off: after it. Default off."""
    fused_norm: bool | None = None
    """Fused RMSNorm/LayerNorm kernel (keeps its 16-bit input). Off: torch ops (Hugging Face's
    LlamaRMSNorm) keep the fp32 copy of the input and the normalised tensor (4 + 2 bytes, not 2). Default on."""
    vocab_parallel_loss: bool | None = None
    """Megatron's vocab-parallel cross entropy: each TP rank keeps its 1/TP of the logits. Off (torch's
    cross entropy, Hugging Face models): every TP rank the whole vocabulary's logits and their log-softmax. Default on."""
    vocab_parallel_embedding: bool | None = None
    """The embedding and the output layer split over the vocabulary by TP (Megatron's, torchtitan's). Off: whole on
    every TP rank with their states, the head's GEMM whole and its logits not gathered (memx-run's). Default on."""
    torch_loss_parallel: bool | None = None
    """The vocab-parallel loss is torch's loss parallel (DTensor's ``loss_parallel()``, torchtitan's
    under TP): torch ops that keep their temporaries, 16 bytes per logit where Megatron's holds 8."""
    keep_stage_outputs: bool | None = None
    """The pipeline engine keeps each in-flight micro-batch's stage output until its gradient
    returns (DeepSpeed-style buffers, Aleph Alpha's scaling; torch's ``PipelineStage``, whose
    ``fwd_cache`` holds it for the backward: torchtitan, memx-run). Off: Megatron frees an
    output's data once sent (Korthikanti et al. 2022, appendix B). Default off."""
    keep_previous_logits: bool | None = None
    """The last stage writes each micro-batch's logits into one of two buffers and never empties them, so the
    previous micro-batch's are kept while the next one's loss runs (DeepSpeed-style buffers, scaling's). Default off."""
    torch_pipelining: bool | None = None
    """The pipeline runs on torch's own ``PipelineStage`` (torchtitan): each stage allocates once,
    and keeps for the job, a receive buffer per micro-batch and model chunk for its input (every
    stage but the first) and for its output's gradient (every stage but the last); memx-run's
    stages let each go after its micro-batch's backward. Default off (``torchtitan``: on)."""
    cp_all_gather: bool | None = None
    """Context parallelism as torch's ``context_parallel`` runs it (torchtitan): each attention pass
    all-gathers the CP group's K and V chunks at once and waits for them after its own chunk's
    attention; the backward sends dK and dV round the ring in fp32. Off: Transformer Engine's ring,
    one chunk a step behind the attention. Default off (``torchtitan``: on)."""
    repeat_kv: bool | None = None
    """The attention kernel receives K and V repeated to the query heads (torchtitan's LLaMA): it
    keeps them, and CP moves them, at the query width. Default off (``torchtitan``: on)."""
    checkpoint_early_stop: bool | None = None
    """Full recompute runs torch's non-reentrant checkpoint, which stops at the block's last saved
    tensor (``torch.utils.checkpoint``'s early stop, on by default: memx-run, torchtitan), the input
    of its last linear: that GEMM and the TP collective after it do not run again. Off: the whole
    forward again (Megatron's checkpoint, reentrant ones). Default off (torchtitan, ddp, memx-run: on)."""
    fused_softmax: bool | None = None
    """Without flash attention, the softmax runs as one fused kernel (Megatron's scaled masked softmax) whose
    backward works in place; off: torch's softmax, whose backward holds one more s x s tensor. Default on."""
    fused_gate_up: bool | None = None
    """SwiGLU's gate and up projections as one column-parallel linear (Megatron's linear_fc1):
    one all-reduce of their input gradient over TP in the backward, one 16-bit cast of the normed
    input kept under autocast. Off: two linears (Aleph Alpha's scaling, Hugging Face, memx-run),
    each all-reducing it: five TP all-reduces per layer instead of four. Default on."""
    fused_qkv: bool | None = None
    """The attention's q, k and v projections as one column-parallel linear (Megatron's
    linear_qkv; torchtitan's, whose TP plan prepares the attention's input once): one backward
    all-reduce of their input gradient over TP, one cast under autocast. Off: three linears that
    each do both (Hugging Face's blocks, memx-run's under DTensor's per-linear TP plan). Default on."""
    overlap_expert_comm: bool | None = None
    """A mixture's all-to-alls run while another micro-batch computes (Megatron's ``--overlap-moe-expert-parallel-comm``
    with ``--delay-wgrad-compute``): a block waits only for what they take beyond its compute. Default off."""
    transformers_blocks: bool | None = None
    """Blocks as Transformers writes them: a mixture's experts keep their down projections' outputs, in the weights'
    dtype (fp32 under autocast); views keep a fused q, k, v output whole. Default off (ddp, zero3, memx-run: on)."""
    fused_activation: bool | None = None
    """The MLP's activation runs as one kernel that keeps only its input for the backward (Megatron's
    ``bias_swiglu`` / ``bias_gelu`` fusions): SwiGLU's silu(gate) is recomputed there, not kept. Off: torch's
    ops (torchtitan, Hugging Face), which keep silu(gate) as well. Default off (``megatron``: on)."""
    softmax_in_fp32: bool | None = None
    """With torch's softmax (no flash attention, no fused softmax) on 16-bit scores, the softmax
    runs on an fp32 copy (Megatron's ``--attention-softmax-in-fp32``): the fp32 probabilities and
    their 16-bit copy are kept, 6 bytes per score instead of 2. Default off."""
    fused_loss: bool | None = None
    """The cross entropy runs as one kernel that computes the softmax in fp32 on the fly
    (flash-attn's ``CrossEntropyLoss``, MPT's default; Liger's; Megatron's
    ``--cross-entropy-loss-fusion``): only the 16-bit logits and their 16-bit gradient are held,
    2 x the training dtype per logit whatever ``loss_dtype`` says. Default off."""
    sp_keeps_gathered_input: bool | None = None
    """With sequence parallelism, the column-parallel linears keep their all-gathered (whole
    sequence) input for the backward, as when the norm gathers its output and autograd saves
    it. Off: Megatron keeps the 1/TP shard and gathers it again in the backward (Korthikanti's
    34/t). Default off."""
    tp_comm_overlap: bool | None = None
    """Megatron's ``--tp-comm-overlap`` (Transformer Engine's userbuffers, with sequence
    parallelism): each TP all-gather and reduce-scatter runs in TP chunks behind the linear GEMM
    it feeds or follows. Default off."""
    async_tp: bool | None = None
    """torch's AsyncTP (torchtitan's ``enable_async_tensor_parallel``, with sequence parallelism and
    compile): the first forward's TP all-gathers and reduce-scatters in chunks behind its GEMMs;
    the backward's and a recompute's stay whole. Default off."""
    partitioned_sends: bool | None = None
    """DeepSpeed's pipeline sends (``pipeline.pipe_partitioned`` and ``grad_partitioned``, on by
    default there with TP) and memx-run's: between stages of one TP degree each TP rank sends 1/TP
    of the stage's activation or gradient and the receiving stage all-gathers it over TP. Off:
    every TP rank sends the whole tensor to its peer. Default off (``memx-run``: on)."""
    partition_where_faster: bool | None = None
    """With ``partitioned_sends``: only the edges where a TP-th per rank and the receivers'
    all-gather are priced faster than whole sends are partitioned, the others sent whole, as the
    plan records per stage (``send_parts``) and memx-run sends. Off: every edge that can be, as
    DeepSpeed's engine does. Default off (``memx-run``: on)."""
    fp32_allreduce: bool | None = None
    """DeepSpeed's ``fp32_allreduce``, FSDP2's fp32 ``reduce_dtype`` over 16-bit weights: gradients
    reduced (and held, ``hold_gathered``) in fp32, 4 bytes each on the wire. Default off (``scaling``: on)."""
    full_gradient_allreduce: bool | None = None
    """A sharded optimizer all-reduces the whole gradients over DP (every rank receives all of
    them and updates its shard) instead of reduce-scattering them: twice the gradient traffic
    (Aleph Alpha's scaling, ``core/optimizer/allreduce.py``). Default off (``scaling``: on)."""
    ddp_bucket_copy: bool | None = None
    """torch's DDP without ``gradient_as_bucket_view`` (its default, Accelerate's, Lightning's): each gradient
    copied into DDP's buckets, a second copy on each replica (with more than one). Default off (``ddp``: on)."""
    grad_accumulation_pass: bool | None = None
    """Each micro-batch after a step's first adds its gradients into the held ones in a pass of its
    own (torch's ``AccumulateGrad``; Megatron's fuses it into the GEMM). Default off (ddp, memx-run: on)."""
    zero_grad_after_forward: bool | None = None
    """The last step's gradients freed after the forward (Lightning's closure: zero_grad between training_step
    and backward): the forward's peak holds them, none left out (planning/lazy_gradients.py). Default off."""
    foreach_optimizer: bool | None = None
    """Adam steps all of a rank's parameters at once, DTensor ones too (torch's Adam and AdamW on a GPU by default,
    ``foreach``): a temporary of one moment each beside the gradients (planning/optimizer_peak.py). Off: fused
    kernels (Apex, Transformer Engine, DeepSpeed, ``fused=True``), a for-loop. Default off (ddp, memx-run: on)."""
    autocast_per_step: bool | None = None
    """torch.autocast's region spans the step's micro-batches (memx-run's): each fp32 weight cast once a
    step, read from its cache after; off, cast every micro-batch (Accelerate, Lightning). Default off (memx-run: on)."""
    eager_block: bool | None = None
    """Each block issued as eager PyTorch ops (Megatron-DeepSpeed, Hugging Face, torchtitan uncompiled): its host time
    is their count at 14 us each, not a fused block's 40 launches of 5 us. Default off (every setup but megatron: on)."""
    overlap_p2p_comm: bool | None = None
    """An interleaved pipeline's sends run while the stage computes its next chunk (Megatron-LM's
    ``--overlap-p2p-communication``, its default since 2023; torch's ``ScheduleInterleaved1F1B``).
    Off: each send blocks, as plain 1F1B's do. Default on."""
    hold_gathered: str | None = None
    """What a fully sharded run keeps gathered: ``never`` (ZeRO-3, Megatron-FSDP: each layer every micro-batch),
    ``weights`` (from a micro-batch's forward to its backward: FSDP2's ``reshard_after_forward=False``),
    ``pipelined`` (weights and unsharded gradients from a step's first micro-batch to its last on a pipeline's
    stages, reduced after the last backward: FSDP2 under torch's pipelining) or ``always`` (one stage too:
    memx-run). Default pipelined (``zero3``: never)."""
    max_live_params: float | None = None
    """A fully sharded run fetches its weights as DeepSpeed ZeRO-3 does: one all-gather per linear, up to this
    many parameters gathered at once (``stage3_max_live_parameters``), its module hooks' host time. 0: FSDP's units."""
    reduce_bucket_params: float | None = None
    """Such a run's gradient buckets (DeepSpeed's ``reduce_bucket_size``): a reduce-scatter per bucket. Default 5e8."""
    prefetch_bucket_params: float | None = None  # its prefetch (stage3_prefetch_bucket_size): 5e7
    hpz_partition_size: int | None = None  # ZeRO++'s hpZ: a second weight shard over N ranks, for the backward
    quantized_weights: bool | None = None  # ZeRO++'s qwZ: each fetch all-gathers int8 weights, then their fp32 scales
    shard_degree: int | None = None
    """Hybrid sharding (HSDP, DeepSpeed's MiCS, Megatron's partial distributed optimizer): what the setup
    shards spread over N consecutive ranks of each DP group (x CP), the DP / N groups replicas. None: all."""
    selective_recompute: str | None = None
    """What the selective recompute level runs again: ``attention`` (Megatron's ``--recompute-granularity
    selective``: the attention core and the MLP's activation), ``op`` (torchtitan's op-level policy:
    everything but the fused attention kernel's output and every other matmul's) or ``block`` (the whole
    block, as full recompute: memx-run's on a block whose attention core it cannot reach, read off
    the block: models/block_reading.py). Default attention."""
    recompute_modules: tuple[str, ...] | None = None
    """What the selective level runs again, in Megatron's words (``--recompute-modules``, NVIDIA's
    MoE recipes): ``core_attn`` (the attention core), ``mla_up_proj`` (latent attention's up
    projections), ``layernorm`` (the norms, whose 16-bit outputs the linears then do not keep),
    ``moe_act`` (the routed experts' activation), ``mlp`` (a dense MLP), ``moe`` (a mixture of
    experts' whole MLP: router, exchanges, experts) and ``shared_experts`` (its shared expert). A
    module the block lacks recomputes nothing. None: ``selective_recompute``'s (with latent attention,
    ``mla_up_proj``)."""
    tf32: bool = False
    """fp32 training's matmuls run as TF32 on NVIDIA Ampere and later (NGC containers turn it
    on; PyTorch's ``torch.backends.cuda.matmul.allow_tf32``): at the TF32 peak, half the dense
    16-bit ``peak_tflops``, instead of ``peak_tflops_fp32``. Other devices ignore it."""
    host_ms_per_layer: float | None = None
    """Host time in ms the framework takes to issue one layer's forward and backward on an
    accelerator: no layer takes less (the device runs behind the host). Unset: the device type's,
    else ``eager_block``'s count (planning/host_time.py); a MoE layer's ops scale with it."""
    frozen_fraction: float = 0.0
    """Fine-tuning: the share of the model's parameters that is frozen (no gradients, no
    optimizer states, no weight-gradient GEMMs; their weights are still kept, gathered and
    all-gathered by a fully sharded run)."""
    lora_rank: int = 0
    """LoRA adapters of this rank on every linear of each block (PEFT's ``all-linear``):
    r x (inputs + outputs) trained parameters per linear, with their gradients and optimizer
    states; the base weights they adapt are frozen (``frozen_fraction`` 1 unless given)."""
    fp8: str | None = None
    """FP8 training of the blocks' linear layers (Transformer Engine, 16-bit everywhere else):
    ``delayed`` or ``current`` per-tensor scaling, ``mxfp8`` (a scale per 32 elements;
    Blackwell) or ``blockwise`` (DeepSeek-V3's: an fp32 scale per 128 elements of an input or
    gradient, per 128 x 128 of a weight; Megatron's ``--fp8-recipe blockwise``). Their GEMMs run at the FP8 peak; each linear keeps its input for the backward in
    FP8 and FP8 copies of its weight (and its transpose); delayed scaling also keeps an amax
    history per tensor. None: off."""
    fp4: str | None = None
    """FP4 training of the blocks' linear layers: ``nvfp4`` (Transformer Engine's NVFP4 recipe,
    Megatron's ``--fp4-recipe nvfp4``; Blackwell): their three GEMMs run at the FP4 peak, each
    linear keeps its input in NVFP4 and NVFP4 copies of its weight. None: off."""
    fp8_params: bool = False
    """With ``fp8``: the blocks' linear weights are kept in FP8 only (Megatron's
    ``--fp8-param-gather``, NeMo's ``fp8_params``, Transformer Engine's ``fp8_model_init``): no
    16-bit copy beside the FP8 weight and its transpose, and the updated weights are all-gathered
    over DP in one byte. The optimizer's fp32 master weights stay."""
    fp8_weight_cache: bool | None = None
    """With ``fp8``/``fp4``: each linear keeps its quantized weight copies between micro-batches
    (Transformer Engine). Off: torchao's Float8Linear (torchtitan) casts the weight at each GEMM,
    the copies living while their layer runs (its saved cast is not counted). Default on."""
    optimizer_offload: bool = False
    """The optimizer runs on the host (DeepSpeed ZeRO-Offload, ``offload_optimizer: cpu``): master
    weights and moments leave the GPU; each step the gradients go to the host and the updated
    weights come back over PCIe, and the host runs Adam."""
    expert_parallel: int = 1
    """Expert parallelism of a mixture-of-experts model (Megatron's ``--expert-model-parallel-size``):
    each block's routed experts are split over this many ranks of a stage's TP x CP x DP ranks
    (with ``expert_tensor_parallel``, EP x ETP must divide them), which exchange their tokens by
    all-to-all; the experts' gradients and optimizer states are sharded over the rest of those
    ranks. ``memx plan`` without it searches the degree (``SearchSpace.expert_degrees``). 1: every
    rank holds every expert."""
    expert_tensor_parallel: int = 1
    """Expert tensor parallelism (Megatron's ``--expert-tensor-parallel-size``): each routed expert's
    MLP split over this many ranks, which gather their dispatched tokens before it and
    reduce-scatter its output after. 1: each expert whole on its rank."""
    expert_dispatcher: str = "alltoall"
    """How a mixture of experts' tokens reach their experts' ranks: ``alltoall`` (Megatron's
    all-to-all dispatcher: every routed copy of a token sent) or ``flex`` (Megatron's flex
    dispatcher, DeepEP or HybridEP: a token sent once to each rank holding one of its experts,
    and beyond an NVLink domain once to each node, which forwards it inside)."""
    expert_routing: str = "random"
    """Which experts balanced routing sends a token to, which decides how many ranks and nodes the
    flex dispatcher sends it to: ``random`` (top-k drawn among the experts, within the groups a
    token may use: Megatron's forced load balancing, and what a trained router's spread is taken
    as) or ``consecutive`` (token t to experts t*k to t*k + k - 1: NeMo AutoModel's
    ``fake_balanced_gate``, whose k experts sit on one or two ranks)."""
    activation_offload_layers: int = 0
    """Activation offloading (Megatron's ``--cpu-offloading-num-layers`` with activations, NeMo's
    ``cpu_offloading_num_layers``): the kept activations of up to this many of each stage's
    layers (its first ones; never its last, whose backward starts at once) go to host memory
    after their forward and come back before their backward, over the device type's
    ``host_link_gbps`` behind the neighbouring layers' compute. 0: none."""

    def __post_init__(self):
        require_number(self.global_batch_size, "--global-batch-size", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        require_number(self.seq_len, "--seq-len", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("--dtype", f"unknown dtype {self.dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("--optimizer", f"unknown optimizer {self.optimizer!r}",
                              f"use one of {', '.join(OPTIMIZERS)}")
        if self.setup is not None and self.setup not in SETUPS:
            raise ConfigError("--setup", f"unknown setup {self.setup!r}", f"use one of {', '.join(SETUPS)}")
        preset = SETUPS.get(self.setup, {})
        if self.fp8_weight_cache is False and self.quantized_linears is None and preset.get("fp8_weight_cache", True):
            raise ConfigError("--no-fp8-weight-cache", "says how quantized linears keep their weights, and the run "
                              "has none", "add --fp8 current (or another recipe), or drop the flag")
        for name, default in OPTION_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, preset.get(name, default))
        no_master = self.optimizer_dtype in ("bf16-no-master", "fp16-no-master", "training_no_master")
        if no_master and self.weights_dtype == "fp32":
            raise ConfigError("--optimizer-dtype", f"{self.optimizer_dtype} updates 16-bit weights, and weights_dtype "
                              "is fp32", "drop weights_dtype, or use bf16-moments")
        if self.weights_dtype is None:  # without a master copy the weights are the 16-bit ones it updates
            object.__setattr__(self, "weights_dtype", "training" if no_master else
                               preset.get("weights_dtype", "fp32" if self.fully_sharded else "training"))
        for name in ("weights_dtype", "grad_dtype", "loss_dtype", "optimizer_dtype"):
            value = getattr(self, name)
            if value in ("bf16", "fp16"):  # a 16-bit name means the training dtype
                object.__setattr__(self, name, "training")
            elif name == "optimizer_dtype" and value in ("bf16-moments", "fp16-moments", "training_moments"):
                object.__setattr__(self, name, "training_moments")
            elif name == "optimizer_dtype" and no_master:
                object.__setattr__(self, name, "training_no_master")
            elif value not in _PRECISIONS:
                raise ConfigError(f"--{name.replace('_', '-')}", f"unknown precision {value!r}",
                                  "use fp32 or the training dtype")
        if isinstance(self.flash_attention_version, bool) or self.flash_attention_version not in FLASH_ATTENTION_VERSIONS:
            raise ConfigError("--flash-attention-version", f"unknown version {self.flash_attention_version!r}",
                              f"use one of {', '.join(map(str, FLASH_ATTENTION_VERSIONS))}")
        if self.recompute_modules is not None:
            modules = self.recompute_modules
            modules = tuple(modules.replace(",", " ").split()) if isinstance(modules, str) else tuple(modules)
            unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
            if unknown or not modules:
                raise ConfigError("--recompute-modules", f"unknown module {unknown[0] if unknown else ''!r}",
                                  f"use some of {', '.join(RECOMPUTE_MODULES)}, separated by commas or spaces")
            object.__setattr__(self, "recompute_modules", modules)
            if self.selective_recompute == "op":
                raise ConfigError("--recompute-modules", "with --selective-recompute op, torchtitan's policy",
                                  "drop one of them")
        if self.selective_recompute not in SELECTIVE_POLICIES:
            raise ConfigError("--selective-recompute", f"unknown policy {self.selective_recompute!r}",
                              f"use one of {', '.join(SELECTIVE_POLICIES)}")
        require_type(self.tf32, bool, "--tf32", "true or false")
        if self.host_ms_per_layer is not None:
            require_number(self.host_ms_per_layer, "--host-ms-per-layer", lo=0, lo_open=True, hi=1000.0,
                           fix="give the milliseconds one layer's forward and backward take to issue, e.g. 3")
        require_type(self.optimizer_offload, bool, "--optimizer-offload", "true or false")
        require_number(self.expert_parallel, "--expert-parallel", lo=1, hi=MAX_DIMENSION, integer=True,
                       fix="give the ranks each block's experts are split over, e.g. 8")
        require_number(self.expert_tensor_parallel, "--expert-tensor-parallel", lo=1, hi=MAX_DIMENSION, integer=True,
                       fix="give the ranks each routed expert's MLP is split over, e.g. 4")
        if self.expert_dispatcher not in EXPERT_DISPATCHERS:
            raise ConfigError("--expert-dispatcher", f"unknown dispatcher {self.expert_dispatcher!r}",
                              f"use one of {', '.join(EXPERT_DISPATCHERS)}")
        if self.expert_routing not in EXPERT_ROUTINGS:
            raise ConfigError("--expert-routing", f"unknown routing {self.expert_routing!r}",
                              f"use one of {', '.join(EXPERT_ROUTINGS)}")
        if self.hold_gathered not in HOLD_GATHERED:
            raise ConfigError("--hold-gathered", f"unknown value {self.hold_gathered!r}",
                              f"use one of {', '.join(HOLD_GATHERED)}")
        require_number(self.max_live_params, "--max-live-params", lo=0, hi=10**12,
                       fix="give DeepSpeed's stage3_max_live_parameters, e.g. 1e9 (0: one gather per block)")
        require_number(self.reduce_bucket_params, "--reduce-bucket-params", lo=0, lo_open=True, hi=10**12,
                       fix="give DeepSpeed's reduce_bucket_size in parameters, e.g. 5e8")
        require_number(self.prefetch_bucket_params, "--prefetch-bucket-params", lo=0, lo_open=True, hi=10**12,
                       fix="give DeepSpeed's stage3_prefetch_bucket_size in parameters, e.g. 5e7")
        require_number(self.hpz_partition_size, "--hpz-partition-size", lo=1, hi=MAX_DIMENSION, integer=True,
                       fix="give the ranks of a node, e.g. 8 (1: no secondary shard)")
        require_number(self.activation_offload_layers, "--activation-offload-layers", lo=0, hi=MAX_DIMENSION,
                       integer=True, fix="give how many layers per stage keep their activations on the host, e.g. 8")
        for flag, recipe, recipes in (("--fp8", self.fp8, FP8_RECIPES), ("--fp4", self.fp4, FP4_RECIPES)):
            if recipe is None:
                continue
            if recipe not in recipes:
                raise ConfigError(flag, f"unknown recipe {recipe!r}", f"use one of {', '.join(recipes)}")
            if self.dtype == "fp32":
                raise ConfigError(flag, f"{flag[2:].upper()} linears run inside 16-bit training, not fp32",
                                  "use --dtype bf16")
        if self.fp8 is not None and self.fp4 is not None:
            raise ConfigError("--fp4", "the linears run in FP8 or in FP4, not both", "drop --fp8 or --fp4")
        require_type(self.fp8_params, bool, "--fp8-params", "true or false")
        if self.fp8_params and self.fp8 is None:
            raise ConfigError("--fp8-params", "keeps the weights of FP8 linears, and the run has none",
                              "add --fp8 current (or delayed, mxfp8, blockwise)")
        require_number(self.lora_rank, "--lora-rank", lo=0, hi=MAX_DIMENSION, integer=True)
        require_number(self.frozen_fraction, "--frozen-fraction", lo=0, hi=1,
                       fix="give the share of parameters frozen, e.g. 0.5")
        if self.lora_rank and self.frozen_fraction != 1.0:
            if self.frozen_fraction:
                raise ConfigError("--frozen-fraction", f"{self.frozen_fraction} with LoRA adapters, whose base "
                                  "weights are all frozen", "drop --frozen-fraction (LoRA freezes the base)")
            object.__setattr__(self, "frozen_fraction", 1.0)
        check_combinations(self)

    @property
    def quantized_linears(self) -> str | None:
        """The recipe of the blocks' quantized linears (``fp8``'s or ``fp4``'s), None without."""
        return self.fp8 or self.fp4

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def autocast(self) -> bool:
        """16-bit compute by ``torch.autocast`` over fp32 weights (``weights_dtype`` fp32, not fully
        sharded: DDP, memx-run; a fully sharded run gathers its weights in 16 bits instead)."""
        return self.weights_dtype == "fp32" and not self.fully_sharded and self.dtype_bytes < 4

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the hidden state between blocks and stages: fp32 under autocast,
        where the embedding and the residual adds keep the weights' precision, else the training dtype."""
        return 4 if self.autocast else self.dtype_bytes

    def precision_bytes(self, name: str) -> int:
        """Bytes per element of ``weights_dtype``, ``grad_dtype`` or ``loss_dtype``."""
        return 4 if getattr(self, name) == "fp32" else self.dtype_bytes

    def plan_fields(self) -> dict:
        """What a plan records of the run (every field but the batch and sequence length)."""
        return {k: v for k, v in asdict(self).items() if k not in ("global_batch_size", "seq_len")}


PLAN_TRAINING_KEYS = tuple(f.name for f in fields(TrainingSpec) if f.name not in ("global_batch_size", "seq_len"))
