"""Fine-tune a Hugging Face LlamaForCausalLM on padded, masked batches from your DataLoader.

    memx-run --nproc-per-node 4 --cluster examples/clusters/cpu-emulated.yaml \\
        examples/finetune_padded.py --model examples/models/hf-llama-tiny
    python examples/finetune_padded.py --reference --global-batch-size 16   # one process, the same batches

The samples are the lines of this repository's README as byte tokens, of every length up to the
plan's sequence length, padded to it (on the left by default, as Llama tokenizers pad) with an
``attention_mask`` (0 at padding) and ``labels`` (-100 at padding): the dict batches a Hugging
Face collator gives. ``memx_launch.prepare(..., data=loader)`` shares each global batch out over
the plan's DP replicas (``job.data``), passes the mask to every stage's blocks and takes the mean
loss over the labelled tokens of the whole global batch, so ``--reference`` (the model's own
``loss`` on each global batch in one process) prints the same losses. Needs ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader, RandomSampler

from train_hf import DEFAULT_MODEL, build, reference_step, warmup

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
PAD_ID = 0


def readme_lines(seq_len: int) -> list[torch.Tensor]:
    """Each non-empty line of the README as byte tokens, cut to ``seq_len``."""
    with open(README, "rb") as f:
        lines = [line.strip() for line in f]
    return [torch.tensor(list(line[:seq_len]), dtype=torch.long) for line in lines if len(line) > 1]


def pad(samples: list[torch.Tensor], seq_len: int, side: str = "left") -> dict[str, torch.Tensor]:
    """The collator: every sample padded to ``seq_len``, masked, and labelled only where it is a token."""
    input_ids = torch.full((len(samples), seq_len), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), seq_len), dtype=torch.long)
    for row, tokens in enumerate(samples):
        where = slice(seq_len - len(tokens), seq_len) if side == "left" else slice(0, len(tokens))
        input_ids[row, where], attention_mask[row, where] = tokens, 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def loader(batch_size: int, seq_len: int, seed: int, side: str) -> DataLoader:
    """Global batches in a seeded shuffled order (memx keeps a sampler's seed for the first epoch)."""
    samples = readme_lines(seq_len)
    return DataLoader(samples, batch_size=batch_size, sampler=RandomSampler(samples, generator=torch.Generator()
                      .manual_seed(seed)), collate_fn=lambda rows: pad(rows, seq_len, side))


def reference(model, args, seq_len: int) -> int:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = warmup(optimizer)
    for step, batch in enumerate(loader(args.global_batch_size, seq_len, args.seed, args.padding_side)):
        if step == args.steps:
            break
        # Hugging Face's loss: the mean over the labelled tokens
        reference_step(step, model(**batch).loss, model, optimizer, scheduler, args.max_grad_norm)
    return 0


def main() -> int:
    from memx_launch.specs.catalog import get_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="folder of the model's config.json (memx-run plans for it)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--padding-side", choices=("left", "right"), default="left")
    p.add_argument("--reference", action="store_true", help="train in this one process, without memx")
    p.add_argument("--global-batch-size", type=int, default=16,
                   help="the DataLoader's batch size (under memx-run the plan's global batch size is used)")
    args = p.parse_args()
    seq_len = get_model(args.model).seq_len
    model = build(args.model, args.seed)
    if args.reference:
        return reference(model, args, seq_len)

    import torch.distributed as dist

    import memx_launch
    from memx_launch.errors import MemxError

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    try:
        data = loader(args.global_batch_size, seq_len, args.seed, args.padding_side)  # regrouped to the plan's
        job = memx_launch.prepare(model, optimizer, data=data, lr_scheduler=warmup, max_grad_norm=args.max_grad_norm)
        while job.step_count < args.steps:  # epochs; job.data resumes where a restarted job stopped
            for batch in job.data:
                stats = job.step(batch)
                if dist.get_rank() == 0:
                    print(job.progress_line(stats), flush=True)
                if job.step_count == args.steps:
                    break
    except MemxError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
