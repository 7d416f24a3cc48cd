"""Hugging Face families split by TP with Transformers' own plan for them (models/hf_tensor_parallel.py):
the planner and the runtime agree on which, and a split model gives the unsplit one's logits and gradients."""

import os

import pytest
import torch

from memx_launch.models.adapters import ModelParts
from memx_launch.specs.catalog import get_model
from memx_launch.specs.hf_family_keys import TP_MODEL_TYPES
from benchmarks import hf_block_memory
from ranks import spawn_ranks

pytest.importorskip("transformers")

# Options of listed families that put weights the plan leaves whole where they see a rank's heads or
# width, and a listed family's mixture: trained with TP 1.
NOT_SPLIT_VARIANTS = {"cohere": dict(use_qk_norm=True), "phi": dict(qk_layernorm=True),
                      "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=96)}
# Gemma 4's E layout: layers reusing earlier layers' keys and values (no k and v projections), global
# layers twice as wide per head with their own KV heads and k as v (no v projection).
GEMMA_4_SHARED_KV = dict(num_hidden_layers=4, num_kv_shared_layers=2, attention_k_eq_v=True,
                         layer_types=["sliding_attention", "full_attention"] * 2)


def _model(kind: str, **fields):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_block_memory.family_config(kind, **fields))


@pytest.mark.parametrize("kind, fields, split", [*((k, {}, k in TP_MODEL_TYPES) for k in hf_block_memory.FAMILIES),
                                                 *((k, f, False) for k, f in NOT_SPLIT_VARIANTS.items()),
                                                 ("gemma4_text", GEMMA_4_SHARED_KV, True)])
def test_the_planner_plans_tp_for_the_families_the_runtime_splits(kind, fields, split, tmp_path):
    config = hf_block_memory.family_config(kind, **fields)
    config.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    assert ModelParts(AutoModelForCausalLM.from_config(config)).tensor_parallel == split, kind
    assert get_model(str(tmp_path)).tensor_parallel_blocks == split, kind


def _tp_worker(rank, port, kinds, queue):
    """Each family's model at TP 2 (one stage, selective recompute) against the same model in this
    process: the largest differences of its logits and of every parameter's gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = []
    try:
        mesh = init_device_mesh("cpu", (2,))
        x = torch.randint(1, hf_block_memory.SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
        for kind, fields in kinds:
            runs = []
            for tp in (1, 2):
                parts = ModelParts(_model(kind, **fields))
                stage = parts.stage(0, parts.num_layers, first=True, last=True, recompute="selective")
                if tp == 2:
                    parts.apply_tensor_parallel(stage, mesh)
                logits = stage(x)
                logits.square().mean().backward()
                runs.append((logits.detach(), {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                                               for n, p in stage.named_parameters() if p.grad is not None}))
            (ref, ref_grads), (got, grads) = runs
            scale = max(float(g.abs().max()) for g in ref_grads.values())
            results.append((float((got - ref).abs().max() / ref.abs().max()),
                            max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()) / scale,
                            len(grads) == len(ref_grads)))
    finally:
        queue.put((rank, results))
        dist.destroy_process_group()


@pytest.mark.slow
def test_families_split_by_tp_give_the_unsplit_model_s_logits_and_gradients():
    """Qwen3's, Gemma 3's and Gemma 4's per-head query and key norms see a rank's heads: their
    gradients must be summed over the TP group, or each rank steps its norm weights on half of
    theirs. Gemma 2's soft-capped attention, its own, runs on a rank's heads as on all of them.
    GPT-NeoX's and CodeGen's fused q, k, v projections hold whole heads per rank. Gemma 4's layers
    reusing earlier layers' keys and values read the keys and values of this rank's heads."""
    kinds = [(kind, {}) for kind in hf_block_memory.FAMILIES if kind in TP_MODEL_TYPES]
    assert len(kinds) == len(TP_MODEL_TYPES)  # every family listed is checked here
    kinds.append(("gemma4_text", {**GEMMA_4_SHARED_KV, "num_global_key_value_heads": 2}))
    results = spawn_ranks(_tp_worker, 2, kinds, timeout=300)
    for rank in range(2):
        for kind, (logits, grads, every_gradient) in zip(kinds, results[rank]):
            # Rounding reaches 1e-5 of the largest gradient (Gemma 4's embedding, four layers down); a
            # gradient left unsummed over the group is off by 1e-3 or more (Apertus's xIELU weights: 1e-2).
            assert logits < 1e-5 and grads < 1e-4 and every_gradient, (kind, rank, logits, grads)


def test_a_tp_degree_that_splits_a_layer_s_heads_is_refused_naming_the_layer():
    """Gemma 4's global layers may have fewer KV heads than its others (here 1): TP 2 would split
    one across ranks."""
    from memx_launch.errors import ConfigError
    from memx_launch.models.hf_tensor_parallel import split_blocks

    class TwoRanks:
        def size(self):
            return 2

    parts = ModelParts(_model("gemma4_text", **GEMMA_4_SHARED_KV, num_global_key_value_heads=1))
    assert parts.tensor_parallel
    with pytest.raises(ConfigError, match="tp: 2 does not divide the 1 heads of block 1's self_attn.k_proj"):
        split_blocks(parts.blocks, TwoRanks(), parts.tp_plan)
