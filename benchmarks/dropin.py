"""The user's own models under memx: plan, measured against predicted memory, and the loss against
the one-process reference.

1. examples/train_hf.py (transformers LlamaForCausalLM) under memx-run on
   examples/clusters/cpu-emulated.yaml, planned in the job (memx's block calibrated);
2. examples/train_own_model.py (a block class memx does not know) the same way, with
   --model-builder (its own block calibrated);
3. examples/lightning_train.py (2-process DDP, MemxCallback on cpu-emulated-ddp.yaml);
4. examples/train_hf.py with a mixture of experts (transformers MixtralForCausalLM, 4 experts, 2 a
   token, each whole on every rank) the same way as 1, its own block calibrated;
5. the same with 2026's layouts, each its own block calibrated: Llama 4 Maverick's (a dense block
   before each expert one, chunked attention, a layer in four without RoPE), GLM-4.5's (a dense
   first block, a shared expert, a multi-token prediction module in its config, which Transformers
   does not build), DeepSeek-V3's (the same with latent attention and group-limited routing) and
   Gemma 4's E models' (per-layer inputs, layers reusing earlier layers' keys and values: one stage);
6. GPT-NeoX (biases, LayerNorm, attention and MLP side by side, one q, k, v linear) the same way,
   its search held to TP 2 (``--tp 2``): its blocks split by Transformers' TP plan for them.

Per stage of the last step: its peak memory and its compute per micro-batch, measured and predicted.

    python benchmarks/dropin.py [--steps 3]

Writes benchmarks/results/dropin.json.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
OUT = os.path.join(REPO, "benchmarks", "results", "dropin.json")
CLUSTER = os.path.join(EXAMPLES, "clusters", "cpu-emulated.yaml")
STAGE = re.compile(r"s(\d+) (\S+) emulated: mem ([0-9.]+)/([0-9.]+) MiB, mb ([0-9.]+)/([0-9.]+) ms")


def _losses(text: str) -> list[float]:
    return [float(m[1]) for m in re.finditer(r"^step \d+ \| loss ([0-9.]+)", text, re.M)]


def memx_run(script: str, model: str, steps: int, builder: bool, search: tuple[str, ...] = ()) -> dict:
    """``search``: memx-run's search restrictions (``--tp 2``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    with tempfile.TemporaryDirectory() as tmp:
        flags = [*(["--model-builder", f"{script}:build"] if builder else []), *search]
        run = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4",
                              "--cluster", CLUSTER, *flags, script, "--model", model, "--steps", str(steps)],
                             cwd=tmp, env=env, capture_output=True, text=True, timeout=900, check=True)
    ref = subprocess.run([sys.executable, script, "--reference", "--model", model, "--steps", str(steps),
                          "--global-batch-size", "16"], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    last = [line for line in run.stdout.splitlines() if line.startswith(f"step {steps} |")][-1]
    got, want = _losses(run.stdout), _losses(ref.stdout)
    return {"plan": re.search(r"^training .*$", run.stdout, re.M)[0],
            "stages_last_step": [{"stage": int(s), "device": d, "measured_mib": float(m), "predicted_mib": float(p),
                                  "measured_over_predicted": round(float(m) / float(p), 3),
                                  "compute_measured_ms": float(tm), "compute_predicted_ms": float(tp),
                                  "compute_measured_over_predicted": round(float(tm) / float(tp), 3)}
                                 for s, d, m, p, tm, tp in STAGE.findall(last)],
            "losses": got, "reference_losses": want,
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(got, want))}


def lightning(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "lightning_train.py"), "--root", tmp,
                              "--steps", str(steps)], cwd=tmp, capture_output=True, text=True, timeout=900, check=True)
        with open(os.path.join(tmp, "logs", "version_0", "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    memory = [r for r in rows if r["memx/stage0/peak_gib"]]
    losses = [float(r["train_loss"]) for r in rows if r["train_loss"]]
    return {"plan": re.search(r"memx: plan for .*", run.stdout)[0],
            "samples": [{"step": int(r["step"]), "measured_mib": round(float(r["memx/stage0/peak_gib"]) * 1024, 2),
                         "predicted_mib": round(float(r["memx/stage0/predicted_gib"]) * 1024, 2)} for r in memory],
            "first_loss": losses[0], "last_loss": losses[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    result = {"machine": machine_info(), "steps": args.steps,
              "hf_llama": memx_run(os.path.join(EXAMPLES, "train_hf.py"),
                                   os.path.join(EXAMPLES, "models", "hf-llama-tiny"), args.steps, builder=False),
              "own_block": memx_run(os.path.join(EXAMPLES, "train_own_model.py"),
                                    os.path.join(EXAMPLES, "models", "own-gpt-tiny"), args.steps, builder=True),
              "lightning": lightning(max(4, args.steps)),
              **{case: memx_run(os.path.join(EXAMPLES, "train_hf.py"), os.path.join(EXAMPLES, "models", folder),
                                args.steps, builder=False)
                 for case, folder in (("hf_mixtral", "hf-mixtral-tiny"), ("hf_llama4_maverick", "hf-llama4-tiny"),
                                      ("hf_glm4_moe", "hf-glm4-moe-tiny"), ("hf_deepseek_v3", "hf-deepseek-v3-tiny"),
                                      ("hf_gemma4_e", "hf-gemma4-tiny"))},
              "hf_gpt_neox_tp2": memx_run(os.path.join(EXAMPLES, "train_hf.py"),
                                          os.path.join(EXAMPLES, "models", "hf-gpt-neox-tiny"), args.steps,
                                          builder=False, search=("--tp", "2"))}
    write_json_atomic(OUT, result, overwrite=True)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
