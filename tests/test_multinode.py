"""Nodes of different sizes: two memx-run "nodes" on localhost (1 and 3 processes, static
rendezvous, emulated device types), each with its own run directory as on separate machines,
no --nproc-per-node: each takes its count from its entry in the cluster file. They calibrate,
plan for 4 ranks and train."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ranks import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
TWO_NODES = """version: 1
name: two-nodes
device_types:
  fast-small: {vendor: cpu, memory_gib: 0.025, peak_tflops: 0.03, memory_bandwidth_gbps: 5}
  slow-big: {vendor: cpu, memory_gib: 0.16, peak_tflops: 0.01, memory_bandwidth_gbps: 5}
nodes:
  - {name: one, devices: {slow-big: 1}, intra_node_gbps: 2}
  - {name: three, devices: {fast-small: 2, slow-big: 1}, intra_node_gbps: 2}
inter_node_gbps: 1
emulation:
  slowdown: {fast-small: 1, slow-big: 2}
"""
STEPS = 3


@pytest.mark.slow
def test_two_nodes_of_one_and_three_processes_plan_and_train(tmp_path):
    (tmp_path / "cluster.yaml").write_text(TWO_NODES)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMX_", "PET_"))}
    env["PYTHONPATH"] = REPO
    argvs = [[sys.executable, "-m", "memx_launch.runtime.launcher", "--nnodes", "2", "--node-rank", str(node),
              "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--max-restarts", "0", "--cluster", str(tmp_path / "cluster.yaml"), "--global-batch-size", "4",
              "--seq-len", "64", "--run-dir", "run", "--profile-db", "profiles.jsonl",
              TRAIN, "--model", "llama-tiny", "--steps", str(STEPS), "--synthetic"] for node in (0, 1)]
    outputs = run_nodes(argvs, [tmp_path / f"node{node}" for node in (0, 1)], env)
    (out0, err0), (out1, err1) = outputs
    assert "processes on this node  1  (file: node 0, one)" in out0
    assert "processes on this node  3  (file: node 1, three)" in out1
    # rank 0 (node 0) planned for the 4 ranks of both nodes; both run directories hold the plan
    assert "world size              4  (file)" in out0
    for node in (0, 1):
        assert (tmp_path / f"node{node}" / "run" / "plan.json").exists()
    # the script's rank 0 is the first rank of the first stage, on either node
    printed = out0 + out1
    steps = [int(m) for m in re.findall(r"^step (\d+) \|", printed, re.M)]
    assert steps == list(range(1, STEPS + 1)), printed[-3000:]
    assert f"done: {STEPS} steps" in printed


def run_nodes(argvs, cwds, env, timeout_s=900) -> list[tuple[str, str]]:
    """Each node's memx-run in its own folder, its output in files there; (stdout, stderr) of each
    once all ended with 0. A node that fails ends the test at once, with every node's output:
    its peer would wait for it in a collective until that timed out."""
    procs = []
    for argv, cwd in zip(argvs, cwds):
        cwd.mkdir()
        with open(cwd / "stdout", "w") as out, open(cwd / "stderr", "w") as err:
            procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # memx-run and its workers
                proc.wait()
    outputs = [((cwd / "stdout").read_text(), (cwd / "stderr").read_text()) for cwd in cwds]
    ends = ", ".join(f"node {i}: exit {p.returncode}" for i, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), ends + "".join(
        f"\n--- node {i} stdout ---\n{out[-3000:]}\n--- node {i} stderr ---\n{err[-3000:]}"
        for i, (out, err) in enumerate(outputs))
    return outputs
