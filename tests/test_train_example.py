"""examples/train.py, the README's training script: a wrong input is one line naming the flag
and the fix, a non-zero exit, no traceback; a copy of it trains wherever memx is installed."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, script: str, argv: list[str]) -> subprocess.CompletedProcess:
    """The script on one rank under a one-stage llama-tiny plan, from ``tmp_path``."""
    from memx_launch.specs.catalog import get_model
    from ranks import one_rank_env
    from test_adapters import make_plan

    spec = get_model("llama-tiny")
    make_plan(spec, [((0,), spec.num_layers, "none")], global_batch_size=4, seq_len=64).save(str(tmp_path / "plan.json"))
    return subprocess.run([sys.executable, script, *argv, "--steps", "1"], cwd=tmp_path,
                          env=one_rank_env(tmp_path / "plan.json"), capture_output=True, text=True, timeout=300)


def test_a_wrong_model_is_one_line_naming_the_flag(tmp_path):
    run = _run(tmp_path, os.path.join(REPO, "examples", "train.py"), ["--model", "llama2-7b", "--synthetic"])
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith("train.py: error: --model: llama2-7b is not the plan's model"), \
        run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_a_copy_of_the_script_trains_on_the_installed_sources(tmp_path):
    """Copied out of the repository, the script finds no README or docs beside it: it trains on
    memx's sources, where memx is installed."""
    os.makedirs(tmp_path / "examples")
    script = shutil.copy(os.path.join(REPO, "examples", "train.py"), tmp_path / "examples" / "train.py")
    from ranks import finished

    run = _run(tmp_path, script, ["--model", "llama-tiny"])
    assert finished(run, "done: 1 steps"), run.stderr[-2000:]  # exit 0, or torch's abort in teardown after it
    assert "step 1 | loss" in run.stdout
