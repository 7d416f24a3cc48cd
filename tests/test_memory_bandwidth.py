"""The memory bandwidth the cost model times element-wise work, GEMMs' memory side and the optimizer
step at: the vendor's sustained share of the datasheet figure, taken from public STREAM runs (the
layer times that move at it: tests/test_framework_memory.py)."""

import csv
import os
import statistics

import pytest

from memx_launch.planning.peaks import SUSTAINED_HBM_SHARE, datasheet_hbm_gbps, hbm_gbps
from memx_launch.specs.cluster import DeviceType

STREAM_RUNS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "hbm_stream.csv")


def test_each_vendors_share_is_the_median_of_its_public_stream_runs():
    with open(STREAM_RUNS, newline="") as f:
        rows = list(csv.DictReader(f))
    for vendor, share in SUSTAINED_HBM_SHARE.items():
        runs = [float(r["triad_gbps"]) / float(r["datasheet_gbps"]) for r in rows if r["vendor"] == vendor]
        assert len(runs) >= 2 and all(0.5 < run < 1.0 for run in runs)
        assert share == round(statistics.median(runs), 2)


@pytest.mark.parametrize("vendor", ["nvidia", "amd", "cpu", "intel"])
def test_no_device_moves_more_than_its_datasheet_and_a_measured_rate_comes_back(vendor):
    device = DeviceType("d", vendor, memory_gib=80, peak_tflops=900, memory_bandwidth_gbps=4000)
    sustained = hbm_gbps(device)
    assert sustained <= 4000.0 and sustained == pytest.approx(4000.0 * SUSTAINED_HBM_SHARE.get(vendor, 1.0))
    # An emulated cluster's CPU stand-in runs as given, whatever vendor it stands in for.
    assert hbm_gbps(device, stand_in=True) == 4000.0
    # A calibration's copy rate is written as the datasheet figure it stands for (profiling/kernel.py).
    measured = DeviceType("d", vendor, memory_gib=80, peak_tflops=900,
                          memory_bandwidth_gbps=datasheet_hbm_gbps(3000.0, vendor))
    assert hbm_gbps(measured) == pytest.approx(3000.0)
