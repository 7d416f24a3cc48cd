"""Tensor parallelism of a Hugging Face model's blocks as its config declares it.

Transformers gives each family a TP plan (``config.base_model_tp_plan``: module path -> style).
memx-run applies a block's entries where they are Megatron's split, the one its cost model prices:
q, k, v (and gate and up) column-wise, the attention output and the MLP's down projection
row-wise, so each rank holds whole heads and its share of the MLP width, and a per-head query or
key norm replicated with its gradients summed over the TP group. Not where the plan has other
styles (an output gathered after a column-wise split, packed or expert-parallel experts, latent
attention's projections), where a block holds routed experts (the plan leaves them whole on every
rank) or weights the plan does not name beside the ones it splits (they would see a rank's share
and step on it: Apertus's activation, Cohere's per-head norms), nor for a family memx has not
checked against its unsplit model (``specs.hf_family_keys.TP_MODEL_TYPES``): those train with TP 1.
"""

from __future__ import annotations

from torch import nn

from memx_launch.errors import ConfigError
from memx_launch.specs.hf_family_keys import TP_MODEL_TYPES

MEGATRON_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def block_tp_plan(config, blocks_name: str, blocks: list[nn.Module]) -> dict[str, str] | None:
    """The blocks' entries of the config's TP plan (module path inside a block -> style), None
    where memx does not split them by it (the module docstring)."""
    prefix = f"{blocks_name}.*."
    plan = {key[len(prefix):]: style for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items()
            if key.startswith(prefix)}
    if config.model_type not in TP_MODEL_TYPES or not plan or any(s not in MEGATRON_STYLES for s in plan.values()):
        return None
    modules = [dict(block.named_modules()) for block in blocks]
    if any(all(path not in each for each in modules) for path in plan):
        return None
    return plan if all(_split_as_planned(block, plan, each) for block, each in zip(blocks, modules)) else None


def _split_as_planned(block: nn.Module, plan: dict[str, str], modules: dict[str, nn.Module]) -> bool:
    """No routed experts are in ``block``, and every weight inside the modules the plan splits
    (``self_attn``, ``mlp``) belongs to a planned module. A planned module a block lacks is not
    split there (Gemma 4's layers that reuse earlier layers' keys and values have no k and v
    projections, its global layers with ``attention_k_eq_v`` no v projection)."""
    if any(n.rsplit(".", 1)[-1] == "experts" for n in modules):
        return False
    split = {path.rsplit(".", 1)[0] for path in plan if "." in path}
    for name, _ in block.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if _within(owner, split) and not _within(owner, plan):
            return False
    return True


def _within(path: str, modules) -> bool:
    return any(path == m or path.startswith(m + ".") for m in modules)


def split_blocks(blocks, tp_mesh, plan: dict[str, str]) -> None:
    """Each block split by ``plan`` over ``tp_mesh``: every rank whole heads of each column-split
    projection (a layer's own head width: Gemma 4's global layers are wider) and an equal share of
    every other column-split width."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tp = tp_mesh.size()
    # The plan's modules each block has (a planned module a block lacks is not split there).
    present = [{path: style for path, style in plan.items() if path in modules}
               for modules in (dict(block.named_modules()) for block in blocks)]
    for i, (block, planned) in enumerate(zip(blocks, present)):
        for path in (path for path, style in planned.items() if style == "colwise"):
            linear = block.get_submodule(path)
            unit = getattr(block.get_submodule(path.rsplit(".", 1)[0]), "head_dim", 1) if "." in path else 1
            if linear.out_features % (tp * unit):
                raise ConfigError("tp", f"{tp} does not divide the {linear.out_features // unit} "
                                  f"{'heads' if unit > 1 else 'features'} of block {i}'s {path}",
                                  "choose a TP degree that divides each layer's heads")
    # A per-head norm sees this rank's heads ([b, s, heads, head_dim]): its weight replicated, its
    # gradients summed over the group, as Transformers' replicated_with_grad_allreduce and torchtitan's.
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True)}
    for block, planned in zip(blocks, present):
        parallelize_module(block, tp_mesh, {path: styles[style]() for path, style in planned.items()})
