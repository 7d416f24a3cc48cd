"""The memory bandwidth the cost model times element-wise work, GEMMs' memory side and the optimizer
step at: the vendor's sustained share of the datasheet figure, taken from public STREAM runs (the
layer times that move at it: tests/test_framework_memory.py)."""

import csv
import os
import statistics

import pytest

from memx_launch.planning.peaks import SUSTAINED_HBM_SHARE, datasheet_of_sustained_gbps, hbm_gbps
from memx_launch.specs.cluster import DeviceType

STREAM_RUNS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "hbm_stream.csv")


def test_each_vendors_share_is_the_median_of_its_public_stream_runs():
    with open(STREAM_RUNS, newline="") as f:
        rows = list(csv.DictReader(f))
    for vendor, share in SUSTAINED_HBM_SHARE.items():
        runs = [float(r["triad_gbps"]) / float(r["datasheet_gbps"]) for r in rows if r["vendor"] == vendor]
        assert len(runs) >= 2 and all(0.5 < run < 1.0 for run in runs)
        assert share == round(statistics.median(runs), 2)


@pytest.mark.parametrize("vendor, sustained", [("nvidia", 3440.0), ("amd", 3040.0), ("cpu", 4000.0),
                                               ("intel", 4000.0)])
def test_no_device_moves_more_than_its_datasheet_and_a_measured_rate_comes_back(vendor, sustained):
    device = DeviceType("d", vendor, memory_gib=80, peak_tflops=900, memory_bandwidth_gbps=4000)
    assert hbm_gbps(device) == pytest.approx(sustained)
    # An emulated cluster's CPU stand-in runs as given, whatever vendor it stands in for.
    assert hbm_gbps(device, stand_in=True) == 4000.0
    # A calibration's copy rate is written as the datasheet figure it stands for (profiling/kernel.py).
    measured = DeviceType("d", vendor, memory_gib=80, peak_tflops=900,
                          memory_bandwidth_gbps=datasheet_of_sustained_gbps(3000.0, vendor))
    assert hbm_gbps(measured) == pytest.approx(3000.0)


def test_estimate_and_plan_say_what_rates_they_timed_each_device_type_at(tmp_path, capsys):
    from estimates import cluster_file

    from memx_launch.cli import main

    h100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "memory_bandwidth_gbps": 3350,
            "compute_capability": 9.0}
    cluster = cluster_file(tmp_path, {"version": 1, "name": "h100x8", "device_types": {"h100": h100},
                                      "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]})
    args = ["estimate", "--model", "llama2-7b", "--cluster", cluster, "--tp", "8", "--pp", "1", "--dp", "1",
            "--micro-batch-size", "1", "--global-batch-size", "8"]
    assert main(args) == 0
    rates = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rates")]
    # Hopper's default 0.58 of the 16-bit peak; NVIDIA's 0.86 of the datasheet bandwidth.
    assert rates == ["rates (analytical): h100 matmuls 574 of 989 TFLOPS, memory 2,881 of 3,350 GB/s"]
    assert main([*args, "--fp8", "current"]) == 0
    assert "(1,147 in its FP8 linears)" in capsys.readouterr().out
    # memx plan prints the same line for the types it planned on.
    assert main(["plan", "--model", "llama2-7b", "--cluster", cluster, "--global-batch-size", "8"]) == 0
    assert rates[0] in capsys.readouterr().out.splitlines()
