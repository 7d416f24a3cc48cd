"""What each framework keeps, as presets of the training spec's options (``--setup NAME``), and
what an option takes when neither the run nor its setup sets it. docs/setups.md says why.

A setup is a preset of the explicit fields; a field given explicitly wins over the preset.
What each setup keeps per parameter (Adam, 16-bit training; Megatron's
``theoretical_memory_usage.py`` and the ZeRO paper, Rajbhandari et al. 2020):

=========  =======================================================  =====================
setup      weights / grads / master + moments                       bytes per parameter
=========  =======================================================  =====================
megatron   bf16 / fp32 main grads / fp32, sharded over DP (dist.    6 + 12/DP
           optimizer); sequence parallel on when TP > 1
zero1      bf16 / bf16 / fp32 sharded (DeepSpeed ZeRO-1)            4 + 12/DP
zero2      bf16 / bf16 sharded / fp32 sharded (ZeRO-2)              2 + 14/DP
zero3      all sharded (ZeRO-3)                                     16/DP
fsdp2      fp32 sharded params, bf16 compute, fp32 reduce (torch-   16/DP (+ 6 held on
           titan MixedPrecisionPolicy)                              a pipeline's stages)
ddp        fp32 params under autocast, fp32 grads, fp32 moments     16
scaling    as zero1, in Aleph Alpha's Megatron-derived codebase      4 + 12/DP
           (Hagemann et al. 2023; its options below)
=========  =======================================================  =====================

No setup keeps the defaults memx always had: 16-bit weights, fp32 grads, fp32 master and
moments, nothing sharded unless ``distributed_optimizer`` / ``fully_sharded`` say so.
"""

from __future__ import annotations

SETUPS: dict[str, dict] = {
    "megatron": dict(distributed_optimizer=True, weights_dtype="training", grad_dtype="fp32",
                     sequence_parallel=True, flash_attention=True, loss_dtype="fp32",
                     vocab_parallel_loss=True, overlap_grad_reduce=True, fused_activation=True),
    "zero1": dict(distributed_optimizer=True, weights_dtype="training", grad_dtype="training",
                  vocab_parallel_loss=False, eager_block=True),
    "zero2": dict(distributed_optimizer=True, sharded_gradients=True, weights_dtype="training",
                  grad_dtype="training", vocab_parallel_loss=False, eager_block=True),
    # zero3: DeepSpeed ZeRO-3 over a Hugging Face model (q, k, v and gate, up separate linears, RMSNorms
    # of torch ops, its blocks as Transformers writes them), each linear's weights fetched by an all-gather
    # of its own, up to its default live budget gathered.
    "zero3": dict(fully_sharded=True, weights_dtype="training", grad_dtype="training",
                  vocab_parallel_loss=False, overlap_grad_reduce=True, hold_gathered="never", eager_block=True,
                  max_live_params=1e9, fused_qkv=False, fused_gate_up=False, fused_norm=False,
                  transformers_blocks=True),
    "fsdp2": dict(fully_sharded=True, weights_dtype="fp32", grad_dtype="fp32", vocab_parallel_loss=False,
                  overlap_grad_reduce=True, hold_gathered="pipelined", eager_block=True),
    # ddp: torch's DDP over a Hugging Face model under autocast (Accelerate, Lightning's "-mixed"),
    # its q, k, v and gate, up projections separate linears and its RMSNorms torch ops (LlamaRMSNorm),
    # checkpointed without reentrance (transformers' default since its activation_checkpointing_enable),
    # its blocks as Transformers writes them, torch's AdamW stepping foreach.
    "ddp": dict(weights_dtype="fp32", grad_dtype="fp32", vocab_parallel_loss=False, overlap_grad_reduce=True,
                ddp_bucket_copy=True, eager_block=True, fused_qkv=False, fused_gate_up=False, fused_norm=False,
                checkpoint_early_stop=True, grad_accumulation_pass=True, foreach_optimizer=True,
                transformers_blocks=True),
    # torchtitan: fsdp2 with its TP plan (sequence-parallel norms whose gathered output the linears
    # keep, the loss on vocabulary shards in torch's ops), op-level selective checkpointing,
    # torchao's FP8 linears, which cast their weights at each GEMM, without torch.compile (its
    # default) blocks and RMSNorms of eager ops, torch's pipeline stages and its non-reentrant checkpoint,
    # torch's context_parallel, K and V repeated to the query heads before SDPA (its LLaMA's repeat_kv).
    "torchtitan": dict(fully_sharded=True, weights_dtype="fp32", grad_dtype="fp32", sequence_parallel=True,
                       sp_keeps_gathered_input=True, vocab_parallel_loss=True, torch_loss_parallel=True,
                       overlap_grad_reduce=True, hold_gathered="pipelined", eager_block=True, fused_norm=False,
                       selective_recompute="op", fp8_weight_cache=False, keep_stage_outputs=True,
                       torch_pipelining=True, checkpoint_early_stop=True, cp_all_gather=True, repeat_kv=True),
    # github.com/Aleph-Alpha/scaling: a ZeRO-1 optimizer over bf16 weights and grads; the LM head
    # all-gathers its logits (ColumnParallelLinear, parallel_output=False) for torch's cross
    # entropy; its pipeline buffers keep each stage output until its gradient returns, and on the
    # last stage the previous micro-batch's logits; its RMSNorm all-gathers the sequence-parallel
    # output, which the next linear then keeps whole; its SwiGLU has separate gate and up linears;
    # its optimizer all-reduces the whole gradients over DP, cast to fp32, after the backward; its
    # blocks run as eager ops.
    "scaling": dict(distributed_optimizer=True, weights_dtype="training", grad_dtype="training",
                    vocab_parallel_loss=False, keep_stage_outputs=True, keep_previous_logits=True,
                    sp_keeps_gathered_input=True,
                    fused_gate_up=False, fp32_allreduce=True, full_gradient_allreduce=True, eager_block=True),
    # memx-run: what its runtime does (runtime/precision.py, training.py, pipeline_stage.py): fp32 weights
    # and grads under autocast (one region over the step), torch's loss, DDP with its copy of the gradients
    # (FSDP2 fully sharded or with TP > 1 and DP > 1, a stage's gathered weights and unsharded gradients held
    # through the step), torch's pipeline
    # stages keeping their in-flight outputs and sending a TP-th of each boundary tensor between stages of
    # one TP degree where that is faster, its blocks of eager ops with q, k, v and gate, up apart and
    # torch-op RMSNorms (Hugging Face's; torch's nn.RMSNorm off CUDA), checkpointed without reentrance,
    # Transformers' blocks as Transformers writes them, torch's AdamW stepping foreach (DTensors too); TP splits
    # the blocks alone (models/adapters.py), the embedding and the head whole on every TP rank.
    "memx-run": dict(weights_dtype="fp32", grad_dtype="fp32", vocab_parallel_loss=False, vocab_parallel_embedding=False,
                     ddp_bucket_copy=True,
                     fully_sharded_with_tp=True, partitioned_sends=True, partition_where_faster=True,
                     hold_gathered="always", eager_block=True, fused_qkv=False, fused_gate_up=False, fused_norm=False,
                     checkpoint_early_stop=True, keep_stage_outputs=True, grad_accumulation_pass=True,
                     autocast_per_step=True, foreach_optimizer=True, transformers_blocks=True),
}
"""Explicit field values of each named setup ("training" = the training dtype)."""


# What an option left unset (None) takes when the setup does not set it either.
OPTION_DEFAULTS = dict(distributed_optimizer=False, sharded_gradients=False, fully_sharded=False,
                       fully_sharded_with_tp=False,
                       grad_dtype="fp32", sequence_parallel=False, flash_attention=True, flash_attention_version=2,
                       loss_dtype="fp32", optimizer_dtype="fp32", dropout=False, attention_dropout=False,
                       fused_norm=True, overlap_grad_reduce=False, vocab_parallel_loss=True,
                       vocab_parallel_embedding=True, torch_loss_parallel=False,
                       keep_stage_outputs=False, keep_previous_logits=False, torch_pipelining=False,
                       checkpoint_early_stop=False,
                       sp_keeps_gathered_input=False,
                       fused_softmax=True, softmax_in_fp32=False, fused_gate_up=True, fused_qkv=True, fused_loss=False,
                       tp_comm_overlap=False, async_tp=False, partitioned_sends=False, partition_where_faster=False,
                       fp32_allreduce=False,
                       full_gradient_allreduce=False, fused_activation=False, overlap_expert_comm=False,
                       selective_recompute="attention", ddp_bucket_copy=False, grad_accumulation_pass=False,
                       zero_grad_after_forward=False, foreach_optimizer=False, transformers_blocks=False,
                       autocast_per_step=False,
                       cp_all_gather=False, repeat_kv=False, overlap_p2p_comm=True, hold_gathered="pipelined",
                       max_live_params=0.0, reduce_bucket_params=5e8, prefetch_bucket_params=5e7, hpz_partition_size=1,
                       quantized_weights=False, eager_block=False, fp8_weight_cache=True)
