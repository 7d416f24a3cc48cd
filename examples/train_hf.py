"""Train a Hugging Face causal LM (Llama, Mistral, Qwen2, Gemma, GPT-2, OPT, Phi: any
``AutoModelForCausalLM``) with the plan memx chose: your model, optimizer, LR schedule, loss and
gradient clipping; memx cuts the model into the plan's stages.

    memx-run --nproc-per-node 4 --cluster examples/clusters/cpu-emulated.yaml \\
        examples/train_hf.py --model examples/models/hf-llama-tiny
    memx-run --nproc-per-node 4 --cluster examples/clusters/cpu-two-vendors.yaml \\
        examples/train_hf.py --model examples/models/hf-gpt2-tiny      # tied embeddings, two vendors
    python examples/train_hf.py --reference --model examples/models/hf-llama-tiny   # one process

The model is built from its config.json with random weights (seeded, so every rank builds the same
one); load pretrained weights the same way on every rank before ``prepare``. memx-run plans for the
shape in the config (``--model`` is read by memx-run and by this script). A model whose head shares
the embedding's weight (GPT-2, Qwen2-0.5B, Gemma) keeps a copy on the first and the last stage and
memx sums their gradients every step. ``--reference`` trains the whole model in this one process,
with the same batches, as the check that the plan changes nothing but where the work runs. Needs
``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "hf-llama-tiny")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def warmup(optimizer: torch.optim.Optimizer, steps: int = 10):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / steps))


def batch(step: int, rows: int, seq_len: int, vocab: int):
    """The same global batch on every rank (a step-seeded generator); each rank keeps its share."""
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def build(model_dir: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def reference(model, args, vocab: int, seq_len: int) -> int:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = warmup(optimizer)
    for step in range(args.steps):
        tokens, targets = batch(step, args.global_batch_size, args.seq_len or seq_len, vocab)
        out = model(tokens)
        reference_step(step, loss_fn(getattr(out, "logits", out), targets), model, optimizer, scheduler,
                       args.max_grad_norm)
    return 0


def reference_step(step: int, loss: torch.Tensor, model, optimizer, scheduler, max_grad_norm: float) -> None:
    """The rest of one step of the one-process reference: backward, clipping, optimizer and
    scheduler, and the line memx's progress lines are compared with."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    print(f"step {step + 1} | loss {loss.item():.6f} (reference, one process)", flush=True)


def main(build_model=build, doc: str = __doc__, default_model: str = DEFAULT_MODEL) -> int:
    """Parse the arguments, build the model, train it with memx (or alone with --reference)."""
    from memx_launch.specs.catalog import get_model

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model, help="folder of the model's config.json (memx-run plans for it)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", action="store_true", help="train in this one process, without memx")
    p.add_argument("--global-batch-size", type=int, default=16, help="--reference only (memx-run's plan sets it)")
    p.add_argument("--seq-len", type=int, help="--reference only (default: the config's)")
    args = p.parse_args()
    shape = get_model(args.model)
    model = build_model(args.model, args.seed)
    if args.reference:
        return reference(model, args, shape.vocab_size, shape.seq_len)

    import torch.distributed as dist

    import memx_launch
    from memx_launch.errors import MemxError

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    try:
        job = memx_launch.prepare(model, optimizer, loss_fn=loss_fn, lr_scheduler=warmup,
                                  max_grad_norm=args.max_grad_norm)
    except MemxError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    plan = job.plan
    if dist.get_rank() == 0:
        print(f"training {type(model).__name__} ({args.model}) with tp={plan.tp} pp={plan.pp} dp={plan.dp} "
              f"mbs={plan.micro_batch_size} {plan.training.get('dtype', 'fp32')}; layers {[s.num_layers for s in plan.stages]}, recompute "
              f"{[s.recompute for s in plan.stages]}", flush=True)
    while job.step_count < args.steps:
        tokens, targets = batch(job.step_count, plan.global_batch_size, plan.seq_len, shape.vocab_size)
        stats = job.step(job.local_batch(tokens), job.local_batch(targets))
        if dist.get_rank() == 0:
            print(job.progress_line(stats), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
