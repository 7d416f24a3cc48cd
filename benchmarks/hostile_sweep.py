"""The hostile-input table of tests/test_hostile_inputs.py, run from outside: every case as its own
``memx`` / ``memx-run`` process (real stderr, real exit code, Python warnings included).

A case is handled when the process exits with the expected code (2, or 3 when nothing fits),
prints no traceback, prints exactly one ``memx: error:`` (``memx-run: error:``) line and nothing
else but one-line warnings (and, for exit 3, the closest candidates), and leaves its directory
exactly as it was (no file written, replaced or left behind).

    python benchmarks/hostile_sweep.py

Writes benchmarks/results/hostile_sweep.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from test_hostile_inputs import CASES, LAUNCHER_CASES, _snapshot, _write  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "hostile_sweep.json")


def _verdict(rc: int, err: str, expected: int, prefix: str, same_files: bool) -> str | None:
    """None when handled, else what was wrong."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(prefix)]
    allowed = ("memx: warning:",) + (("  ", "closest candidates") if expected == 3 else ())
    others = [line for line in lines if not line.startswith(prefix) and not line.startswith(allowed)]
    if "Traceback" in err:
        return "traceback"
    if rc != expected:
        return f"exit {rc}, expected {expected}"
    if len(errors) != 1 or others:
        return f"{len(errors)} error line(s), {len(others)} other line(s)"
    if not same_files:
        return "files written or changed"
    return None


def _run(argv: list[str], cwd: Path, env: dict) -> tuple[int, str]:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr if "Traceback" in proc.stdout else proc.stderr


def main() -> int:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    results, start = [], time.perf_counter()
    for case_id, files, argv, code in CASES:
        with tempfile.TemporaryDirectory() as d:
            directory = Path(d)
            _write(directory, files)
            before = _snapshot(directory)
            rc, err = _run([sys.executable, "-m", "memx_launch.cli", *[a.replace("{d}", d) for a in argv]],
                           directory, base_env)
            problem = _verdict(rc, err, code, "memx: error:", _snapshot(directory) == before)
        results.append({"case": case_id, "command": "memx", "handled": problem is None, "problem": problem,
                        "stderr": err.strip().splitlines()[-1][:300] if err.strip() else ""})
    for case_id, env, files, argv in LAUNCHER_CASES:
        with tempfile.TemporaryDirectory() as d:
            directory = Path(d)
            for name, text in files.items():
                path = directory / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
            before = _snapshot(directory)
            rc, err = _run([sys.executable, "-m", "memx_launch.runtime.launcher",
                            *[a.replace("{d}", d) for a in argv]], directory, {**base_env, **env})
            problem = _verdict(rc, err, 2, "memx-run: error:", _snapshot(directory) == before)
        results.append({"case": case_id, "command": "memx-run", "handled": problem is None, "problem": problem,
                        "stderr": err.strip().splitlines()[-1][:300] if err.strip() else ""})
    failed = [r for r in results if not r["handled"]]
    summary = {"cases": len(results), "handled": len(results) - len(failed),
               "not_handled": [f"{r['case']}: {r['problem']}" for r in failed],
               "seconds": round(time.perf_counter() - start, 1)}
    write_json_atomic(OUT, {"benchmark": "hostile_sweep", "machine": machine_info(), "summary": summary,
                            "cases": results}, overwrite=True)
    print(f"{summary['handled']}/{summary['cases']} handled in {summary['seconds']} s; results in {OUT}")
    for line in summary["not_handled"]:
        print(f"  not handled: {line}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
