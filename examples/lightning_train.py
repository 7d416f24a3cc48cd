"""Train a LightningModule with memx's callback: 2-process DDP on the CPU, each process an emulated
small device (examples/clusters/cpu-emulated-ddp.yaml), so that the model fits only with some
blocks checkpointed.

    python examples/lightning_train.py                  # plan, train, log memory vs prediction
    python examples/lightning_train.py --resume --steps 12   # continue from last.ckpt with the same plan
    python examples/lightning_train.py --strategy ddp_fork   # processes forked from this one, not started anew

At fit start MemxCallback calibrates a copy of the model's own block on each device type, decides
how many blocks recompute their activations and the micro-batch size, and applies it; every
``--log-every`` steps it writes measured against predicted peak memory to the CSVLogger's
metrics.csv (``memx/stage0/peak_gib``, ``memx/stage0/predicted_gib``): ROOT/logs/version_0 for
the first run, version_1 for the first resume, and so on. The model is
examples/train_own_model.py's, shaped by examples/models/lightning-gpt/config.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import Dataset

from memx_callbacks import MemxCallback
from memx_launch.specs.cluster import ClusterSpec
from train_own_model import build

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "models", "lightning-gpt")
CLUSTER = os.path.join(HERE, "clusters", "cpu-emulated-ddp.yaml")
SEQ_LEN, VOCAB = 64, 128


class CountingTokens(Dataset):
    """Sequences that count up from a seeded start (mod the vocabulary): a pattern the loss can learn."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        start = torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(i)).item()
        return (start + torch.arange(SEQ_LEN + 1)) % VOCAB


class LitGPT(L.LightningModule):
    def __init__(self, batch_size: int = 8, lr: float = 3e-3):
        super().__init__()
        self.batch_size = batch_size  # memx may lower it (gradient accumulation keeps the global batch)
        self.lr = lr
        self.model = build(MODEL, seed=0)

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(CountingTokens(), batch_size=self.batch_size)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--root", default="runs/lightning-example", help="logs, checkpoints, profile and plan")
    p.add_argument("--resume", action="store_true", help="continue from ROOT/checkpoints/last.ckpt")
    p.add_argument("--cluster", default=CLUSTER, help="cluster file: one process per device it declares")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "ddp_fork"),
                   help="Lightning's DDP launch: ddp runs this script again for each other process (default), "
                   "ddp_fork forks this one (no second import of Lightning: seconds here)")
    args = p.parse_args()
    torch.set_num_threads(1)
    ckpt = os.path.join(args.root, "checkpoints", "last.ckpt")
    if args.resume and not os.path.exists(ckpt):
        print(f"lightning_train.py: error: --resume: no checkpoint at {ckpt}; run once without --resume",
              file=sys.stderr)
        return 2
    trainer = L.Trainer(
        accelerator="cpu", devices=ClusterSpec.from_yaml(args.cluster).world_size, strategy=args.strategy,
        max_steps=args.steps, default_root_dir=args.root,
        # version=None: each run (a resume too) logs to the next logs/version_N; CSVLogger deletes
        # the metrics.csv of a version it is given again
        logger=CSVLogger(args.root, name="logs", version=None), enable_progress_bar=False, log_every_n_steps=1,
        callbacks=[MemxCallback(args.cluster, model=MODEL, log_every_n_steps=args.log_every),
                   ModelCheckpoint(os.path.join(args.root, "checkpoints"), save_last=True, every_n_train_steps=2)])
    trainer.fit(LitGPT(), ckpt_path=ckpt if args.resume else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
