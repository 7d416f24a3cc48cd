"""Train a LLaMA-style model with the plan memx chose for this job.

    memx-run --nproc-per-node 4 --cluster examples/clusters/cpu-emulated.yaml examples/train.py --model llama-tiny

Data: byte-level tokens of memx's own text (the README and docs beside this script in the
repository, and memx's sources wherever it is installed, so a copy of the script trains too), or
``--synthetic`` random tokens. Every rank draws the same global batch per
step from a step-seeded generator and takes its data-parallel share. Rank 0 prints one line per
step: loss, step time, tokens/s and per-stage peak memory and compute time, measured against
the plan's predictions. Under memx-run, ``runtime.step`` also watches memory and re-plans when
a device comes under pressure; the restarted job resumes at the next step (docs/replanning.md).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import torch
import torch.distributed as dist

import memx_launch.runtime
from memx_launch.errors import ConfigError, MemxError
from memx_launch.specs.catalog import get_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = os.path.dirname(os.path.abspath(memx_launch.__file__))


def corpus_tokens(vocab_size: int) -> torch.Tensor:
    """memx's text as bytes (vocab >= 256 needed): the repository's README and docs, where the
    script sits in it, and the installed package's sources, which are always there."""
    if vocab_size < 256:
        raise ConfigError("--model", f"vocab_size {vocab_size} is below 256 bytes", "use --synthetic")
    paths = sorted(glob.glob(os.path.join(REPO, "*.md")) + glob.glob(os.path.join(REPO, "docs", "*.md"))) \
        + sorted(glob.glob(os.path.join(SOURCES, "*.py")))
    data = b"".join(open(p, "rb").read() for p in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(corpus: torch.Tensor | None, step: int, rows: int, seq_len: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    if corpus is None:
        tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    else:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (rows,), generator=g)
        tokens = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()])
    return tokens[:, :-1], tokens[:, 1:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny", help="catalog name (memx-run plans for it)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--synthetic", action="store_true", help="random tokens instead of the repository text")
    p.add_argument("--checkpoint-dir", help="save here every --checkpoint-every steps and at the end")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    args = p.parse_args()
    try:
        runtime = memx_launch.runtime.from_env(lr=args.lr)
        plan = runtime.plan
        if get_model(args.model).signature() != plan.model_spec.signature():
            raise ConfigError("--model", f"{args.model} is not the plan's model {plan.model}",
                              "run the script with the model the plan was made for")
        if args.resume and not args.checkpoint_dir:
            raise ConfigError("--resume", "needs --checkpoint-dir", "pass the directory to resume from")
        # step_count > 0: memx-run already resumed this restarted job from its own checkpoint
        if args.resume and runtime.step_count == 0 and runtime.load_checkpoint(args.checkpoint_dir) is None:
            raise ConfigError("--resume", f"no checkpoint in {args.checkpoint_dir}", "check --checkpoint-dir")
        corpus = None if args.synthetic else corpus_tokens(plan.model_spec.vocab_size)
    except MemxError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return exc.exit_code
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"training {plan.model} with {plan.tp=} {plan.pp=} {plan.dp=} {plan.schedule} "
              f"{plan.num_microbatches} micro-batches of {plan.micro_batch_size}; layers "
              f"{[s.num_layers for s in plan.stages]}, recompute {[s.recompute for s in plan.stages]}"
              f"{' (emulated devices)' if plan.emulated else ''}", flush=True)
    while runtime.step_count < args.steps:
        tokens, targets = batch(corpus, runtime.step_count, plan.global_batch_size, plan.seq_len,
                                plan.model_spec.vocab_size)
        stats = runtime.step(runtime.local_batch(tokens), runtime.local_batch(targets))
        if rank0:
            print(runtime.progress_line(stats), flush=True)
        if args.checkpoint_dir and (runtime.step_count % args.checkpoint_every == 0 or runtime.step_count == args.steps):
            runtime.save_checkpoint(args.checkpoint_dir)
    if rank0:  # every step of the run, also those of the generations before a re-plan's restart
        print(f"done: {runtime.run_record.summary(runtime.step_count)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
