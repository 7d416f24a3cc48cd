"""Megatron-LM's arguments for a hybrid model, beside ``exporters.megatron_args``' for a
transformer: Nemotron-H's stack of Mamba, attention and MLP layers (pretrain_mamba.py's
``--hybrid-override-pattern``), or Qwen3-Next's GPT blocks whose mixer is Gated DeltaNet or
attention (``--experimental-attention-variant gated_delta_net``), and what a plan's split needs
that the arguments cannot say. No torch import."""

from __future__ import annotations

import itertools
from dataclasses import replace

from memx_launch.errors import ConfigError
from memx_launch.planning.layer_split import chunk_layers
from memx_launch.planning.plan import Plan
from memx_launch.specs.hybrid import layers_per_block
from memx_launch.specs.model import ModelSpec


def megatron_blocks(spec: ModelSpec) -> ModelSpec:
    """The model as Megatron-LM's GPT stack builds it: a Gated DeltaNet model's pairs of layers
    (a mixer, then its MLP) as blocks, each with the experts where its MLP layer has them
    (:func:`deltanet_args` says which); any other model as it is."""
    pattern = spec.hybrid_pattern
    if "G" not in pattern:
        return spec
    if layers_per_block(spec) != 2:
        raise ConfigError("model.hybrid_pattern", f"{pattern}: Megatron-LM runs Gated DeltaNet layers only in blocks "
                          "of a mixer (G or *) and an MLP (E or -)", "give such pairs, or plan without an export")
    return replace(spec, hybrid_pattern="", num_layers=len(pattern) // 2)


def deltanet_args(spec: ModelSpec) -> tuple[list[str], list[str]]:
    """Qwen3-Next's mixers for pretrain_gpt.py (Megatron-Core 0.16's names): which blocks run
    Gated DeltaNet (``--linear-attention-freq``: a period whose last block attends, else the list)
    and its sizes; which run the experts where not all do."""
    blocks = [spec.hybrid_pattern[i:i + 2] for i in range(0, len(spec.hybrid_pattern), 2)]
    linear = [int(b[0] == "G") for b in blocks]
    period = next((p for p in range(1, len(linear) + 1) if linear == [int((i + 1) % p != 0) for i in range(len(linear))]),
                  None)
    args = ["--experimental-attention-variant", "gated_delta_net",
            "--linear-attention-freq", str(period) if period else str(linear).replace(" ", ""),
            "--linear-num-key-heads", str(spec.linear_key_heads), "--linear-num-value-heads", str(spec.linear_value_heads),
            "--linear-key-head-dim", str(spec.linear_key_head_dim),
            "--linear-value-head-dim", str(spec.linear_value_head_dim),
            "--linear-conv-kernel-dim", str(spec.linear_conv_kernel)]
    experts = [int(b[1] == "E") for b in blocks]
    if spec.num_experts and not all(experts):
        args += ["--moe-layer-freq", str(experts).replace(" ", "")]
    return args, ["Gated DeltaNet blocks run FLA's chunked kernels (flash-linear-attention installed), whose chunk "
                  f"is 64 tokens (the plan priced {spec.linear_chunk_size}); add what memx does not count of the "
                  "model: Qwen3-Next's partial rotary share (--rotary-percent 0.25) and zero-centred norms "
                  "(--apply-layernorm-1p)"]


def split_notes_of(plan: Plan) -> list[str]:
    """What a hybrid model's split with more than one stage needs that the arguments cannot say.
    A Gated DeltaNet model's GPT blocks take the split in blocks (``exporters.pipeline_layout``),
    unless the plan cuts a block between its mixer and its MLP, which Megatron-LM cannot run.
    Megatron-LM's hybrid stack splits its layers evenly over the stages; another split (or
    chunks) is the pattern cut into its pp x v segments, which only builds whose pattern takes
    ``|`` between pipeline segments read. Nothing for a transformer."""
    pattern = plan.model_spec.hybrid_pattern
    if not pattern:
        return []
    per_stage = chunk_layers([s.num_layers for s in plan.stages], plan.virtual_stages).tolist()
    sizes = [per_stage[p][c] for c in range(plan.virtual_stages) for p in range(plan.pp)]
    ends = [0, *itertools.accumulate(sizes)]
    segments = "|".join(pattern[a:b] for a, b in zip(ends[:-1], ends[1:]))
    if "G" in pattern:
        if not any(n % 2 for n in sizes):
            return []
        return [f"the plan's chunks of {sizes} layers ({segments}) cut blocks between their mixer and their MLP, "
                "which Megatron-LM's GPT stack cannot run: give layers_per_stage in pairs"]
    if len(set(sizes)) == 1 and plan.virtual_stages == 1:
        return []
    return [f"Megatron-LM's hybrid stack splits the {len(pattern)} layers evenly over the {plan.pp} stages, "
            f"not in the plan's {plan.pp * plan.virtual_stages} chunks of {sizes}; a build whose "
            f"--hybrid-override-pattern takes '|' between pipeline segments runs the plan's split as {segments}"]


def mamba_stack_args(spec: ModelSpec) -> tuple[list[str], list[str]]:
    """Nemotron-H's stack for pretrain_mamba.py: its pattern and Mamba sizes."""
    args = ["--hybrid-override-pattern", spec.hybrid_pattern, "--mamba-num-heads", str(spec.mamba_heads),
            "--mamba-head-dim", str(spec.mamba_head_dim), "--mamba-state-dim", str(spec.mamba_state_size),
            "--mamba-num-groups", str(spec.mamba_groups),
            "--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    return args, ["a hybrid model: run these arguments with Megatron-LM's pretrain_mamba.py; its MLP layers' "
                  "activation is Megatron's default (GELU) unless you add yours (Nemotron-H: --squared-relu), "
                  f"and its scans take Megatron's chunk size where the plan priced {spec.mamba_chunk_size}"]
