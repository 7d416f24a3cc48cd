"""How long CI's test command takes: `.ci/run`'s pytest command (the venv already set up),
wall-clock, with the slowest tests and the machine's load (CI runs on 2 cores; run this where
nothing else does, e.g. `taskset -c 0,1` on an idle machine).

    python benchmarks/ci_duration.py [--out benchmarks/results/ci_duration.json] [PYTEST_ARGS ...]

Extra arguments go to pytest (a subset for a quick check of this script; the result then says so).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI_SCRIPT = os.path.join(REPO, ".ci", "run")


def ci_pytest_args(script: str = CI_SCRIPT) -> list[str]:
    """The arguments `.ci/run` gives pytest (its line ``.venv/bin/python -m pytest ...``)."""
    with open(script) as f:
        [line] = [line for line in f if line.startswith(".venv/bin/python -m pytest")]
    return line.split()[3:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "ci_duration.json"))
    args, pytest_args = p.parse_known_args()
    machine = machine_info()
    ci_args = ci_pytest_args()
    command = [sys.executable, "-m", "pytest", *ci_args, "--durations=15", *pytest_args]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    slowest = [{"seconds": float(m[1]), "test": m[2]}
               for m in re.finditer(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)", run.stdout, re.M)]
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    result = {"command": " ".join(["pytest", *ci_args, *pytest_args]), "whole_suite": not pytest_args,
              "wall_s": round(wall, 1), "exit_code": run.returncode, "summary": summary,
              "slowest": slowest,
              "machine": machine, "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    write_json_atomic(args.out, result, overwrite=True, flag="--out")
    print(f"{result['command']}: {wall / 60:.1f} min, {summary} -> {args.out}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
