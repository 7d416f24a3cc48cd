"""Exporters: Megatron-LM arguments checked by megatron-core, torchrun lines by torch's parser."""

import os

import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning.exporters import megatron_args, pipeline_layout
from memx_launch.planning.launch_lines import plan_env, torchrun_commands
from memx_launch.planning.plan import Objective, Plan, StagePlan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")


def make_plan(layers=(8, 24), recompute=("full", "none"), devices=("vendor-x-32gb", "vendor-y-64gb"),
              tp=1, dp=8, virtual_stages=1, schedule="1f1b", mbs=1, gbs=64, model="llama2-7b"):
    pp = len(layers)
    per_stage = tp * dp
    stages = [StagePlan(device_type=d, ranks=list(range(i * per_stage, (i + 1) * per_stage)),
                        num_layers=n, recompute=r, predicted_peak_memory_gib=10.0,
                        predicted_stage_time_s=0.1)
              for i, (n, r, d) in enumerate(zip(layers, recompute, devices))]
    plan = Plan(model=model, model_spec=get_model(model), cluster="table1-2vendor", tp=tp, pp=pp, dp=dp,
                micro_batch_size=mbs, global_batch_size=gbs, seq_len=4096, schedule=schedule,
                virtual_stages=virtual_stages, stages=stages, predicted_iteration_time_s=1.0,
                objective=Objective(phi=1.0, profile="heterogeneous", weights=(0.4, 0.2, 0.4)))
    plan.validate()
    return plan


def _flag(args, name):
    return args[args.index(name) + 1] if name in args else None


# Megatron-LM's arguments as megatron/training/arguments.py declares them (that file is not part
# of the megatron-core package; read at commit 000c4ac24f61159c138b0975def722c65245983c), by the
# function that adds them: _add_network_size_args, _add_training_args, _add_mixed_precision_args,
# _add_distributed_args, _add_regularization_args, _add_data_args, _add_tokenizer_args (the FP4 and
# CPU-offloading flags as public Megatron-LM training scripts pass them).
# flag -> argparse keywords: its type (int/float/choices) or its action.
MEGATRON_LM_ARGUMENTS = {
    # network size
    "--num-layers": dict(type=int), "--hidden-size": dict(type=int), "--ffn-hidden-size": dict(type=int),
    "--num-attention-heads": dict(type=int), "--group-query-attention": dict(action="store_true"),
    "--num-query-groups": dict(type=int), "--max-position-embeddings": dict(type=int),
    "--position-embedding-type": dict(choices=["learned_absolute", "rope", "mrope", "relative", "none"]),
    "--rotary-base": dict(type=int, default=10000), "--normalization": dict(choices=["LayerNorm", "RMSNorm"]),
    "--norm-epsilon": dict(type=float, default=1e-5), "--swiglu": dict(action="store_true"),
    "--quick-geglu": dict(action="store_true"), "--activation-func-clamp-value": dict(type=float),
    "--glu-linear-offset": dict(type=float, default=0.0),
    "--softmax-type": dict(type=str, choices=["learnable", "vanilla", "off-by-one"], default="vanilla"),
    "--untie-embeddings-and-output-weights": dict(action="store_true"),
    "--attention-backend": dict(type=str, choices=["flash", "fused", "unfused", "local", "auto"], default="auto"),
    # regularization
    "--attention-dropout": dict(type=float, default=0.1), "--hidden-dropout": dict(type=float, default=0.1),
    # training
    "--micro-batch-size": dict(type=int), "--global-batch-size": dict(type=int),
    "--recompute-granularity": dict(choices=["full", "selective"]),
    "--recompute-method": dict(choices=["uniform", "block"]), "--recompute-num-layers": dict(type=int),
    "--disable-bias-linear": dict(action="store_true"), "--optimizer": dict(choices=["adam", "sgd"]),
    "--add-qkv-bias": dict(action="store_true"),
    "--cross-entropy-loss-fusion": dict(action="store_true"),
    "--no-bias-gelu-fusion": dict(action="store_false", dest="bias_gelu_fusion"),
    "--no-bias-swiglu-fusion": dict(action="store_false", dest="bias_swiglu_fusion"),
    "--no-masked-softmax-fusion": dict(action="store_false", dest="masked_softmax_fusion"),
    # mixed precision
    "--fp16": dict(action="store_true"), "--bf16": dict(action="store_true"),
    "--attention-softmax-in-fp32": dict(action="store_true"),
    "--accumulate-allreduce-grads-in-fp32": dict(action="store_true"),
    # distributed
    "--tensor-model-parallel-size": dict(type=int), "--pipeline-model-parallel-size": dict(type=int),
    "--context-parallel-size": dict(type=int, default=1),
    "--pipeline-model-parallel-layout": dict(type=str), "--use-distributed-optimizer": dict(action="store_true"),
    "--use-megatron-fsdp": dict(action="store_true"),
    "--data-parallel-sharding-strategy": dict(choices=["no_shard", "optim", "optim_grads", "optim_grads_params"]),
    "--sequence-parallel": dict(action="store_true"), "--overlap-grad-reduce": dict(action="store_true"),
    "--tp-comm-overlap": dict(action="store_true"),
    "--fp8-format": dict(choices=["e4m3", "hybrid"]),
    "--fp8-recipe": dict(choices=["tensorwise", "delayed", "mxfp8", "blockwise"]),
    "--kv-channels": dict(type=int), "--qk-layernorm": dict(action="store_true"),
    "--num-experts": dict(type=int), "--moe-router-topk": dict(type=int), "--moe-ffn-hidden-size": dict(type=int),
    "--moe-grouped-gemm": dict(action="store_true"),
    "--moe-token-dispatcher-type": dict(choices=["allgather", "alltoall", "flex"]),
    "--moe-flex-dispatcher-backend": dict(choices=["deepep", "hybridep"], default="deepep"),
    "--moe-router-num-groups": dict(type=int), "--moe-router-group-topk": dict(type=int),
    "--moe-router-pre-softmax": dict(action="store_true"),
    "--expert-model-parallel-size": dict(type=int, default=1), "--expert-tensor-parallel-size": dict(type=int),
    "--moe-shared-expert-intermediate-size": dict(type=int), "--moe-shared-expert-gate": dict(action="store_true"),
    "--overlap-moe-expert-parallel-comm": dict(action="store_true"), "--delay-wgrad-compute": dict(action="store_true"),
    "--fp4-format": dict(choices=["e2m1"]), "--fp4-recipe": dict(choices=["nvfp4", "custom"]),
    "--fp8-param-gather": dict(action="store_true"),
    "--cpu-offloading": dict(action="store_true"), "--cpu-offloading-num-layers": dict(type=int, default=0),
    "--multi-latent-attention": dict(action="store_true"), "--q-lora-rank": dict(type=int),
    "--kv-lora-rank": dict(type=int), "--qk-head-dim": dict(type=int), "--qk-pos-emb-head-dim": dict(type=int),
    "--v-head-dim": dict(type=int), "--mtp-num-layers": dict(type=int), "--moe-layer-freq": dict(type=str),
    "--recompute-modules": dict(nargs="*"), "--attention-output-gate": dict(action="store_true"),
    "--experimental-attention-variant": dict(choices=["gated_delta_net", "dsa"]),
    "--linear-attention-freq": dict(type=str), "--linear-num-key-heads": dict(type=int),
    "--linear-num-value-heads": dict(type=int), "--linear-key-head-dim": dict(type=int),
    "--linear-value-head-dim": dict(type=int), "--linear-conv-kernel-dim": dict(type=int),
    # data, tokenizer
    "--seq-length": dict(type=int), "--vocab-size": dict(type=int),
}


def _megatron_parse(args):
    """The exported line read back by Megatron-LM's declarations: an unknown flag, a value of the
    wrong type (--rotary-base 500000.0) or outside the choices fails here as it would there."""
    import argparse

    class Strict(argparse.ArgumentParser):
        def error(self, message):
            raise AssertionError(message)

    parser = Strict(allow_abbrev=False)
    for flag, kwargs in MEGATRON_LM_ARGUMENTS.items():
        parser.add_argument(flag, **kwargs)
    flags = [a for a in args if a.startswith("--")]
    assert len(flags) == len(set(flags))  # each flag once
    return parser.parse_args(args)


def _megatron_config(plan, args):
    """Build megatron-core's TransformerConfig from the parsed flags; it validates them."""
    torch = pytest.importorskip("torch")
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    from megatron.core.transformer.enums import AttnBackend

    a = _megatron_parse(args)
    kwargs = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
                  num_attention_heads=a.num_attention_heads,
                  num_query_groups=a.num_query_groups or a.num_attention_heads,
                  gated_linear_unit=a.swiglu, normalization=a.normalization, add_bias_linear=not a.disable_bias_linear,
                  add_qkv_bias=a.add_qkv_bias,
                  layernorm_epsilon=a.norm_epsilon, hidden_dropout=a.hidden_dropout,
                  attention_dropout=a.attention_dropout, attention_backend=AttnBackend[a.attention_backend],
                  masked_softmax_fusion=a.masked_softmax_fusion, attention_softmax_in_fp32=a.attention_softmax_in_fp32,
                  bf16=a.bf16, fp16=a.fp16, fp8=a.fp8_format, fp8_recipe=a.fp8_recipe or "delayed",
                  fp4=a.fp4_format, fp4_recipe=a.fp4_recipe or "nvfp4", fp8_param=a.fp8_param_gather,
                  cpu_offloading=a.cpu_offloading, cpu_offloading_num_layers=a.cpu_offloading_num_layers,
                  tensor_model_parallel_size=a.tensor_model_parallel_size,
                  sequence_parallel=a.sequence_parallel, tp_comm_overlap=a.tp_comm_overlap,
                  pipeline_model_parallel_size=a.pipeline_model_parallel_size,
                  context_parallel_size=a.context_parallel_size,
                  pipeline_model_parallel_layout=a.pipeline_model_parallel_layout,
                  recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
                  pipeline_dtype=torch.bfloat16)
    # Megatron-LM's core_transformer_config_from_args: SwiGLU or quick GeGLU, each fused unless told not.
    kwargs["bias_activation_fusion"] = a.bias_swiglu_fusion if a.swiglu else a.bias_gelu_fusion
    if a.swiglu:
        kwargs["activation_func"] = torch.nn.functional.silu
    elif a.quick_geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu  # what its fused path checks for
        kwargs.update(gated_linear_unit=True, activation_func=quick_gelu)
    kwargs.update(activation_func_clamp_value=a.activation_func_clamp_value, glu_linear_offset=a.glu_linear_offset,
                  softmax_type=a.softmax_type)
    if a.recompute_num_layers:
        kwargs["recompute_num_layers"] = a.recompute_num_layers
    if a.kv_channels:
        kwargs["kv_channels"] = a.kv_channels
    if a.qk_layernorm:
        kwargs["qk_layernorm"] = True
    if a.num_experts:
        kwargs.update(num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
                      moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_grouped_gemm=a.moe_grouped_gemm,
                      moe_token_dispatcher_type=a.moe_token_dispatcher_type,
                      moe_flex_dispatcher_backend=a.moe_flex_dispatcher_backend,
                      moe_router_num_groups=a.moe_router_num_groups, moe_router_group_topk=a.moe_router_group_topk,
                      moe_router_pre_softmax=a.moe_router_pre_softmax,
                      expert_model_parallel_size=a.expert_model_parallel_size,
                      expert_tensor_parallel_size=a.expert_tensor_parallel_size,
                      moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
                      moe_shared_expert_gate=a.moe_shared_expert_gate,
                      overlap_moe_expert_parallel_comm=a.overlap_moe_expert_parallel_comm,
                      delay_wgrad_compute=a.delay_wgrad_compute)
    if a.moe_layer_freq:  # Megatron-LM evaluates the list expression (moe_freq_type): ([0]*3+[1]*58)
        kwargs["moe_layer_freq"] = list(eval(a.moe_layer_freq, {"__builtins__": {}}))
    if a.mtp_num_layers:
        kwargs["mtp_num_layers"] = a.mtp_num_layers
    if a.recompute_modules:
        kwargs["recompute_modules"] = a.recompute_modules
    if a.attention_output_gate:
        kwargs["attention_output_gate"] = True
    if a.experimental_attention_variant:  # an integer period or a list expression, as moe_layer_freq
        freq = a.linear_attention_freq
        kwargs.update(experimental_attention_variant=a.experimental_attention_variant,
                      linear_attention_freq=int(freq) if freq.isdigit() else list(eval(freq, {"__builtins__": {}})),
                      linear_num_key_heads=a.linear_num_key_heads, linear_num_value_heads=a.linear_num_value_heads,
                      linear_key_head_dim=a.linear_key_head_dim, linear_value_head_dim=a.linear_value_head_dim,
                      linear_conv_kernel_dim=a.linear_conv_kernel_dim)
    if a.multi_latent_attention:
        return tc.MLATransformerConfig(**kwargs, multi_latent_attention=True, q_lora_rank=a.q_lora_rank,
                                       kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,
                                       qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim)
    return tc.TransformerConfig(**kwargs)


def _built(config):
    """Decoder layers per pipeline rank and chunk of Megatron's parsed layout (its
    get_num_layers_to_build reads the chunk from parallel state, which a test does not set up)."""
    from megatron.core.transformer.enums import LayerType

    return [[chunk.count(LayerType.decoder) for chunk in rank] for rank in config.pipeline_model_parallel_layout.layout]


def test_uneven_layout_is_what_megatron_builds():
    plan = make_plan(layers=(8, 24), recompute=("full", "full"))
    export = megatron_args(plan)
    assert _flag(export.args, "--pipeline-model-parallel-layout") == "Et*8|t*24L"
    config = _megatron_config(plan, export.args)
    layout = config.pipeline_model_parallel_layout
    assert [layout.get_num_layers_to_build(pp_rank=r) for r in range(2)] == [8, 24]
    assert _flag(export.args, "--recompute-granularity") == "full"
    assert not any("recompute" in n for n in export.notes)  # same level on every stage
    assert _flag(export.args, "--micro-batch-size") == "1"
    assert _flag(export.args, "--global-batch-size") == "64"
    assert _flag(export.args, "--seq-length") == "4096"


def test_interleaved_layout_gives_each_stage_its_layers_in_chunks():
    plan = make_plan(layers=(10, 6, 16), recompute=("none",) * 3, tp=1, dp=2, virtual_stages=2,
                     schedule="interleaved", devices=("a",) * 3, gbs=12)
    export = megatron_args(plan)
    layout_str = pipeline_layout(plan)
    assert layout_str == "Et*5|t*3|t*8|t*5|t*3|t*8L"
    config = _megatron_config(plan, export.args)
    assert config.virtual_pipeline_model_parallel_size == 2
    assert _built(config) == [[5, 5], [3, 3], [8, 8]]
    assert "--num-layers-per-virtual-pipeline-stage" not in export.args
    assert "--recompute-granularity" not in export.args


def test_per_stage_recompute_is_reported_not_hidden():
    plan = make_plan(layers=(8, 24), recompute=("selective", "none"))
    export = megatron_args(plan)
    assert _flag(export.args, "--recompute-granularity") == "selective"
    assert any("per-stage recompute" in n and "stage 0: selective" in n for n in export.notes)
    _megatron_config(plan, export.args)


def test_recompute_of_a_stages_first_k_layers_is_the_block_method():
    plan = make_plan(layers=(8, 24), recompute=("full:3", "full:5"))
    export = megatron_args(plan)
    assert [_flag(export.args, f) for f in ("--recompute-granularity", "--recompute-method",
                                            "--recompute-num-layers")] == ["full", "block", "5"]
    assert any("K=5 everywhere" in n for n in export.notes)
    _megatron_config(plan, export.args)


def test_megatron_flags_state_the_training_setup_of_the_plan():
    plan = make_plan(layers=(8, 24), recompute=("full", "full"), tp=2, dp=4)
    plan.training = TrainingSpec(setup="megatron").plan_fields()
    export = megatron_args(plan)
    for flag in ("--bf16", "--use-distributed-optimizer", "--sequence-parallel", "--overlap-grad-reduce"):
        assert flag in export.args
    assert not any("--setup" in n for n in export.notes) and "--cross-entropy-loss-fusion" not in export.args
    plan.training = TrainingSpec(setup="megatron", fused_loss=True).plan_fields()
    assert "--cross-entropy-loss-fusion" in megatron_args(plan).args
    plan.training = TrainingSpec(setup="zero3").plan_fields()
    export = megatron_args(plan)
    assert "--use-distributed-optimizer" not in export.args and "--sequence-parallel" not in export.args
    assert any("--setup zero3" in n for n in export.notes)
    _megatron_config(plan, export.args)
    plan.training = TrainingSpec(setup="megatron", tp_comm_overlap=True).plan_fields()
    assert _megatron_config(plan, megatron_args(plan).args).tp_comm_overlap  # TP 2, sequence parallel
    for recipe, megatron in (("delayed", ("hybrid", "delayed")), ("current", ("hybrid", "tensorwise")),
                             ("mxfp8", ("e4m3", "mxfp8"))):
        plan.training = TrainingSpec(setup="megatron", fp8=recipe).plan_fields()
        config = _megatron_config(plan, megatron_args(plan).args)
        assert (config.fp8, config.fp8_recipe) == megatron
    plan.training = TrainingSpec(setup="megatron", fp4="nvfp4").plan_fields()
    config = _megatron_config(plan, megatron_args(plan).args)
    assert (config.fp8, config.fp4, config.fp4_recipe) == (None, "e2m1", "nvfp4")


def test_heads_wider_than_hidden_over_heads_export_their_kv_channels(tmp_path):
    import json

    cfg = {"model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = make_plan(layers=(2, 2), recompute=("none", "none"), model=str(tmp_path))
    config = _megatron_config(plan, megatron_args(plan).args)
    assert (config.kv_channels, config.num_attention_heads, config.hidden_size) == (128, 16, 1024)
    assert "--kv-channels" not in megatron_args(make_plan()).args  # llama2-7b: 4096 / 32 heads


def test_activation_offloading_exports_megatron_s_cpu_offloading_where_megatron_core_takes_it():

    one_stage = make_plan(layers=(32,), recompute=("none",), devices=("vendor-y-64gb",))
    one_stage.training = TrainingSpec(setup="megatron", activation_offload_layers=8).plan_fields()
    export = megatron_args(one_stage)
    config = _megatron_config(one_stage, export.args)
    assert (config.cpu_offloading, config.cpu_offloading_num_layers) == (True, 8)
    assert not any("offload" in n for n in export.notes)
    two_stages = make_plan(recompute=("none", "none"))
    two_stages.training = one_stage.training
    export = megatron_args(two_stages)
    assert any("only without pipeline parallelism" in n for n in export.notes)
    with pytest.raises(ValueError, match="Pipeline parallelism with CPU offloading"):
        _megatron_config(two_stages, export.args)


def test_a_context_parallel_plan_builds_in_megatron_core():
    from memx_launch.planning.estimate import evaluate_layout

    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    training = TrainingSpec(global_batch_size=64, seq_len=16384, setup="megatron")
    plan = evaluate_layout(get_model("llama2-7b"), cluster, training, tp=2, pp=2, dp=1, cp=4, micro_batch_size=1,
                           references=(1.0, 1.0, 1.0))
    config = _megatron_config(plan, megatron_args(plan).args)
    assert (config.context_parallel_size, config.tensor_model_parallel_size) == (4, 2)


def test_a_plan_crossing_communication_domains_is_refused_by_every_other_framework(tmp_path, capsys):
    """NCCL and RCCL do not join one group: only memx-run's bridge carries what crosses them."""
    from memx_launch.cli import main
    from memx_launch.planning import config_exports
    from memx_launch.planning.plan import Crossing

    plan = make_plan(devices=("vendor-x-32gb+vendor-y-64gb", "vendor-y-64gb"))
    plan.crossings = [Crossing("data_parallel", [0], ["nccl", "rccl"], 1e6, 0.01),
                      Crossing("pipeline", [0, 1], ["nccl", "rccl"], 1e6, 0.01)]
    for export, name in ((megatron_args, "Megatron-LM"), (config_exports.torchtitan_toml, "torchtitan"),
                         (config_exports.deepspeed_json, "DeepSpeed")):
        with pytest.raises(ConfigError, match=f"DP sync of stage 0 and pipeline stage 0 -> 1 span "
                                              f"communication domains \\(nccl, rccl\\), and {name}") as refusal:
            export(plan)
        assert refusal.value.field == "plan.crossings" and "memx-run --plan" in str(refusal.value)
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    with pytest.raises(ConfigError, match="and Megatron-LM runs each group on one collective library"):
        torchrun_commands(plan, cluster, "train.py", for_megatron=True)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert main(["export", "--plan", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "plan.crossings" in err
    # memx's runtime, which carries crossings, points a plan it cannot run to one domain's devices first.
    from memx_launch.planning.runtime_support import check_runnable

    plan.cp = 2
    with pytest.raises(ConfigError, match="plan it on one communication domain's devices"):
        check_runnable(plan)
    # memx plan and memx estimate say so under the plan's crossings.
    from memx_launch.planning.report import crossing_lines

    assert crossing_lines(plan, cluster)[-1].startswith("  and memx-run cannot run it (cp=2: memx's runtime has no "
                                                        "context parallelism): no framework runs this plan")
    plan.cp, plan.crossings = 1, []
    assert megatron_args(plan).args  # one domain: exported
    plan.cp = 2
    with pytest.raises(ConfigError, match=r"plan with --cp 1, or run the plan with Megatron-LM \(memx export\)$"):
        check_runnable(plan)


def test_torchrun_commands_parse_and_keep_rank_order():
    run = pytest.importorskip("torch.distributed.run")
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    plan = make_plan()
    commands = torchrun_commands(plan, cluster, "train.py", ["--model", "llama2-7b"], master_addr="10.0.0.1")
    assert len(commands) == 2
    total = 0
    for node_rank, cmd in enumerate(commands):
        assert cmd.args[0] == "torchrun"
        args = run.get_args_parser().parse_args(cmd.args[1:])
        assert args.node_rank == node_rank
        assert args.nnodes == "2"
        assert args.rdzv_backend == "static"
        assert args.training_script == "train.py"
        assert args.training_script_args == ["--model", "llama2-7b"]
        total += int(args.nproc_per_node)
    assert total == plan.world_size


def test_torchrun_refuses_a_cluster_the_plan_was_not_made_for():
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    swapped = make_plan(devices=("vendor-y-64gb", "vendor-x-32gb"))
    with pytest.raises(ConfigError, match="rank 0 is a vendor-x-32gb"):
        torchrun_commands(swapped, cluster, "train.py")
    small = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "v100-t4.yaml"))
    with pytest.raises(ConfigError, match="has 6 devices but the plan needs"):
        torchrun_commands(make_plan(), small, "train.py")


def test_env_describes_every_stage():
    plan = make_plan()
    env = plan_env(plan, "/tmp/plan.json")
    assert env["MEMX_PLAN"] == "/tmp/plan.json"
    assert env["MEMX_LAYERS_PER_STAGE"] == "8,24"
    assert env["MEMX_RECOMPUTE_PER_STAGE"] == "full,none"
    assert env["MEMX_STAGE_DEVICE_TYPES"] == "vendor-x-32gb,vendor-y-64gb"
    assert (env["MEMX_TP"], env["MEMX_PP"], env["MEMX_DP"]) == ("1", "2", "8")
    assert env["MEMX_NUM_MICROBATCHES"] == "8"


def test_megatron_node_order_puts_each_stage_on_consecutive_ranks():
    run = pytest.importorskip("torch.distributed.run")
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    plan = make_plan(devices=("vendor-y-64gb", "vendor-x-32gb"))  # Y first in the pipeline
    plan.stages[0].ranks, plan.stages[1].ranks = list(range(8, 16)), list(range(8))
    commands = torchrun_commands(plan, cluster, "train.py", for_megatron=True)
    parsed = [run.get_args_parser().parse_args(c.args[1:]) for c in commands]
    assert [c.notes[0] for c in commands] == ["run on y-node", "run on x-node"]
    assert [p.node_rank for p in parsed] == [0, 1]
    # memx's own runtime keeps the cluster file's order, which the plan's ranks refer to.
    assert [c.notes[0] for c in torchrun_commands(plan, cluster, "train.py")] == ["run on x-node", "run on y-node"]


def test_bf16_distributed_optimizer_plan_exports_both_flags_and_the_model_shape():
    from memx_launch.planning.search import search

    model = get_model("llama2-7b")
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    plan = search(model, cluster, TrainingSpec(global_batch_size=64, seq_len=4096, dtype="bf16",
                                               distributed_optimizer=True)).best
    args = megatron_args(plan).args
    assert "--bf16" in args and "--use-distributed-optimizer" in args and "--fp16" not in args
    shape = {f: _flag(args, f) for f in ("--num-layers", "--hidden-size", "--ffn-hidden-size",
                                         "--num-attention-heads", "--seq-length", "--vocab-size")}
    assert shape == {"--num-layers": "32", "--hidden-size": "4096", "--ffn-hidden-size": "11008",
                     "--num-attention-heads": "32", "--seq-length": "4096", "--vocab-size": "32000"}
    assert {"--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"} <= set(args)
    assert (_flag(args, "--position-embedding-type"), _flag(args, "--normalization")) == ("rope", "RMSNorm")
    assert "--group-query-attention" not in args  # llama2-7b: as many KV heads as heads
    assert (_flag(args, "--micro-batch-size"), _flag(args, "--global-batch-size")) == (
        str(plan.micro_batch_size), "64")
    config = _megatron_config(plan, args)
    assert config.bf16 and config.gated_linear_unit and not config.add_bias_linear


def test_grouped_query_attention_fp16_and_fully_sharded():
    plan = make_plan(model="llama3-70b", layers=(40, 40), recompute=("full", "full"))
    plan.training = {"dtype": "fp16", "optimizer": "adam", "distributed_optimizer": False, "fully_sharded": True}
    args = megatron_args(plan).args
    spec = plan.model_spec
    assert spec.num_kv_heads < spec.num_heads
    assert _flag(args, "--num-query-groups") == str(spec.num_kv_heads) and "--group-query-attention" in args
    assert "--fp16" in args and "--bf16" not in args and "--use-distributed-optimizer" not in args
    assert _flag(args, "--data-parallel-sharding-strategy") == "optim_grads_params"
    config = _megatron_config(plan, args)
    assert config.num_query_groups == spec.num_kv_heads and config.fp16


def test_master_address_comes_from_the_cluster_file():
    from memx_launch.specs.cluster import ClusterSpec as CS
    import yaml

    with open(os.path.join(CLUSTERS, "table1-2vendor.yaml")) as f:
        data = yaml.safe_load(f)
    plan = make_plan()
    plain = torchrun_commands(plan, CS.from_dict(data), "train.py")
    assert all(_flag(c.args, "--master-addr") == "localhost" for c in plain)
    assert any("set master_addr" in n for n in plain[0].notes)  # two nodes cannot meet at localhost
    data["nodes"][0]["host"] = "x0.example.org"
    from_host = torchrun_commands(plan, CS.from_dict(data), "train.py")
    assert all(_flag(c.args, "--master-addr") == "x0.example.org" for c in from_host)
    assert not any("master_addr" in n for c in from_host for n in c.notes)
    data["master_addr"] = "10.0.0.7"
    assert all(_flag(c.args, "--master-addr") == "10.0.0.7"
               for c in torchrun_commands(plan, CS.from_dict(data), "train.py"))
    assert all(_flag(c.args, "--master-addr") == "10.0.0.9"
               for c in torchrun_commands(plan, CS.from_dict(data), "train.py", master_addr="10.0.0.9"))


def test_megatron_line_states_what_megatron_defaults_differently():
    """Issue 22: dropout (Megatron: 0.1), the attention kernel, Llama 3's RoPE base, the norm epsilon."""
    plan = make_plan(model="llama3-8b", layers=(16, 16), recompute=("full", "full"))
    export = megatron_args(plan)
    args = export.args
    assert any("pass --cluster to check" in n for n in export.notes)  # flash assumed, devices unknown
    parsed = _megatron_parse(args)
    assert (parsed.rotary_base, parsed.norm_epsilon) == (500000, 1e-5)
    assert (parsed.hidden_dropout, parsed.attention_dropout, parsed.attention_backend) == (0.0, 0.0, "flash")
    config = _megatron_config(plan, args)
    assert config.hidden_dropout == 0.0 and config.attention_dropout == 0.0 and config.layernorm_epsilon == 1e-5
    assert _megatron_parse(megatron_args(make_plan()).args).rotary_base == 10000  # llama2: stated too
    plan.training = {**plan.training, "dropout": True, "flash_attention": False, "fused_softmax": False,
                     "softmax_in_fp32": True}
    parsed = _megatron_parse(megatron_args(plan).args)
    assert (parsed.hidden_dropout, parsed.attention_dropout) == (0.1, 0.0)  # dropout on: Megatron's own rate
    assert (parsed.attention_backend, parsed.masked_softmax_fusion, parsed.attention_softmax_in_fp32) == \
        ("unfused", False, True)
    _megatron_config(plan, megatron_args(plan).args)


def test_attention_kernel_follows_the_devices_that_run_it():
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    kinds = {d.name: d.flash_attention for d in cluster.device_types}
    assert kinds == {"vendor-x-32gb": False, "vendor-y-64gb": True}
    export = megatron_args(make_plan(), cluster)
    assert _flag(export.args, "--attention-backend") == "unfused"
    assert any("fused attention on vendor-y-64gb and unfused on vendor-x-32gb" in n for n in export.notes)
    same = make_plan(devices=("vendor-y-64gb", "vendor-y-64gb"))
    assert _flag(megatron_args(same, cluster).args, "--attention-backend") == "flash"


def test_fp16_keeps_fp32_gradients_and_an_odd_rope_base_is_named():
    from dataclasses import replace

    plan = make_plan()
    plan.training = {**plan.training, "dtype": "fp16", "grad_dtype": "fp32"}
    args = megatron_args(plan).args
    assert "--fp16" in args and "--accumulate-allreduce-grads-in-fp32" in args
    _megatron_config(plan, args)
    plan.model_spec = replace(plan.model_spec, rope_theta=1e4 + 0.5)
    export = megatron_args(plan)
    assert _flag(export.args, "--rotary-base") == "10000" and any("not an integer" in n for n in export.notes)


# --------------------------------------------------------------------------- torchtitan, DeepSpeed
# torchtitan's JobConfig (torchtitan/config/job_config.py at commit 000204a4a8bf3d0f31adc44fc29855fbb6ea13d8):
# the sections and keys memx writes, with their types.
TORCHTITAN_KEYS = {
    "training": {"local_batch_size": int, "global_batch_size": int, "seq_len": int, "mixed_precision_param": str},
    "parallelism": {"data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
                    "tensor_parallel_degree": int, "pipeline_parallel_degree": int, "disable_loss_parallel": bool,
                    "enable_async_tensor_parallel": bool,
                    "pipeline_parallel_schedule": str, "pipeline_parallel_microbatch_size": int,
                    "pipeline_parallel_split_points": list},
    "activation_checkpoint": {"mode": str, "selective_ac_option": str},
}


def _torchtitan(plan):
    import tomllib

    from memx_launch.planning.config_exports import torchtitan_toml

    config = torchtitan_toml(plan)
    parsed = tomllib.loads(config.text)
    for section, keys in parsed.items():
        for key, value in keys.items():
            assert isinstance(value, TORCHTITAN_KEYS[section][key]), (section, key)
    return parsed, config.notes


def test_torchtitan_config_states_the_uneven_split_batch_and_dp_kind():
    parsed, notes = _torchtitan(make_plan(layers=(8, 24), recompute=("full", "none"), tp=2, dp=4, mbs=2, gbs=64))
    par = parsed["parallelism"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["data_parallel_replicate_degree"],
            par["data_parallel_shard_degree"]) == (2, 2, 4, 1)
    assert par["pipeline_parallel_split_points"] == ["layers.8"] and par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == 2
    assert parsed["training"]["local_batch_size"] * 4 == parsed["training"]["global_batch_size"] == 64
    assert parsed["activation_checkpoint"]["mode"] == "full"
    assert any("per-stage recompute" in n and "'full'" in n for n in notes)


def test_every_n_th_layer_s_recompute_is_torchtitan_s_layer_checkpointing_and_megatron_s_block_method():
    plan = make_plan(layers=(16, 16), recompute=("full:every2", "full:every2"))
    parsed, notes = _torchtitan(plan)
    assert parsed["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert not [n for n in notes if "recompute" in n]
    args, notes = (lambda e: (e.args, e.notes))(megatron_args(plan))
    assert (_flag(args, "--recompute-method"), _flag(args, "--recompute-num-layers")) == ("block", "8")
    assert [n for n in notes if "full:everyN" in n and "no more memory" in n]
    # Stages that checkpoint differently: torchtitan has one setting, the strongest (full) is memory-safe.
    parsed, notes = _torchtitan(make_plan(layers=(16, 16), recompute=("full:every2", "none")))
    assert parsed["activation_checkpoint"] == {"mode": "full"} and [n for n in notes if "per-stage" in n]


def test_torchtitan_interleaved_split_points_follow_its_looped_stage_order():
    # chunks in model order 4 | 12 | 4 | 12 layers on ranks 0, 1, 0, 1 (as Megatron's layout Et*4|t*12|t*4|t*12L)
    plan = make_plan(layers=(8, 24), virtual_stages=2, schedule="interleaved")
    parsed, _ = _torchtitan(plan)
    assert parsed["parallelism"]["pipeline_parallel_split_points"] == ["layers.4", "layers.16", "layers.20"]
    assert pipeline_layout(plan) == "Et*4|t*12|t*4|t*12L"
    assert parsed["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"


def test_torchtitan_loss_under_tp_is_what_the_plan_counted_or_a_note_says_otherwise():
    plan = make_plan(tp=2, dp=4)
    plan.training = {"vocab_parallel_loss": False}  # gathered logits: torchtitan's loss parallel turned off
    parsed, notes = _torchtitan(plan)
    assert parsed["parallelism"]["disable_loss_parallel"] is True
    assert not [n for n in notes if "loss parallel" in n]
    plan.training = {"vocab_parallel_loss": True, "torch_loss_parallel": True}  # what torchtitan runs by default
    parsed, notes = _torchtitan(plan)
    assert "disable_loss_parallel" not in parsed["parallelism"] and not [n for n in notes if "loss parallel" in n]
    plan.training = {"vocab_parallel_loss": True}  # Megatron's kernel: torchtitan holds twice its 8 bytes per logit
    assert [n for n in _torchtitan(plan)[1] if "--torch-loss-parallel" in n]
    plan.training = {"vocab_parallel_loss": True, "fp8": "current"}
    assert [n for n in _torchtitan(plan)[1] if "--no-fp8-weight-cache" in n]
    plan.training = {"vocab_parallel_loss": True, "fp8": "current", "fp8_weight_cache": False}
    assert not [n for n in _torchtitan(plan)[1] if "--no-fp8-weight-cache" in n or "AsyncTP" in n]
    plan.training = {"sequence_parallel": True, "tp_comm_overlap": True}
    assert [n for n in _torchtitan(plan)[1] if "AsyncTP" in n]
    plan.training = TrainingSpec(setup="torchtitan", async_tp=True).plan_fields()  # what torchtitan runs
    parsed, notes = _torchtitan(plan)
    assert parsed["parallelism"]["enable_async_tensor_parallel"] is True
    assert [n for n in notes if "compile" in n] and not [n for n in notes if "AsyncTP" in n or "loss parallel" in n]


def test_torchtitan_refuses_per_stage_tp():
    plan = make_plan()
    plan.stage_tp, plan.tp = [2, 1], None
    with pytest.raises(ConfigError, match="plan.stage_tp.*torchtitan"):
        _torchtitan(plan)


def test_deepspeed_config_of_a_data_parallel_plan_and_its_refusal_of_pp():
    import json

    from memx_launch.planning.config_exports import deepspeed_json

    plan = make_plan(layers=(32,), recompute=("selective",), devices=("vendor-x-32gb",), dp=8, mbs=2, gbs=64)
    plan.training = {"dtype": "bf16", "distributed_optimizer": True}
    config = deepspeed_json(plan)
    ds = json.loads(config.text)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["zero_optimization"]["stage"] == 1
    assert any("gradient_checkpointing_enable" in n for n in config.notes)
    with pytest.raises(ConfigError, match=r"^plan: pp=2.*export to Megatron-LM or torchtitan"):
        deepspeed_json(make_plan())


def test_fp8_and_16_bit_optimizer_states_come_back_as_notes_where_the_config_cannot_set_them():
    import json

    from memx_launch.planning.config_exports import deepspeed_json

    plan = make_plan(layers=(32,), devices=("vendor-x-32gb",), dp=8, mbs=2, gbs=64)
    plan.training = {"dtype": "bf16", "fp8": "current", "fp8_params": True, "optimizer_dtype": "training"}
    _, notes = _torchtitan(plan)
    assert any("FP8 (--fp8 current, weights kept in FP8)" in n and "Float8" in n for n in notes)
    assert any("16 bits" in n and "torchtitan's optimizer" in n for n in notes)
    config = deepspeed_json(plan)
    assert json.loads(config.text)["bf16"]["enabled"]
    assert any("Transformer Engine" in n for n in config.notes) and any("DeepSpeed's optimizer" in n
                                                                       for n in config.notes)
    plan.training = {"dtype": "bf16"}
    assert not [n for n in _torchtitan(plan)[1] if "FP8" in n or "16 bits" in n]


def test_memx_export_to_torchtitan_prints_the_toml_and_notes_on_stderr(tmp_path, capsys):
    import tomllib

    from memx_launch.cli.main import main

    path = tmp_path / "plan.json"
    make_plan().save(str(path))
    assert main(["export", "--plan", str(path), "--to", "torchtitan"]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["parallelism"]["pipeline_parallel_split_points"] == ["layers.8"]
    assert "note: set [model] name and flavor" in err


def test_a_gpt_style_model_exports_layer_norm_biases_and_its_learned_position_table():
    plan = make_plan(model="opt-350m", layers=(12, 12), recompute=("full", "none"))
    args, notes = megatron_args(plan).args, megatron_args(plan).notes
    assert [n for n in notes if "MLP is ReLU" in n]  # Megatron-LM's command line builds GELU
    assert not [n for n in megatron_args(make_plan(model="gpt-neo-2.7b", layers=(16, 16))).notes if "ReLU" in n]
    assert (_flag(args, "--position-embedding-type"), _flag(args, "--max-position-embeddings"),
            _flag(args, "--normalization")) == ("learned_absolute", "2050", "LayerNorm")
    assert "--disable-bias-linear" not in args and "--rotary-base" not in args and "--swiglu" not in args
    config = _megatron_config(plan, args)
    assert config.add_bias_linear and config.normalization == "LayerNorm"
