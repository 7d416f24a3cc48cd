"""--config FILE and --print-config on memx plan and memx-run (memx-run only with --dry-run)."""

import json
import os

import pytest
import yaml

from memx_launch.cli import main as memx
from memx_launch.runtime.launcher import main as memx_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE1 = os.path.join(REPO, "examples", "clusters", "table1-2vendor.yaml")
CPU_CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")
TRAIN = os.path.join(REPO, "examples", "train.py")
PLAN_FLAGS = ["--model", "llama2-7b", "--cluster", TABLE1, "--global-batch-size", "64", "--objective", "safety",
              "--memory-headroom", "0.1", "--fully-sharded", "--quiet"]


def _print_config(run, argv, capsys) -> str:
    at = 1 if run is memx else 0  # after "plan"; before memx-run's script, whose arguments follow it
    assert run(argv[:at] + ["--print-config"] + argv[at:]) == 0
    return capsys.readouterr().out


def _one_error_line(capsys, prefix="memx: error: ") -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines  # one line, no traceback
    assert lines[0].startswith(prefix)
    return lines[0]


def test_plan_print_config_fed_back_gives_the_same_plan(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text(_print_config(memx, ["plan", *PLAN_FLAGS], capsys))
    values = yaml.safe_load(config.read_text())
    assert values["global_batch_size"] == 64 and values["objective"] == "safety" and values["fully_sharded"] is True
    # the printed config is a fixed point of --config / --print-config
    assert _print_config(memx, ["plan", "--config", str(config)], capsys) == config.read_text()

    assert memx(["plan", *PLAN_FLAGS, "--json", str(tmp_path / "flags.json")]) == 0
    assert memx(["plan", "--config", str(config), "--json", str(tmp_path / "file.json")]) == 0
    from_flags = json.loads((tmp_path / "flags.json").read_text())
    assert json.loads((tmp_path / "file.json").read_text()) == from_flags
    assert from_flags["global_batch_size"] == 64 and from_flags["training"]["fully_sharded"]


def test_command_line_overrides_the_file_wherever_it_stands(tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text(f"model: llama2-7b\ncluster: {TABLE1}\ntop: 3\ndtype: fp16\nglobal-batch-size: 64\n")
    later = tmp_path / "later.yaml"
    later.write_text("top: 4\n")
    for argv in (["plan", "--config", str(base), "--top", "2"], ["plan", "--top", "2", "--config", str(base)]):
        out = yaml.safe_load(_print_config(memx, argv, capsys))
        assert out["top"] == 2 and out["dtype"] == "fp16" and out["global_batch_size"] == 64
    out = yaml.safe_load(_print_config(memx, ["plan", "--config", str(base), "--config", str(later)], capsys))
    assert out["top"] == 4 and out["dtype"] == "fp16"  # later files win over earlier ones
    # the file provides the required --model and --cluster
    assert memx(["plan", "--config", str(base), "--quiet"]) == 0
    assert "top 3 plans" in capsys.readouterr().out


def test_print_config_without_options_is_a_template(capsys):
    out = yaml.safe_load(_print_config(memx, ["plan"], capsys))
    assert out["model"] is None and out["top"] == 5 and out["compare"] is False
    assert "config" not in out and "print_config" not in out


@pytest.mark.parametrize("text,field,problem", [
    ("topp: 3\n", "topp", "unknown key; did you mean 'top'?"),
    ("top: three\n", "top", "expected an integer, got 'three'"),
    ("dtype: fp8\n", "dtype", "expected one of bf16, fp16, fp32, got 'fp8'"),
    ("compare: maybe\n", "compare", "expected true or false, got 'maybe'"),
    ("memory_headroom: [0.1]\n", "memory_headroom", "expected a number, got [0.1]"),
    ("print_config: true\n", "print_config", "unknown key"),
    ("top: [\n", "--config", "is not valid YAML at line 2"),
    ("- top\n", "--config", "holds a list"),
])
def test_bad_config_file_is_one_line(tmp_path, capsys, text, field, problem):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert memx(["plan", "--config", str(config), "--model", "llama2-7b", "--cluster", TABLE1]) == 2
    line = _one_error_line(capsys)
    assert f"{field}: " in line and problem in line, line
    assert "; " in line  # <problem>; <fix>


def test_missing_config_file_is_one_line(tmp_path, capsys):
    assert memx(["plan", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "--config: cannot read" in _one_error_line(capsys)


def test_memx_run_config_covers_memx_and_torchrun_options_not_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"nproc_per_node: 2\ncluster: {CPU_CLUSTER}\nmodel: llama-tiny\nmax_restarts: 1\n")
    train = tmp_path / "train.py"  # a script with a --config of its own (memx-run checks the script's flags)
    train.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--model')\n"
                     "p.add_argument('--config')\np.parse_args()\n")
    script = [str(train), "--model", "llama-tiny", "--config", "script.yaml"]
    out = yaml.safe_load(_print_config(memx_run, ["--config", str(config), "--nproc-per-node", "4", *script], capsys))
    assert out["nproc_per_node"] == "4" and out["max_restarts"] == 1 and out["cluster"] == CPU_CLUSTER
    # the script's own --config stays the script's
    assert memx_run(["--config", str(config), "--nproc-per-node", "4", "--dry-run", *script]) == 0
    printed = capsys.readouterr().out
    assert "processes on this node  4  (flag)" in printed
    assert "train.py --model llama-tiny --config script.yaml" in printed


def test_memx_run_print_config_fed_back_gives_the_same_dry_run_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--objective", "throughput"]
    config = tmp_path / "run.yaml"
    config.write_text(_print_config(memx_run, [*flags, TRAIN, "--model", "llama-tiny"], capsys))
    assert _print_config(memx_run, ["--config", str(config), TRAIN, "--model", "llama-tiny"], capsys) \
        == config.read_text()
    plans = []
    for argv, name in ((flags, "flags.json"), (["--config", str(config)], "file.json")):
        assert memx_run([*argv, "--dry-run", "--export-plan", str(tmp_path / name), TRAIN, "--model", "llama-tiny"]) == 0
        plans.append(json.loads((tmp_path / name).read_text()))
    capsys.readouterr()
    assert plans[0] == plans[1] and plans[0]["objective"]["profile"] == "throughput"


@pytest.mark.parametrize("text,match", [
    ("training_script: x.py\n", "training_script: unknown key; give it on the command line"),
    ("nproc-per-node: [4]\n", "nproc-per-node: expected text or a number, got [4]"),
    ("max_restarts: 1.5\n", "max_restarts: expected an integer, got 1.5"),
])
def test_memx_run_bad_config_is_one_line(tmp_path, capsys, monkeypatch, text, match):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert memx_run(["--config", str(config), "--dry-run", TRAIN, "--model", "llama-tiny"]) == 2
    assert match in _one_error_line(capsys, prefix="memx-run: error: ")
