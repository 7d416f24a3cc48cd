"""What each xgboost package costs a fresh install: seconds, venv growth and what it pulled.

For each of ``xgboost`` and ``xgboost-cpu`` (same version, same ``xgboost`` module): a fresh venv
with pip upgraded, then ``pip install --no-cache-dir PACKAGE==VERSION`` timed, the venv's size
before and after, the largest installed packages, and a tiny training run as a check.

Usage: python benchmarks/xgboost_install.py [--version 3.2.0] [--out benchmarks/results/xgboost_install.json]
Needs the package index; about a minute on a fast link.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

CHECK = ("import numpy, xgboost; d = xgboost.DMatrix(numpy.random.rand(50, 3), label=numpy.random.rand(50)); "
         "xgboost.train({'tree_method': 'hist'}, d, 5); print(xgboost.__version__)")


def size_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total / 2**20


def largest_packages(venv: str, top: int = 5) -> dict[str, float]:
    site = next(os.path.join(root, d) for root, dirs, _ in os.walk(os.path.join(venv, "lib"))
                for d in dirs if d == "site-packages")
    sizes = {name: size_mb(os.path.join(site, name)) for name in os.listdir(site)
             if os.path.isdir(os.path.join(site, name)) and not name.endswith((".dist-info", "__pycache__"))}
    return {k: round(v, 1) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]}


def measure(package: str, version: str, workdir: str) -> dict:
    venv = os.path.join(workdir, package)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-cache-dir", "--upgrade", "pip"], check=True)
    before = size_mb(venv)
    start = time.perf_counter()
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-cache-dir", f"{package}=={version}"], check=True)
    seconds = time.perf_counter() - start
    check = subprocess.run([python, "-c", CHECK], capture_output=True, text=True)
    return {"install_seconds": round(seconds, 1), "venv_growth_mb": round(size_mb(venv) - before, 1),
            "largest_packages_mb": largest_packages(venv), "check_passed": check.returncode == 0,
            "version_imported": check.stdout.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="3.2.0")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "xgboost_install.json"))
    args = parser.parse_args()
    result = {"machine": machine_info(), "version": args.version}
    with tempfile.TemporaryDirectory() as workdir:
        for package in ("xgboost", "xgboost-cpu"):
            result[package] = measure(package, args.version, workdir)
            print(package, result[package], flush=True)
    write_json_atomic(args.out, result, overwrite=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
