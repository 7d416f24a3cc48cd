"""The user's batches on one rank: their two forms, this DP replica's rows, and the loss over them.

Two forms reach ``Runtime.step``:

- ``(inputs, targets)`` tensors (or ``step(inputs, targets)``): targets aligned with the model's
  outputs (already shifted), each micro-batch's loss averaged over the micro-batches, as before;
- a dict in Hugging Face's names: ``input_ids``, optional ``attention_mask`` (1 = token, 0 =
  padding) and ``labels`` (unshifted, -100 where no loss is taken; default: ``input_ids`` with
  -100 where the mask is 0). The default loss shifts them as ``*ForCausalLM`` does and is the mean
  over every labelled token of the global batch, however the padding falls across micro-batches
  and DP replicas, so that it equals one process's loss on the whole batch.

:class:`ReplicaBatches` (``job.data``) turns the user's DataLoader, or any iterable yielding one
global batch at a time, into this DP replica's rows of each: every rank of a pipeline / TP group
gets the same rows, each replica its own slice (accelerate's ``split_batches``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from memx_launch.errors import ConfigError

log = logging.getLogger("memx")

IGNORE_INDEX = -100  # torch's cross entropy and Hugging Face's labels skip it
BATCH_KEYS = ("input_ids", "attention_mask", "labels")


def default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over the micro-batch's tokens (targets already shifted)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def shifted_token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the labelled tokens, position t predicting label t + 1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass
class StepBatch:
    """One step's batch on this rank, whatever form it came in."""

    inputs: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None
    labelled: bool
    """A dict batch: HF labels (unshifted), the default loss weighting every labelled token alike."""

    def labelled_tokens(self) -> int:
        return int((self.targets[:, 1:] != IGNORE_INDEX).sum())


def step_batch(batch, targets: torch.Tensor | None, rows: int, takes_mask: bool) -> StepBatch:
    """``batch`` (with ``targets`` for the tuple form) checked against this replica's ``rows``.
    ``takes_mask``: the model's blocks take a padding mask (else only right padding is accepted,
    which a causal model does not need masked)."""
    if isinstance(batch, dict):
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if "input_ids" not in batch or unknown:
            problem = f"unknown keys {unknown}" if unknown else "no 'input_ids'"
            raise ConfigError("batch", f"a dict batch has {problem}", f"give only {', '.join(BATCH_KEYS)}")
        inputs, mask = batch["input_ids"], batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = inputs if mask is None else inputs.masked_fill(mask == 0, IGNORE_INDEX)
        for name, t in (("attention_mask", mask), ("labels", labels)):
            if t is not None and t.shape != inputs.shape:
                raise ConfigError(f"batch.{name}", f"shape {tuple(t.shape)} is not input_ids' {tuple(inputs.shape)}",
                                  "give one value per token")
        step = StepBatch(inputs, labels, _needed_mask(mask, takes_mask), True)
    elif isinstance(batch, (tuple, list)) and targets is None and len(batch) == 2:
        step = StepBatch(batch[0], batch[1], None, False)
    elif isinstance(batch, torch.Tensor) and targets is not None:
        step = StepBatch(batch, targets, None, False)
    else:
        got = type(batch).__name__ + (" and targets" if targets is not None else "")
        raise ConfigError("batch", f"step() got {got}", "pass a dict with input_ids (attention_mask, labels), an (inputs, targets) pair, or "
                          "step(inputs, targets)")
    if len(step.inputs) != rows:
        raise ConfigError("batch", f"{len(step.inputs)} rows where this DP replica takes {rows} per step",
                          "iterate job.data, or pass job.local_batch(global_batch)")
    return step


def _needed_mask(mask: torch.Tensor | None, takes_mask: bool) -> torch.Tensor | None:
    """The mask when it changes what the labelled tokens see: not when every token is one, nor,
    for a model that takes no mask, with right padding (causal attention never looks ahead)."""
    if mask is None or bool(mask.all()):
        return None
    if takes_mask:
        return mask
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ConfigError("batch.attention_mask", "padding before tokens needs a padding mask in every block, "
                          "which memx passes only to Hugging Face Llama-family blocks",
                          "pad on the right (tokenizer.padding_side = 'right')")
    return None


class BatchLoss:
    """The pipeline's loss: the user's ``loss_fn`` (or :func:`default_loss`) on tuple batches; on
    dict batches the user's ``loss_fn(logits, labels)``, or the labelled tokens' sum scaled so
    that the pipeline's mean over micro-batches and DP's mean over replicas give the mean over the
    global batch's labelled tokens (:meth:`begin` sets the scale each step)."""

    def __init__(self, loss_fn: Callable | None):
        self.loss_fn = loss_fn
        self.labelled = False
        self.scale = 1.0

    def begin(self, batch: StepBatch, sum_over_job: Callable[[float], float], shares: int) -> None:
        """``sum_over_job(n)``: ``n`` summed over the ranks, called on every rank (the last stage's
        first TP rank of each replica counting); ``shares``: micro-batches x DP replicas."""
        self.labelled = batch.labelled
        if batch.labelled and self.loss_fn is None:
            self.scale = shares / max(sum_over_job(float(batch.labelled_tokens())), 1.0)

    def __call__(self, logits, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, tuple):  # a mixture's load-balancing term beside them (models/router_loss.py)
            logits, router_loss = logits
            return self(logits, targets) + router_loss
        if not self.labelled:
            return (self.loss_fn or default_loss)(logits, targets)
        if self.loss_fn is not None:
            return self.loss_fn(logits, targets)
        return shifted_token_sum(logits, targets) * self.scale


def replica_rows(batch, index: int, rows: int):
    """Rows [index * rows, (index + 1) * rows) of a tensor, or of each tensor of a dict or tuple."""
    if isinstance(batch, torch.Tensor):
        return batch[index * rows:(index + 1) * rows]
    if isinstance(batch, dict):
        return {k: replica_rows(v, index, rows) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(replica_rows(v, index, rows) for v in batch)
    raise ConfigError("batch", f"a {type(batch).__name__} has no rows to share out", "give tensors, or a dict or "
                      "tuple of tensors")


class ReplicaBatches:
    """``job.data``: this DP replica's rows of each global batch of ``data``.

    A DataLoader over a map-style dataset is rebuilt to load only this replica's rows: its sampler's
    indices are grouped into the plan's global batches (whatever its ``batch_size``: said once
    when it differs), the last partial batch is dropped (the plan's micro-batch count is fixed) and ``shuffle=True`` draws epoch e's order from the
    loader's generator seed (else ``seed``) plus e, the same on every rank. Iterating starts where
    ``job.step_count`` stands in the data (a job restarted by memx-run continues its epoch).
    Anything else (an IterableDataset, a generator) yields whole global batches on every rank,
    each keeping its rows; it is not skipped on a restart unless it has a length."""

    def __init__(self, data, runtime, seed: int = 0):
        self.data, self.runtime, self.seed = data, runtime, seed
        self.global_rows = runtime.plan.global_batch_size
        self.rows = runtime.local_batch_size
        self.replica = runtime.layout.dp_index
        self.map_style = isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset)
        if self.map_style:
            if isinstance(data.sampler, DistributedSampler):
                raise ConfigError("data", "the DataLoader has a DistributedSampler; memx shares each batch "
                                  "out over the DP replicas itself", "give it a plain (or shuffle=True) sampler")
            first_rank = not dist.is_initialized() or dist.get_rank() == 0
            if data.batch_size not in (None, self.global_rows) and first_rank:
                log.warning("memx: the DataLoader's batch_size %d is regrouped into the plan's global batches of "
                            "%d (memx-run --global-batch-size sets it)", data.batch_size, self.global_rows)

    def __len__(self) -> int:
        if self.map_style:
            return len(self._global_index_batches(0))
        return len(self.data)

    def __iter__(self):
        start = self.runtime.step_count
        if self.map_style:
            yield from self._map_style(start)
            return
        try:
            skip = start % len(self.data)
        except TypeError:
            skip = 0  # no length: no position to resume from
        for i, batch in enumerate(self.data):
            if i < skip:
                continue
            rows = len(batch["input_ids"] if isinstance(batch, dict) else batch[0])
            if rows != self.global_rows:
                raise ConfigError("data", f"a batch of {rows} rows where the plan's global batch has "
                                  f"{self.global_rows}", f"yield batches of {self.global_rows} rows")
            yield replica_rows(batch, self.replica, self.rows)

    def _global_index_batches(self, epoch: int) -> list[list[int]]:
        loader = self.data
        if loader.batch_size is None:  # the user's own batch sampler: each index list is a global batch
            batches = list(loader.batch_sampler)
        else:
            sampler = loader.sampler
            if isinstance(sampler, RandomSampler):
                base = sampler.generator.initial_seed() if sampler.generator is not None else self.seed
                sampler = RandomSampler(sampler.data_source, replacement=sampler.replacement,
                                        num_samples=sampler._num_samples,
                                        generator=torch.Generator().manual_seed(base + epoch))
            batches = list(BatchSampler(sampler, self.global_rows, drop_last=True))
        for b in batches[:-1]:
            if len(b) != self.global_rows:
                raise ConfigError("data.batch_sampler", f"a batch of {len(b)} indices where the plan's global batch "
                                  f"has {self.global_rows}", f"yield index lists of {self.global_rows}")
        return [b for b in batches if len(b) == self.global_rows]

    def _map_style(self, start: int):
        loader = self.data
        per_epoch = len(self._global_index_batches(0))
        if per_epoch == 0:
            raise ConfigError("data", f"fewer samples than the plan's global batch of {self.global_rows}",
                              "give more data or run memx-run --global-batch-size smaller")
        epoch, skip = divmod(start, per_epoch)
        mine = [b[self.replica * self.rows:(self.replica + 1) * self.rows]
                for b in self._global_index_batches(epoch)[skip:]]
        settings = dict(collate_fn=loader.collate_fn, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                        persistent_workers=loader.persistent_workers)
        if loader.num_workers:
            settings["prefetch_factor"] = loader.prefetch_factor
        yield from DataLoader(loader.dataset, batch_sampler=mine, **settings)
