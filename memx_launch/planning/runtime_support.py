"""What memx's runtime runs: the models and plans it trains, and a one-line refusal that points
elsewhere for the rest. Pure Python on the Plan (no torch), so the planner can say it too.
"""

from __future__ import annotations

from dataclasses import replace

from memx_launch.errors import ConfigError
from memx_launch.planning.model_states import keeps_gathered
from memx_launch.planning.plan import Plan
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def runnable_model(model: ModelSpec, field: str = "--model",
                   instead: str = "plan it with memx plan and run it with Megatron-LM (memx export)") -> ModelSpec:
    """``model`` where memx's runtime can train it: not a hybrid model (calibration measures one block,
    its layers are of several kinds). Multi-token prediction it leaves out (:func:`as_memx_run_trains`);
    experts, latent attention and an attention output gate (AFMoE's) it trains in the user's own module,
    which memx's LLaMA does not build (runtime/launcher.py): a mixture each expert whole
    (:func:`check_runnable`), its dense blocks among its expert ones too (calibration measures its first
    expert block, the dense ones are priced beside it: ``extra_blocks.first_repeated_block``).
    ``instead``: the refusal's way to run it elsewhere."""
    if model.hybrid_pattern:
        raise ConfigError(field, f"{model.name} has Mamba, Gated DeltaNet and lone attention or MLP layers, which "
                          "memx's runtime does not run", instead)
    return model


def as_memx_run_trains(model: ModelSpec) -> ModelSpec:
    """``model`` as memx's runtime trains it: without its multi-token prediction modules, which the
    models it trains do not build (memx's LLaMA has none; Transformers drops their weights on load)."""
    return replace(model, mtp_layers=0) if model.mtp_layers else model


def tp_one_blocks(model: ModelSpec, builder: bool = False) -> str | None:
    """The flag naming blocks memx's runtime has no tensor-parallel plan for, which train with TP 1:
    ``--model-builder`` (the user's own block), ``--model`` (a family other than Llama's, a
    mixture's); None where memx splits the blocks by TP."""
    return "--model-builder" if builder else None if model.tensor_parallel_blocks else "--model"


def tp_one_restriction(tp_degrees, blocks: str | None) -> tuple[int, ...] | None:
    """The TP degrees memx's runtime searches where ``blocks`` (:func:`tp_one_blocks`) train with
    TP 1, which ``tp_degrees`` (the ``--tp`` given, or None) must hold; ``tp_degrees`` unchanged
    where ``blocks`` is None."""
    return _degree_one("--tp", "TP", tp_degrees, None if blocks is None else f"the {blocks} blocks train with")


def one_stage_blocks(model: ModelSpec) -> str | None:
    """What makes memx's runtime train ``model``'s blocks on one pipeline stage holding them all:
    per-layer inputs made from the token ids, which only the first stage has (Gemma 4's E models,
    whose later layers also reuse earlier layers' keys and values: models/adapters.py); None where
    it splits them."""
    return "per-layer inputs made from the token ids" if model.per_layer_input_size else None


def one_stage_restriction(pipeline_degrees, why: str | None) -> tuple[int, ...] | None:
    """The pipeline degrees memx's runtime searches where a model's blocks train on one stage
    (``why``: :func:`one_stage_blocks`), which ``pipeline_degrees`` (``--pp``, or None) must hold."""
    return _degree_one("--pp", "PP", pipeline_degrees, None if why is None else f"blocks with {why} train with")


def _degree_one(flag: str, name: str, degrees, why: str | None) -> tuple[int, ...] | None:
    """(1,) where ``why`` says only degree 1 runs, which ``degrees`` (the flag's, or None) must hold;
    ``degrees`` unchanged where ``why`` is None."""
    if why is None:
        return degrees
    if 1 not in (degrees or (1,)):
        raise ConfigError(flag, f"{list(degrees)} leaves out {name} 1, the only degree {why}",
                          f"drop {flag} or include 1")
    return (1,)


def check_runnable(plan: Plan) -> Plan:
    """``plan`` where memx's runtime can run it; a one-line refusal otherwise, pointing to
    Megatron-LM, which cannot run a plan across communication domains: such a plan is sent to
    one domain's devices first (``Plan.within_one_domain``)."""
    instead = ("run the plan with Megatron-LM (memx export)" if not plan.crossings else
               "plan it on one communication domain's devices (it crosses domains) and run it with Megatron-LM "
               "(memx export)")
    empty = [i for i, s in enumerate(plan.stages) if s.num_layers == 0]
    if empty:  # memx's stages are built around their blocks (models/adapters.py)
        raise ConfigError("--plan", f"stage {empty[0]} holds no layers (an embedding-only or head-only stage), "
                          "which memx's runtime does not run", f"give every stage a layer, or {instead}")
    runnable_model(plan.model_spec, "--plan", instead)
    if plan.model_spec.mtp_layers:
        raise ConfigError("--plan", f"it prices {plan.model_spec.mtp_layers} multi-token prediction module(s), which "
                          "memx's runtime does not train (the model it trains has none)",
                          f"plan with --setup memx-run, or {instead}")
    one_stage = one_stage_blocks(plan.model_spec)
    if one_stage and plan.pp > 1:
        raise ConfigError("--plan", f"pp={plan.pp}: {plan.model_spec.name}'s blocks take {one_stage}, which memx's "
                          "runtime trains on one pipeline stage holding every block", f"plan with --pp 1, or {instead}")
    experts = plan.training.get("expert_parallel", 1) * plan.training.get("expert_tensor_parallel", 1)
    if plan.model_spec.num_experts and (max(plan.stage_tps) > 1 or experts > 1):
        raise ConfigError("--plan", f"tp={plan.tp or plan.stage_tp}, expert parallelism over {experts} rank(s): memx's "
                          "runtime trains a mixture of experts as its own module, every expert whole on each rank "
                          "(TP 1, EP 1)", f"plan with --tp 1 --expert-parallel 1, or {instead}")
    short = [i for i, s in enumerate(plan.stages) if s.num_layers < plan.virtual_stages]
    if short:  # an interleaved end stage with a chunk of the embedding or the head alone
        raise ConfigError("--plan", f"stage {short[0]} holds fewer layers than its {plan.virtual_stages} chunks, "
                          "which memx's runtime does not run", f"give every chunk a layer, or {instead}")
    if plan.training.get("recompute_modules"):
        raise ConfigError("--plan", f"recompute_modules={','.join(plan.training['recompute_modules'])}: memx's "
                          "runtime recomputes its own selective level",
                          f"plan without --recompute-modules, or {instead}")
    if plan.cp > 1:
        raise ConfigError("--plan", f"cp={plan.cp}: memx's runtime has no context parallelism",
                          f"plan with --cp 1, or {instead}")
    training = TrainingSpec(**plan.training)
    if training.fully_sharded and plan.dp > 1 and not keeps_gathered(training, plan.pp):
        raise ConfigError("--plan", f"hold_gathered={training.hold_gathered} with {plan.pp} stage(s): memx's runtime "
                          "keeps a fully sharded stage's weights gathered and its gradients unsharded through the "
                          "step (torch's pipeline schedules), more memory than the plan counts",
                          f"plan with --setup memx-run (or --hold-gathered always), or {instead}")
    if training.shard_degree is not None and not training.fully_sharded:
        raise ConfigError("--plan", f"shard_degree={training.shard_degree} with a sharded optimizer: memx's runtime "
                          "shards with FSDP2 only", f"plan with --fully-sharded (FSDP2's HSDP), or {instead}")
    plan.uniform_dp("memx's runtime (one DP degree for all stages)")
    return plan
