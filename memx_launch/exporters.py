"""A plan in the words of other tools: Megatron-LM arguments, torchrun lines, MEMX_* variables.

Pure functions of a :class:`~memx_launch.plan.Plan`; nothing here imports torch. Whatever
the target cannot express (per-stage recompute in Megatron-LM, for one) comes back as a
note next to the arguments instead of being dropped silently.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from memx_launch.errors import ConfigError
from memx_launch.plan import RECOMPUTE_LEVELS, Plan
from memx_launch.specs import ClusterSpec

DEFAULT_MASTER_PORT = 29500


@dataclass
class Export:
    """Arguments for one tool plus what they could not say."""

    args: list[str]
    notes: list[str] = field(default_factory=list)

    def command_line(self) -> str:
        return shlex.join(self.args)


# --------------------------------------------------------------------------- Megatron-LM


def stage_chunks(num_layers: int, virtual_stages: int) -> list[int]:
    """Layers of each virtual chunk of one stage: as even as possible, larger chunks first."""
    base, extra = divmod(num_layers, virtual_stages)
    return [base + (1 if c < extra else 0) for c in range(virtual_stages)]


def pipeline_layout(plan: Plan) -> str:
    """Megatron-Core ``--pipeline-model-parallel-layout`` of the plan's uneven split.

    The string lists pp * v chunks separated by ``|``, virtual-stage major (chunk k sits on
    pipeline rank k mod pp), ``E`` the embedding, ``t*N`` N decoder layers, ``L`` the loss
    head: 8 then 24 layers over two stages read ``Et*8|t*24L``.
    """
    v = plan.virtual_stages
    per_stage = [stage_chunks(s.num_layers, v) for s in plan.stages]
    chunks = []
    for vpp in range(v):
        for pp_rank in range(plan.pp):
            n = per_stage[pp_rank][vpp]
            chunks.append(f"t*{n}" if n > 1 else "t" * n)
    chunks[0] = "E" + chunks[0]
    chunks[-1] = chunks[-1] + "L"
    return "|".join(chunks)


def _megatron_recompute(plan: Plan) -> tuple[list[str], list[str]]:
    levels = [s.recompute for s in plan.stages]
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
    if strongest == "selective":
        notes.append("selective recompute maps to Megatron's default recompute module (core_attn); "
                     "memx's selective level also recomputes the SwiGLU activation")
        return ["--recompute-granularity", "selective"], notes
    # Uniform with one layer per unit checkpoints every layer's input: memx's "full".
    return ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"], notes


def megatron_args(plan: Plan) -> Export:
    """Megatron-LM training arguments for the plan's parallel layout, batch and recompute.

    The uneven layer split always goes through ``--pipeline-model-parallel-layout``, which
    also fixes the virtual-stage count (Megatron derives it from the number of chunks), so
    ``--num-layers-per-virtual-pipeline-stage`` is never given alongside it.
    """
    spec = plan.model_spec
    args = ["--num-layers", str(spec.num_layers),
            "--tensor-model-parallel-size", str(plan.tp),
            "--pipeline-model-parallel-size", str(plan.pp)]
    notes = []
    if plan.pp > 1:
        args += ["--pipeline-model-parallel-layout", pipeline_layout(plan)]
        if plan.virtual_stages > 1 and plan.num_microbatches % plan.pp:
            notes.append(f"{plan.num_microbatches} micro-batches is not a multiple of pp={plan.pp}; "
                         "older Megatron-LM releases reject that with the interleaved schedule")
    args += ["--micro-batch-size", str(plan.micro_batch_size),
             "--global-batch-size", str(plan.global_batch_size),
             "--seq-length", str(plan.seq_len)]
    recompute_args, recompute_notes = _megatron_recompute(plan)
    args += recompute_args
    notes += recompute_notes
    if len({s.device_type for s in plan.stages}) > 1:
        notes.append("stages run on different device types; Megatron-LM itself does not know, the "
                     "placement comes from the rank order of the torchrun commands")
    return Export(args, notes)


# --------------------------------------------------------------------------- torchrun


def torchrun_commands(plan: Plan, cluster: ClusterSpec, script: str, script_args: list[str] = (),
                      *, master_addr: str = "localhost", master_port: int = DEFAULT_MASTER_PORT,
                      plan_path: str | None = None) -> list[Export]:
    """One ``torchrun`` command per node of the cluster, in node order.

    The static rendezvous with ``--node-rank`` keeps global ranks in the cluster file's
    order (ranks are handed out by cumulative ``--nproc-per-node``), which is the order the
    plan's stages were placed in; nodes may have different device counts.
    """
    if cluster.world_size != plan.world_size:
        raise ConfigError("--cluster", f"{cluster.name} has {cluster.world_size} devices but the "
                          f"plan needs tp*pp*dp={plan.world_size}", "pass the cluster the plan was made for")
    ranks = cluster.rank_device_types()
    for i, stage in enumerate(plan.stages):
        wrong = [r for r in stage.ranks if ranks[r] != stage.device_type]
        if wrong:
            raise ConfigError(f"plan.stages[{i}].ranks", f"rank {wrong[0]} is a {ranks[wrong[0]]} "
                              f"in {cluster.name}, not a {stage.device_type}",
                              "pass the cluster the plan was made for")
    exports = []
    nnodes = len(cluster.nodes)
    for node_rank, node in enumerate(cluster.nodes):
        args = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(node.num_devices),
                "--node-rank", str(node_rank), "--rdzv-backend", "static",
                "--master-addr", master_addr, "--master-port", str(master_port),
                script, *script_args]
        notes = [f"run on {node.name}"] if nnodes > 1 else []
        if plan_path:
            notes.append(f"export MEMX_PLAN={shlex.quote(plan_path)} (and the other MEMX_* variables) "
                         "so the script can read the plan")
        exports.append(Export(args, notes))
    return exports


# --------------------------------------------------------------------------- environment


def plan_env(plan: Plan, plan_path: str | None = None) -> dict[str, str]:
    """``MEMX_*`` variables for scripts that do not import memx (comma lists, one per stage)."""
    env = {
        "MEMX_MODEL": plan.model,
        "MEMX_TP": str(plan.tp),
        "MEMX_PP": str(plan.pp),
        "MEMX_DP": str(plan.dp),
        "MEMX_MICRO_BATCH_SIZE": str(plan.micro_batch_size),
        "MEMX_GLOBAL_BATCH_SIZE": str(plan.global_batch_size),
        "MEMX_NUM_MICROBATCHES": str(plan.num_microbatches),
        "MEMX_SEQ_LEN": str(plan.seq_len),
        "MEMX_SCHEDULE": plan.schedule,
        "MEMX_VIRTUAL_STAGES": str(plan.virtual_stages),
        "MEMX_LAYERS_PER_STAGE": ",".join(str(s.num_layers) for s in plan.stages),
        "MEMX_RECOMPUTE_PER_STAGE": ",".join(s.recompute for s in plan.stages),
        "MEMX_STAGE_DEVICE_TYPES": ",".join(s.device_type for s in plan.stages),
    }
    if plan_path:
        env["MEMX_PLAN"] = plan_path
    return env


def env_lines(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
