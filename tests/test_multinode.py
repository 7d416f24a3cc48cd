"""Nodes of different sizes: two memx-run "nodes" on localhost (1 and 3 processes, static
rendezvous, emulated device types), each with its own run directory as on separate machines,
no --nproc-per-node: each takes its count from its entry in the cluster file. They calibrate,
plan for 4 ranks and train."""

import os
import re
import subprocess
import sys

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
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        argv = [sys.executable, "-m", "memx_launch.runtime.launcher", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--max-restarts", "0", "--cluster", str(tmp_path / "cluster.yaml"), "--global-batch-size", "4",
                "--seq-len", "64", "--run-dir", "run", "--profile-db", "profiles.jsonl",
                TRAIN, "--model", "llama-tiny", "--steps", str(STEPS), "--synthetic"]
        procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=900))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-4000:]
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
