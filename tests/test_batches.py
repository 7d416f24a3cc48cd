"""The user's batches (runtime/batches.py): dict and tuple forms, padding masks, each DP replica's
rows of a DataLoader's global batches, and the padded loss against one process's."""

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from memx_launch.errors import ConfigError
from memx_launch.runtime.batches import BatchLoss, ReplicaBatches, StepBatch, replica_rows, step_batch

IDS = torch.arange(24).reshape(4, 6)
LEFT = torch.tensor([[0, 0, 1, 1, 1, 1]] * 4)
RIGHT = LEFT.flip(1)


def test_a_dict_batch_without_labels_takes_the_tokens_with_padding_ignored():
    b = step_batch({"input_ids": IDS, "attention_mask": RIGHT}, None, 4, takes_mask=False)
    assert b.labelled and b.attention_mask is None  # right padding: causal attention never sees it
    assert (b.targets[:, 4:] == -100).all() and torch.equal(b.targets[:, :4], IDS[:, :4])
    assert b.labelled_tokens() == 4 * 3  # position 0 is never a label (shifted)


def test_a_padding_mask_reaches_the_model_only_where_it_changes_something():
    assert step_batch({"input_ids": IDS, "attention_mask": LEFT}, None, 4, takes_mask=True).attention_mask is LEFT
    assert step_batch({"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}, None, 4,
                      takes_mask=True).attention_mask is None
    with pytest.raises(ConfigError, match="batch.attention_mask.*padding_side = 'right'"):
        step_batch({"input_ids": IDS, "attention_mask": LEFT}, None, 4, takes_mask=False)


def test_tuple_batches_keep_their_targets_and_bad_batches_name_the_fix():
    pair = step_batch((IDS, IDS + 1), None, 4, takes_mask=False)
    assert not pair.labelled and torch.equal(pair.targets, IDS + 1)
    assert torch.equal(step_batch(IDS, IDS + 1, 4, takes_mask=False).targets, IDS + 1)
    with pytest.raises(ConfigError, match=r"batch: a dict batch has unknown keys \['pixel_values'\]"):
        step_batch({"input_ids": IDS, "pixel_values": IDS}, None, 4, takes_mask=False)
    with pytest.raises(ConfigError, match="batch.labels: shape"):
        step_batch({"input_ids": IDS, "labels": IDS[:, :3]}, None, 4, takes_mask=False)
    with pytest.raises(ConfigError, match="8 rows where this DP replica takes 4.*job.local_batch"):
        step_batch(torch.cat([IDS, IDS]), torch.cat([IDS, IDS]), 4, takes_mask=False)


def test_the_loss_of_dict_batches_weights_every_labelled_token_of_the_global_batch_alike():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 6, 11), torch.randint(0, 11, (4, 6))
    labels[0, 1:5] = -100  # the first micro-batch has far fewer labelled tokens
    whole = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss = BatchLoss(None)
    batch = StepBatch(IDS, labels, None, True)
    micro_batches, replicas = 2, 1
    loss.begin(batch, lambda count: count, micro_batches * replicas)  # one process: the count is the job's
    mean_of_micro_batches = (loss(logits[:2], labels[:2]) + loss(logits[2:], labels[2:])) / micro_batches
    assert torch.allclose(mean_of_micro_batches, whole, atol=1e-6, rtol=0)
    loss.begin(StepBatch(IDS, IDS, None, False), None, 2)  # pairs: the default mean, no count
    assert torch.allclose(loss(logits[:, :-1], labels[:, 1:].clamp(min=0)),
                          torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].clamp(min=0)
                                                            .flatten()))


def _runtime(replica, global_rows=8, replicas=2, step=0):
    plan = SimpleNamespace(global_batch_size=global_rows)
    return SimpleNamespace(plan=plan, local_batch_size=global_rows // replicas,
                           layout=SimpleNamespace(dp_index=replica), step_count=step)


def _loader(**kwargs):
    samples = list(range(20))
    return DataLoader(samples, collate_fn=lambda rows: {"input_ids": torch.tensor(rows)[:, None]}, **kwargs)


def test_each_replica_loads_its_own_rows_of_every_global_batch_in_the_same_shuffled_order():
    shuffled = _loader(batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    halves = [[b["input_ids"].flatten().tolist() for b in ReplicaBatches(shuffled, _runtime(r))] for r in (0, 1)]
    assert len(halves[0]) == len(halves[1]) == 2  # 20 samples: two global batches of 8, the last 4 dropped
    rows = [a + b for a, b in zip(*halves)]
    assert len(set(sum(rows, []))) == 16 and sum(rows, []) != list(range(16))  # disjoint, shuffled
    again = [b["input_ids"].flatten().tolist() for b in ReplicaBatches(shuffled, _runtime(0))]
    assert again == halves[0]  # another rank of that replica (or a restart) reads the same rows
    second_epoch = [b["input_ids"].flatten().tolist() for b in ReplicaBatches(shuffled, _runtime(0, step=2))]
    assert second_epoch != halves[0]
    resumed = [b["input_ids"].flatten().tolist() for b in ReplicaBatches(shuffled, _runtime(1, step=1))]
    assert resumed == halves[1][1:]  # a job restarted after step 1 goes on with the epoch's second batch


def test_a_loader_of_another_batch_size_is_regrouped_and_sharding_samplers_are_refused(caplog):
    sequential = ReplicaBatches(_loader(batch_size=5), _runtime(1))
    assert [b["input_ids"].flatten().tolist() for b in sequential] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert "batch_size 5 is regrouped into the plan's global batches of 8" in caplog.text
    samples = list(range(8))
    with pytest.raises(ConfigError, match="data: the DataLoader has a DistributedSampler"):
        ReplicaBatches(DataLoader(samples, sampler=DistributedSampler(samples, num_replicas=2, rank=0)), _runtime(0))


def test_an_iterable_of_global_batches_gives_each_replica_its_rows():
    batches = [(IDS[:, :3] + i, IDS[:, 3:]) for i in range(3)]
    mine = list(ReplicaBatches(batches, _runtime(1, global_rows=4, step=1)))
    assert len(mine) == 2 and torch.equal(mine[0][0], replica_rows(batches[1][0], 1, 2))
    with pytest.raises(ConfigError, match="a batch of 4 rows where the plan's global batch has 8"):
        list(ReplicaBatches(batches, _runtime(0)))


@pytest.mark.slow
def test_the_padded_fine_tuning_example_trains_as_its_one_process_reference(tmp_path, monkeypatch, capsys):
    """examples/finetune_padded.py's own loop (prepare with its DataLoader, job.data) in one process
    under a plan with 2 micro-batches, against --reference; tests/test_adapters.py runs its batches
    with PP 2 x DP 2."""
    import json
    import re
    import runpy
    import subprocess
    import sys

    pytest.importorskip("transformers")
    from ranks import finished, one_rank_env
    from memx_launch.specs.catalog import get_model
    from test_adapters import make_plan
    from toy_models import EXAMPLES

    config = json.loads(open(os.path.join(EXAMPLES, "models", "hf-llama-tiny", "config.json")).read())
    (tmp_path / "tiny").mkdir()  # two blocks, 16 positions: seconds on a loaded machine
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2,
                                                               "max_position_embeddings": 16}))
    spec = get_model(str(tmp_path / "tiny"))
    plan = make_plan(spec, [((0,), 2, "none")], micro_batch_size=2, global_batch_size=4, seq_len=spec.seq_len)
    plan.save(str(tmp_path / "plan.json"))
    script = os.path.join(EXAMPLES, "finetune_padded.py")
    argv = [script, "--model", str(tmp_path / "tiny"), "--steps", "2", "--global-batch-size", "4"]
    run = subprocess.run([sys.executable, *argv], env=one_rank_env(tmp_path / "plan.json"), capture_output=True,
                         text=True, timeout=600)
    assert finished(run, "step 2 | loss"), run.stderr[-2000:]  # exit 0, or torch's abort in teardown after it
    # --reference trains alone: in this process, whose imports it shares (the random state it seeds restored)
    monkeypatch.setattr(sys, "argv", [*argv, "--reference"])
    monkeypatch.syspath_prepend(EXAMPLES)
    capsys.readouterr()
    with torch.random.fork_rng(devices=[]), pytest.raises(SystemExit) as exited:
        runpy.run_path(script, run_name="__main__")
    assert exited.value.code in (0, None)
    got, want = ([float(m[1]) for m in re.finditer(r"^step \d+ \| loss ([0-9.]+)", out, re.M)]
                 for out in (run.stdout, capsys.readouterr().out))
    assert len(got) == len(want) == 2 and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
