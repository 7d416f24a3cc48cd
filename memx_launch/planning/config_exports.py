"""A plan as other frameworks' config files: torchtitan's job TOML and DeepSpeed's JSON (which
accelerate takes). Pure functions of a :class:`~memx_launch.planning.plan.Plan`, no torch.

Like the Megatron-LM arguments (:mod:`~memx_launch.planning.exporters`), what the target cannot
express comes back as notes beside the file, never dropped silently; a plan the target cannot run
at all (per-stage TP; PP or TP in a DeepSpeed config; groups across communication domains) is a
one-line refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from memx_launch.errors import ConfigError
from memx_launch.planning.layer_split import chunk_layers
from memx_launch.planning.model_states import keeps_gathered
from memx_launch.planning.plan import RECOMPUTE_LEVELS, Plan, parse_recompute
from memx_launch.specs.setups import OPTION_DEFAULTS
from memx_launch.specs.training import TrainingSpec

TORCHTITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B"}


@dataclass
class ConfigText:
    """A config file's text plus what it could not say."""

    text: str
    notes: list[str] = field(default_factory=list)


def _strongest_recompute(plan: Plan, target: str) -> tuple[str, list[str]]:
    """One recompute level for every stage, the strongest any stage needs (memory-safe)."""
    levels = ["full" if s.recompute.startswith("full:") else s.recompute for s in plan.stages]
    strongest = max(levels, key=RECOMPUTE_LEVELS.index)
    notes = []
    if len({s.recompute for s in plan.stages}) > 1:
        notes.append("per-stage recompute (" + ", ".join(f"stage {i}: {s.recompute}" for i, s in
                     enumerate(plan.stages)) + f") cannot be expressed in {target}, which applies one mode to "
                     f"every layer; this uses '{strongest}': memory-safe, but slower than the plan predicts")
    return strongest, notes


def _precision_notes(plan: Plan, target: str) -> list[str]:
    """What the plan's FP8 or FP4 linears, FP8 weights, 16-bit optimizer states and offloaded
    activations need in ``target``, whose config file this writes does not set them."""
    tr, notes = plan.training, []
    if tr.get("fp8") or tr.get("fp4"):
        kind, flag = ("FP8", f"--fp8 {tr['fp8']}") if tr.get("fp8") else ("FP4", f"--fp4 {tr['fp4']}")
        quantized = f"the plan's linears run in {kind} ({flag}"
        quantized += ", weights kept in FP8)" if tr.get("fp8_params") else ")"
        float8 = "Float8 linears (tensorwise scaling; its FSDP float8 all-gather for FP8 weights)"
        titan = {"delayed": float8, "current": float8, "mxfp8": "MX linears (mxfp8, Blackwell)"}.get(tr.get("fp8"))
        notes.append(quantized + (f": turn on torchtitan's {titan}"
                                  if target == "torchtitan" and titan else
                                  f": {target}'s config does not; swap the model's linears for Transformer Engine's"))
        if target == "torchtitan" and tr.get("fp8_weight_cache", True):
            notes.append("torchtitan's float8 linears cast their weights at each GEMM and keep no copies between "
                         "micro-batches, which the plan counted: plan with --setup torchtitan (or "
                         "--no-fp8-weight-cache) to predict it")
    if plan.model_spec.mtp_layers:
        notes.append(f"the plan counts {plan.model_spec.mtp_layers} multi-token prediction module(s) on the last "
                     f"stage: build them in {target}'s model, or plan the model without them")
    if plan.model_spec.num_experts and tr.get("expert_parallel", 1) * tr.get("expert_tensor_parallel", 1) > 1:
        notes.append(f"the plan splits the experts over {tr.get('expert_parallel', 1)} expert-parallel ranks, each "
                     f"expert over {tr.get('expert_tensor_parallel', 1)}, with the all-to-all dispatcher: set "
                     f"{target}'s expert parallelism so")
    if tr.get("activation_offload_layers"):
        notes.append(f"the plan keeps {tr['activation_offload_layers']} layers' activations per stage on the host; "
                     f"{target}'s config does not: more memory than planned")
    if tr.get("optimizer_dtype") in ("training", "training_moments", "training_no_master"):
        kept = {"training": "master weights and moments", "training_moments": "moments",
                "training_no_master": "moments without master weights"}[tr["optimizer_dtype"]]
        notes.append(f"the plan keeps Adam's {kept} in 16 bits; {target}'s optimizer keeps "
                     "them in fp32: more memory than planned")
    return notes


def torchtitan_split_points(plan: Plan) -> list[str]:
    """``parallelism.pipeline_parallel_split_points``: the first layer of every (virtual) stage but
    the first. Chunks follow in model order virtual-stage major, chunk k on pipeline rank k mod pp
    (torchtitan's looped schedules, Megatron's layout): a stage's chunks are not adjacent layers."""
    per_stage = chunk_layers([s.num_layers for s in plan.stages], plan.virtual_stages).tolist()
    sizes = [per_stage[pp_rank][vpp] for vpp in range(plan.virtual_stages) for pp_rank in range(plan.pp)]
    return [f"layers.{sum(sizes[:k])}" for k in range(1, len(sizes))]


def torchtitan_toml(plan: Plan) -> ConfigText:
    """The plan as torchtitan's job config (``[training]``, ``[parallelism]``,
    ``[activation_checkpoint]``; each key is also its ``--section.key`` flag)."""
    tp = plan.uniform_tp("torchtitan (one tensor_parallel_degree for all stages)")
    plan.uniform_dp("torchtitan (one data-parallel degree for all stages)")
    plan.within_one_domain("torchtitan")
    tr = plan.training
    if plan.model_spec.hybrid_pattern:
        raise ConfigError("plan", f"{plan.model} is a hybrid model (Mamba or Gated DeltaNet layers), which torchtitan "
                          "does not build", "export to Megatron-LM (memx export)")
    for field in ("expert_parallel", "expert_tensor_parallel"):
        if tr.get(field, 1) > 1:
            raise ConfigError("plan", f"{field}={tr[field]}: torchtitan carves expert parallelism out of its FSDP "
                              "ranks, which memx does not model with experts", "export to Megatron-LM")
    notes = [f"set [model] name and flavor to {plan.model}'s (torchtitan names its models; memx planned "
             f"{plan.model_spec.num_layers} layers of hidden size {plan.model_spec.hidden_size})"]
    dtype = tr.get("dtype", "bf16")
    if dtype == "fp16":
        notes.append("torchtitan has no fp16 training: mixed_precision_param is bfloat16, which the plan did "
                     "not time")
    sharded = bool(tr.get("fully_sharded"))
    if tr.get("distributed_optimizer") and not sharded:
        notes.append("torchtitan has no sharded-optimizer-only mode (ZeRO-1): this runs DDP, whose whole "
                     "optimizer state per rank is more memory than the plan's")
    level, recompute_notes = _strongest_recompute(plan, "torchtitan")
    notes += recompute_notes + _precision_notes(plan, "torchtitan")
    if level == "selective" and tr.get("selective_recompute") != "op":
        notes.append("selective maps to torchtitan's op-level SAC (selective_ac_option = \"op\"), which keeps "
                     "less and recomputes more than the planned attention-core recompute: plan with "
                     "--selective-recompute op to predict it")
    spec = TrainingSpec(**tr)
    shard = spec.shard_degree or plan.dp  # HSDP: torchtitan's replicate x shard mesh
    if sharded and plan.dp > 1 and keeps_gathered(spec, plan.pp) != (plan.pp > 1):
        notes.append("torchtitan holds a fully sharded stage's gathered weights and unsharded gradients through "
                     f"the step under PP only (its pipeline schedules), which the plan's "
                     f"hold_gathered={spec.hold_gathered} does not say: plan with --hold-gathered pipelined to "
                     "predict it")
    if tp > 1 and spec.async_tp:
        notes.append("enable_async_tensor_parallel needs torchtitan's torch.compile: turn on [compile] enable")
    if tp > 1 and spec.tp_comm_overlap:
        notes.append("the plan hid every TP collective behind the GEMMs, as Megatron's userbuffers do; torchtitan's "
                     "AsyncTP hides the first forward's only: plan with --async-tp to predict it")
    if tp > 1 and spec.vocab_parallel_loss and not spec.torch_loss_parallel:
        notes.append("torchtitan's loss under TP is torch's loss parallel, 16 bytes per logit where the plan counted "
                     "Megatron's kernel's 8: plan with --setup torchtitan (or --torch-loss-parallel) to predict it")
    if plan.cp > 1 and not sharded:
        notes.append("torchtitan shards the weights over context parallelism with FSDP (its dp_shard_cp mesh) "
                     "even without data_parallel_shard_degree: less memory than planned, and gathers it did not time")
    if plan.cp > 1 and not (spec.cp_all_gather and spec.repeat_kv):
        notes.append("torchtitan's context parallelism all-gathers K and V, repeated to the query heads, once a pass "
                     "and rings dK and dV in fp32, which the plan did not time: plan with --setup torchtitan (or "
                     "--cp-all-gather --repeat-kv) to predict it")
    if len({s.device_type for s in plan.stages}) > 1:
        notes.append("stages run on different device types: torchtitan puts pipeline stages on consecutive "
                     "ranks, so start it with memx export's torchrun lines for Megatron-LM")
    split = ", ".join(f'"{p}"' for p in torchtitan_split_points(plan))
    lines = [
        "[training]",
        f"local_batch_size = {plan.global_batch_size // plan.dp}",
        f"global_batch_size = {plan.global_batch_size}",
        f"seq_len = {plan.seq_len}",
        f'mixed_precision_param = "{"float32" if dtype == "fp32" else "bfloat16"}"',
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {plan.dp // shard if sharded else plan.dp}",
        f"data_parallel_shard_degree = {shard if sharded else 1}",
    ] + (['fsdp_reshard_after_forward = "never"'] if sharded and spec.hold_gathered == "weights" else []) + [
        f"tensor_parallel_degree = {tp}",
    ] + (["disable_loss_parallel = true"] if tp > 1 and not spec.vocab_parallel_loss else []) + (
        ["enable_async_tensor_parallel = true"] if tp > 1 and spec.async_tp else []) + [
        f"pipeline_parallel_degree = {plan.pp}",
    ] + ([f"context_parallel_degree = {plan.cp}"] if plan.cp > 1 else [])
    if plan.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{TORCHTITAN_SCHEDULES[plan.schedule]}"',
                  f"pipeline_parallel_microbatch_size = {plan.micro_batch_size}",
                  f"pipeline_parallel_split_points = [{split}]"]
    periods = {parse_recompute(s.recompute, s.num_layers)[2] for s in plan.stages}
    if len(periods) == 1 and 0 not in periods:  # every stage every N-th layer: its layer checkpointing
        lines += ["", "[activation_checkpoint]", 'mode = "selective"', f'selective_ac_option = "{periods.pop()}"']
    else:
        lines += ["", "[activation_checkpoint]", f'mode = "{level}"']
    if level == "selective":
        lines.append('selective_ac_option = "op"')
    return ConfigText("\n".join(lines) + "\n", notes)


def deepspeed_json(plan: Plan) -> ConfigText:
    """The plan as a DeepSpeed config (``accelerate launch --use_deepspeed --deepspeed_config_file``):
    batch, precision and ZeRO stage of a data-parallel plan."""
    plan.within_one_domain("DeepSpeed")
    tr = plan.training
    stage = 3 if tr.get("fully_sharded") else 2 if tr.get("sharded_gradients") else \
        1 if tr.get("distributed_optimizer") else 0
    if plan.pp > 1 and stage >= 2:  # runtime/pipe/engine.py asserts it
        raise ConfigError("plan", f"pp={plan.pp} with ZeRO-{stage}: DeepSpeed's pipeline engine refuses ZeRO-2 and 3",
                          "plan with --pp 1, or export to torchtitan (FSDP under torch's pipelining)")
    if plan.pp > 1 or max(plan.stage_tps) > 1 or plan.cp > 1:  # (so one DP degree)
        raise ConfigError("plan", f"pp={plan.pp}, tp={plan.tp or plan.stage_tp}, cp={plan.cp}: a DeepSpeed config "
                          "holds data parallelism only (its pipeline and TP are set in code; it has no context "
                          "parallelism)", "export to Megatron-LM or torchtitan, or plan with --pp 1 --tp 1 --cp 1")
    dtype = tr.get("dtype", "bf16")
    experts = tr.get("expert_parallel", 1) * tr.get("expert_tensor_parallel", 1)
    if stage == 3 and plan.model_spec.num_experts and experts > 1:  # engine.py asserts it of deepspeed.moe layers
        raise ConfigError("plan", f"expert parallelism ({experts} ranks) with ZeRO-3: DeepSpeed's MoE layers refuse "
                          "ZeRO-3 (a Hugging Face mixture runs under it with its experts whole, EP 1)",
                          "plan with --expert-parallel 1, or --setup zero1 or zero2, or export to Megatron-LM")
    if tr.get("shard_degree") and stage < 3:
        raise ConfigError("plan", f"shard_degree={tr['shard_degree']} with ZeRO-{stage}: DeepSpeed shards part of the DP "
                          "group with ZeRO-3 only (MiCS)", "export to Megatron-LM (its partial distributed optimizer)")
    config = {"train_batch_size": plan.global_batch_size,
              "train_micro_batch_size_per_gpu": plan.micro_batch_size,
              "gradient_accumulation_steps": plan.num_microbatches,
              "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
              "zero_optimization": {"stage": stage}}
    if tr.get("shard_degree"):  # MiCS: the states sharded within groups of that many ranks, replicated across them
        config["zero_optimization"]["mics_shard_size"] = tr["shard_degree"]
    notes = []
    if stage == 3 and tr.get("max_live_params"):  # the budget of gathered weights and the buckets the plan counted
        def given(field):
            return int(tr.get(field) or OPTION_DEFAULTS[field])
        config["zero_optimization"].update(stage3_max_live_parameters=given("max_live_params"),
                                           stage3_prefetch_bucket_size=given("prefetch_bucket_params"),
                                           reduce_bucket_size=given("reduce_bucket_params"))
        if given("hpz_partition_size") > 1:
            config["zero_optimization"]["zero_hpz_partition_size"] = given("hpz_partition_size")
        if tr.get("quantized_weights"):
            config["zero_optimization"]["zero_quantized_weights"] = True
    elif stage == 3:
        notes.append("the plan priced one all-gather per block, as FSDP; DeepSpeed ZeRO-3 fetches each linear "
                     "on its own: plan with --setup zero3 (--max-live-params 1e9) to predict it")
    level, recompute_notes = _strongest_recompute(plan, "DeepSpeed")
    notes += recompute_notes + _precision_notes(plan, "DeepSpeed")
    if level != "none":
        notes.append(f"the plan recomputes ({level}): turn on activation checkpointing in the model "
                     "(Hugging Face: model.gradient_checkpointing_enable()); DeepSpeed's config does not")
    return ConfigText(json.dumps(config, indent=2) + "\n", notes)
