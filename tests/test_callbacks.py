"""The Lightning callback (callbacks/, installed as memx_callbacks): packaging, decisions, errors,
and examples/lightning_train.py end to end (2-process DDP on emulated devices, then a resume)."""

import configparser
import json
import csv
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from memx_callbacks import MemxCallback
from memx_callbacks.planning import Decision, decide
from memx_launch.errors import ConfigError, MemxError
from memx_launch.planning.replan import ReplanEvent

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_editable_install_maps_the_callback_under_its_own_name():
    # Where a fresh interpreter outside the checkout finds the package, without running it (importing
    # Lightning takes seconds; this process imported it from the same mapping, above): the folder's
    # name is not a top-level package.
    code = ("import importlib.util\nspec = importlib.util.find_spec('memx_callbacks')\n"
            "print(spec.origin)\nprint(importlib.util.find_spec('callbacks'))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    origin, missing = out.stdout.splitlines()
    assert pathlib.Path(origin) == ROOT / "callbacks" / "__init__.py" and missing == "None"
    assert MemxCallback.__module__ == "memx_callbacks.memx"


def test_every_package_folder_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "memx_launch").rglob("__init__.py")}
    assert folders | {"memx_callbacks"} == listed


def _decision(k=2, n=8, mbs=8):
    # 0.024 GiB with nothing checkpointed, 0.0012 GiB less per block, 0.0005 GiB of recompute working set.
    peaks = [0.024] + [0.024 - 0.0012 * j + 0.0005 for j in range(1, n + 1)]
    return Decision(mbs, 1, k, peaks, capacity_gib=0.025)


def test_the_trainers_precision_is_what_is_planned_for():
    from memx_callbacks.memx import _dtype, _weights_dtype
    from memx_launch.specs.training import TrainingSpec

    settings = ("bf16-mixed", "bf16-true", "16-mixed", "32-true", "64-true")
    assert [_dtype(p) for p in settings] == ["bf16", "bf16", "fp16", "fp32", "fp32"]
    # "-mixed" is autocast over fp32 weights: fp32 hidden states, a cast kept per linear
    assert [TrainingSpec(dtype=_dtype(p), weights_dtype=_weights_dtype(p)).autocast for p in settings] == \
        [True, False, True, False, False]
    # "-true" casts the module: its gradients and Adam's moments take its dtype, with no fp32 copy.
    from memx_callbacks.memx import planned_training

    planned = [planned_training(p, 0.0) for p in settings]
    assert [(t.weights_dtype, t.grad_dtype, t.optimizer_dtype) for t in planned[:2]] == \
        [("fp32", "fp32", "fp32"), ("training", "training", "training_no_master")]
    # torch's DDP over the module (--setup ddp): its bucket copy, its overlapped reduction, torch's
    # cross entropy in the module's training_step
    assert all(t.setup == "ddp" and t.ddp_bucket_copy and t.overlap_grad_reduce and not t.vocab_parallel_loss
               for t in planned)
    # Lightning's closure runs zero_grad between training_step and backward: the forward holds the last gradients
    assert all(t.zero_grad_after_forward for t in planned)
    assert planned_training("bf16-mixed", 0.25).frozen_fraction == 0.25  # the module's frozen share


def test_the_fewest_checkpointed_blocks_that_fit():
    d = _decision()
    assert d.blocks_to_fit(0.030) == 0
    assert d.blocks_to_fit(d.peaks_gib[-1]) == 8 and d.blocks_to_fit(d.peaks_gib[-1] - 1e-6) is None
    k = d.blocks_to_fit(0.0215)  # 0.024 - 0.0012 k + 0.0005 <= 0.0215 -> k = 2.5 -> 3
    assert k == 3 and d.peak_with(k) <= 0.0215 < d.peak_with(k - 1)
    assert d.blocks_to_fit(0.030, at_least=4) == 4


def test_the_peaks_are_memx_s_estimate_of_checkpointing_the_first_k_blocks():
    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.catalog import get_model
    from memx_launch.specs.training import TrainingSpec

    spec = get_model("llama-tiny")
    cluster = ClusterSpec.from_dict({"version": 1, "device_types": {"gpu": {
        "vendor": "cpu", "memory_gib": 0.05, "peak_tflops": 1}}, "nodes": [{"devices": {"gpu": 2},
                                                                              "intra_node_gbps": 100}]})
    training = TrainingSpec(global_batch_size=16, seq_len=spec.seq_len, dtype="fp32")
    d = decide(spec, cluster, training, world=2, tp=1, num_blocks=spec.num_layers, user_micro_batch=8,
               user_accumulation=1, headroom=0.1)
    assert d.num_blocks == spec.num_layers
    for k in (0, 1, spec.num_layers):
        plan = evaluate_layout(spec, cluster, training, tp=1, pp=1, dp=2, micro_batch_size=d.micro_batch_size,
                               recompute=[f"full:{k}"], references=(1.0, 1.0, 1.0))
        assert d.peaks_gib[k] == plan.stages[0].predicted_peak_memory_gib
    assert d.micro_batch_size == 8 and 0 < d.recompute_blocks < d.num_blocks  # some blocks, not all
    assert d.predicted_peak_gib == d.peaks_gib[d.recompute_blocks] <= 0.9 * d.capacity_gib
    assert d.peaks_gib[d.recompute_blocks - 1] > 0.9 * d.capacity_gib  # one fewer would not fit
    # Each checkpointed block saves its activations, the first too: its recompute's backward comes
    # after the kept blocks freed theirs (measured: tests/test_framework_memory.py).
    assert d.peaks_gib[0] > d.peaks_gib[1] > d.peaks_gib[-1]


class _Trainer(SimpleNamespace):
    def save_checkpoint(self, path):
        self.saved = path


def _callback_with_blocks(tmp_path, decision):
    cb = MemxCallback(plan_file=str(tmp_path / "plan.json"))
    cb.decision = decision
    cb._blocks = [torch.nn.Linear(2, 2) for _ in range(decision.num_blocks)]
    trainer = _Trainer(global_rank=0, default_root_dir=str(tmp_path), should_stop=False)
    return cb, trainer


def _event(observed_gib):
    return ReplanEvent(10, "headroom", 0, 0, "small", "3% free", [observed_gib, observed_gib], [0.025, 0.025])


def test_pressure_checkpoints_more_blocks_in_place(tmp_path):
    cb, trainer = _callback_with_blocks(tmp_path, _decision(k=2))
    cb._fix(trainer, _event(0.0243))  # 0.0018 GiB over 90% of 0.025: two more blocks of 0.0012
    assert cb.decision.recompute_blocks == 4 and not trainer.should_stop
    assert ["forward" in b.__dict__ for b in cb._blocks] == [True] * 4 + [False] * 4


def test_pressure_with_every_block_checkpointed_stops_with_a_smaller_micro_batch(tmp_path):
    cb, trainer = _callback_with_blocks(tmp_path, _decision(k=8, mbs=8))
    cb._fix(trainer, _event(0.0243))
    assert trainer.should_stop and trainer.saved.endswith("memx-replan-step10.ckpt")
    assert (cb.decision.micro_batch_size, cb.decision.accumulate_grad_batches) == (4, 2)
    assert '"micro_batch_size": 4' in (tmp_path / "plan.json").read_text()
    restored = MemxCallback()
    restored.load_state_dict(cb.state_dict())
    assert restored.decision == cb.decision and restored.resumed
    assert restored.decision.recompute_blocks == 0  # the halved micro-batch restarts with none checkpointed
    # A decision written by the previous format (a stored predicted_peak_gib) still loads; one
    # from before peaks_gib names the fix.
    assert Decision.from_dict({**cb.decision.to_dict(), "predicted_peak_gib": 1.0}) == cb.decision
    with pytest.raises(ConfigError, match="peaks_gib"):
        Decision.from_dict({"micro_batch_size": 4, "accumulate_grad_batches": 2, "recompute_blocks": 0,
                            "peak_none_gib": 0.02, "peak_full_gib": 0.01, "capacity_gib": 0.025})


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_single_device_fit_without_a_cluster_file_plans_for_its_own_device(tmp_path, capsys, monkeypatch,
                                                                              precision):
    """MemxCallback(cluster=None) under Lightning's SingleDeviceStrategy (no process group): the
    process describes its own device, calibrates the module's block (as the eager ops a
    LightningModule runs), trains with the plan and samples its memory (every step here; the
    default's first sample, step 10, crashed once). Under "-mixed" precision the records say the
    blocks ran fp32 weights under autocast, so that their ratios leave the weights' copies out."""
    import lightning as L
    import toy_models  # noqa: F401  (puts examples/ on the path: the examples import each other)

    import lightning_train as example
    from memx_callbacks import memx as callback_module

    calibrated = []
    calibrate = callback_module.calibrate_blocks
    monkeypatch.setattr(callback_module, "calibrate_blocks",
                        lambda *args, **kwargs: calibrated.append(args[4]) or calibrate(*args, **kwargs))
    callback = MemxCallback(None, model=example.MODEL, log_every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, default_root_dir=str(tmp_path), logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, callbacks=[callback],
                        precision=precision)
    trainer.fit(example.LitGPT())
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy" and trainer.global_step == 2
    assert callback._monitor.last_table is not None and callback._monitor.last_table.shape == (1, 2)
    assert "memx: plan for" in capsys.readouterr().out and (tmp_path / "memx-profiles.jsonl").exists()
    assert [training.eager_block for training in calibrated] == [True]
    records = [json.loads(line) for line in (tmp_path / "memx-profiles.jsonl").read_text().splitlines()]
    mixed = precision == "bf16-mixed"
    # The example's block has one q, k, v linear where --setup ddp's Hugging Face blocks have three; memx
    # cannot reach its attention core (its selective level would recompute the whole block).
    assert records and all(r["run_options"] == {"setup": "ddp", "weights_dtype": "fp32", "fused_qkv": True,
                                                "selective_recompute": "block"} for r in records)
    assert calibrated[0].setup == "ddp" and calibrated[0].fused_qkv and not calibrated[0].vocab_parallel_loss
    assert calibrated[0].autocast == mixed


@pytest.mark.parametrize("value", ["abc", True, 2.5, 0, None])
def test_log_every_n_steps_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="^log_every_n_steps: must be a positive integer") as info:
        MemxCallback(log_every_n_steps=value)
    assert "\n" not in str(info.value)


GOOD_DECISION = {"micro_batch_size": 4, "accumulate_grad_batches": 2, "recompute_blocks": 1,
                 "peaks_gib": [0.03, 0.02, 0.01], "capacity_gib": 0.025}


@pytest.mark.parametrize("change", [{"micro_batch_size": "4"}, {"micro_batch_size": 0}, {"recompute_blocks": 3},
                                    {"recompute_blocks": -1}, {"peaks_gib": []}, {"peaks_gib": ["a"]},
                                    {"peaks_gib": [float("nan")]}, {"capacity_gib": -1}, {"accumulate_grad_batches":
                                    True}, {"colour": "red"}])
def test_a_tampered_decision_is_one_error(change):
    assert Decision.from_dict(GOOD_DECISION).predicted_peak_gib == 0.02
    with pytest.raises(ConfigError, match="^checkpoint.decision") as info:
        Decision.from_dict({**GOOD_DECISION, **change})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="not a decision"):
        Decision.from_dict([GOOD_DECISION])


def test_misconfiguration_names_the_fix():
    from toy_models import NoBlocks

    with pytest.raises(ConfigError, match="strategy: MemxCallback does not apply its plan under FSDPStrategy; use "):
        MemxCallback().setup(SimpleNamespace(strategy=type("FSDPStrategy", (), {})()), NoBlocks(), "fit")
    trainer = SimpleNamespace(strategy=type("DDPStrategy", (), {})())
    with pytest.raises(ConfigError) as info:
        MemxCallback().setup(trainer, NoBlocks(), "fit")
    assert str(info.value).startswith("model: no transformer blocks found in NoBlocks") and "\n" not in str(info.value)


@pytest.mark.slow
def test_lightning_example_plans_trains_logs_and_resumes_with_its_plan(tmp_path):
    script = ROOT / "examples" / "lightning_train.py"
    run = subprocess.run([sys.executable, str(script), "--root", str(tmp_path), "--steps", "4"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = re.search(r"memx: plan for lightning-gpt on cpu-emulated-ddp: (.*)", run.stdout)
    assert plan, run.stdout[-3000:]
    k = int(re.search(r"(\d+)/8 blocks checkpointed", plan[1])[1])
    assert 0 < k < 8  # the cap forces some checkpointing, not all
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    memory = [r for r in rows if r["memx/stage0/peak_gib"]]
    losses = [float(r["train_loss"]) for r in rows if r["train_loss"]]
    assert [int(r["step"]) for r in memory] == [2, 4]
    for r in memory:
        peak, predicted = float(r["memx/stage0/peak_gib"]), float(r["memx/stage0/predicted_gib"])
        assert 0 < peak < 0.0234 and abs(peak / predicted - 1) < 0.25
    assert losses[-1] < losses[0]
    # The resume forks its second process (Lightning's ddp_fork): the callback is the same in it, and
    # the first run above started it anew, as users run DDP.
    again = subprocess.run([sys.executable, str(script), "--root", str(tmp_path), "--steps", "6", "--resume",
                            "--strategy", "ddp_fork"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"memx: resumed plan kept: {plan[1]}" in again.stdout
    assert "calibrated" not in again.stdout
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:  # the first run's rows are kept
        assert list(csv.DictReader(f)) == rows
    with open(tmp_path / "logs" / "version_1" / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r["memx/stage0/peak_gib"]] == [6]


def test_a_model_that_does_not_fit_is_one_line_with_how_much_is_short(tmp_path, capsys):
    """Like memx plan's: no traceback, the GiB short per device, exit code 3. The error leaves
    trainer.fit as raised, and the hook the callback installed is what the interpreter hands it."""
    import lightning as L
    import toy_models  # noqa: F401  (puts examples/ on the path: the examples import each other)

    import lightning_train as example
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("version: 1\nname: tiny\ndevice_types:\n  small: {vendor: cpu, memory_gib: 0.002, "
                       "peak_tflops: 0.03, memory_bandwidth_gbps: 5}\nnodes:\n  - {name: localhost, devices: "
                       "{small: 1}, intra_node_gbps: 2}\nemulation:\n  slowdown: {small: 1}\n")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, default_root_dir=str(tmp_path), logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        callbacks=[MemxCallback(str(cluster), model=example.MODEL)])
    with pytest.raises(MemxError) as raised:
        trainer.fit(example.LitGPT())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        sys.excepthook(raised.type, raised.value, raised.tb)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("memx: error:")]
    assert exited.value.code == 3 and "Traceback" not in err, err
    assert len(errors) == 1 and re.search(r"does not fit .* small short [\d.]+ [MG]iB per device", errors[0]), errors


TWO_VENDORS_DDP = """version: 1
name: cpu-two-vendors-ddp
device_types:
  nv-small: {vendor: nvidia, memory_gib: 0.0234, peak_tflops: 0.03, efficiency: 1.0, memory_bandwidth_gbps: 5,
             memory_overhead_gib: 0}
  amd-small: {vendor: amd, memory_gib: 0.0234, peak_tflops: 0.03, efficiency: 1.0, memory_bandwidth_gbps: 5,
              memory_overhead_gib: 0}
nodes:
  - {name: localhost, devices: {nv-small: 1, amd-small: 1}, intra_node_gbps: 2}
emulation:
  slowdown: {nv-small: 1, amd-small: 1}
"""


@pytest.mark.slow
def test_lightning_ddp_across_two_vendors_sums_gradients_over_the_bridge(tmp_path):
    cluster = tmp_path / "two-vendors.yaml"
    cluster.write_text(TWO_VENDORS_DDP)
    script = ROOT / "examples" / "lightning_train.py"
    run = subprocess.run([sys.executable, str(script), "--root", str(tmp_path), "--steps", "4", "--cluster",
                          str(cluster), "--strategy", "ddp_fork"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "memx: gradients cross domains ['nccl', 'rccl']: summed natively inside each, over the bridge" in run.stdout
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    bridged = [float(r["memx/bridge_mib"]) for r in rows if r.get("memx/bridge_mib")]
    losses = [float(r["train_loss"]) for r in rows if r["train_loss"]]
    assert bridged and bridged[-1] > bridged[0] > 0  # every step's gradients crossed
    assert losses[-1] < losses[0]
