"""examples/train.py, the README's training script: a wrong input is one line naming the flag
and the fix, a non-zero exit, no traceback."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("copied,argv,line", [
    # Copied out of the repository, the script finds none of the text it trains on.
    (True, ["--model", "llama-tiny"], "train.py: error: --synthetic: no text to train on"),
    (False, ["--model", "llama2-7b", "--synthetic"], "train.py: error: --model: llama2-7b is not the plan's model"),
])
def test_a_wrong_input_is_one_line_naming_the_flag(tmp_path, copied, argv, line):
    from memx_launch.specs.catalog import get_model
    from ranks import one_rank_env
    from test_adapters import make_plan

    spec = get_model("llama-tiny")
    make_plan(spec, [((0,), spec.num_layers, "none")], global_batch_size=4, seq_len=64).save(str(tmp_path / "plan.json"))
    script = os.path.join(REPO, "examples", "train.py")
    if copied:
        os.makedirs(tmp_path / "examples")
        script = shutil.copy(script, tmp_path / "examples" / "train.py")
    run = subprocess.run([sys.executable, script, *argv, "--steps", "1"], cwd=tmp_path,
                         env=one_rank_env(tmp_path / "plan.json"), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith(line), run.stderr[-2000:]
    assert "Traceback" not in run.stderr
