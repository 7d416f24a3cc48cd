"""GPUs under a board power limit below their rated power (Meta's Grand Teton H100s run at 500 of
700 W): compute-bound work keeps the clock the limit leaves, HBM and links keep theirs."""

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.runtime.devices import power_hint
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.efficiency import default_efficiency, power_limited_clock_share
from memx_launch.specs.training import TrainingSpec

H100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "memory_bandwidth_gbps": 3350,
        "compute_capability": 9.0}


def _cluster(**fields) -> ClusterSpec:
    return ClusterSpec.from_dict({"version": 1, "device_types": {"h100": {**H100, **fields}},
                                  "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]})


def test_the_clock_share_is_one_at_the_rated_power_and_falls_as_the_cube_root_of_the_power_above_idle():
    assert power_limited_clock_share(700, 700) == 1.0
    assert power_limited_clock_share(500, 700) == pytest.approx(((500 - 70) / 630) ** (1 / 3))
    limits = np.linspace(80, 700, 50)
    shares = [power_limited_clock_share(w, 700) for w in limits]
    assert all(0 < s <= 1 for s in shares) and np.all(np.diff(shares) > 0)
    # A cubic law: a 29% lower limit costs the clock far less than 29%.
    assert 0.85 < power_limited_clock_share(500, 700) < 0.9


def test_a_power_limit_scales_the_default_efficiency_but_not_a_measured_one():
    rated = _cluster().device_type("h100")
    capped = _cluster(power_limit_w=500, rated_power_w=700).device_type("h100")
    assert rated.effective_tflops == pytest.approx(989 * default_efficiency("nvidia", 9.0))
    assert capped.effective_tflops == pytest.approx(rated.effective_tflops * power_limited_clock_share(500, 700))
    measured = _cluster(power_limit_w=500, rated_power_w=700, efficiency=0.5).device_type("h100")
    assert measured.effective_tflops == pytest.approx(989 * 0.5)
    at_rated = _cluster(power_limit_w=700, rated_power_w=700).device_type("h100")
    assert at_rated.effective_tflops == rated.effective_tflops


@pytest.mark.parametrize("fields, names", [
    ({"power_limit_w": 500}, "power_limit_w"),
    ({"rated_power_w": 700}, "power_limit_w"),
    ({"power_limit_w": 800, "rated_power_w": 700}, "power_limit_w"),
    ({"power_limit_w": 50, "rated_power_w": 700}, "power_limit_w"),
    ({"power_limit_w": 500, "rated_power_w": -1}, "rated_power_w"),
])
def test_an_incomplete_or_impossible_power_limit_is_refused_by_field(fields, names):
    with pytest.raises(ConfigError) as err:
        _cluster(**fields)
    assert f"device_types.h100.{names}" in str(err.value)


def _estimate(cluster: ClusterSpec):
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron")
    return evaluate_layout(get_model("llama2-7b"), cluster, training, tp=1, pp=1, dp=8, micro_batch_size=2,
                           recompute="none", references=(1, 1, 1))


def test_a_capped_gpu_takes_longer_by_at_most_the_clock_it_loses_and_holds_the_same_memory():
    rated, capped = _estimate(_cluster()), _estimate(_cluster(power_limit_w=500, rated_power_w=700))
    ratio = capped.predicted_iteration_time_s / rated.predicted_iteration_time_s
    # Compute-bound work slows by the clock; HBM-bound work and the links do not.
    assert 1.05 < ratio <= 1.0 / power_limited_clock_share(500, 700) + 1e-9
    assert [s.predicted_peak_memory_gib for s in capped.stages] == [s.predicted_peak_memory_gib for s in rated.stages]


def test_the_settings_line_names_a_power_limit_the_file_leaves_out():
    rated = _cluster().device_type("h100")
    assert "add power_limit_w: 500 and rated_power_w: 700" in power_hint(rated, (500.0, 700.0))
    assert power_hint(rated, (700.0, 700.0)) == "" and power_hint(rated, None) == ""
    # Said in the file, or an efficiency measured under it: nothing to add.
    assert power_hint(_cluster(power_limit_w=500, rated_power_w=700).device_type("h100"), (500.0, 700.0)) == ""
    assert power_hint(_cluster(efficiency=0.5).device_type("h100"), (500.0, 700.0)) == ""


def test_the_plan_header_says_what_the_power_limit_counted():
    from memx_launch.planning.report import header

    assert len(header(_cluster(), "llama2-7b")) == 1
    [_, line] = header(_cluster(power_limit_w=500, rated_power_w=700), "llama2-7b")
    assert line == "h100: power limit 500 of 700 W, compute at 0.88 of the rated clock"
    [_, line] = header(_cluster(power_limit_w=500, rated_power_w=700, efficiency=0.5), "llama2-7b")
    assert "given efficiency taken as measured under it" in line


def test_a_detected_gpu_type_folds_its_power_limit_into_the_efficiency_it_is_written_with():
    from memx_launch.profiling.kernel import detected_efficiency
    from memx_launch.specs.efficiency import training_share_of_best_matmul

    full = detected_efficiency("nvidia", 9.0, None)
    assert full == round(training_share_of_best_matmul("nvidia", 9.0), 3)
    assert detected_efficiency("nvidia", 9.0, (700.0, 700.0)) == full
    assert detected_efficiency("nvidia", 9.0, (500.0, 700.0)) == pytest.approx(full * 0.88, abs=0.002)


def test_an_amd_gpu_s_power_cap_is_read_from_the_amdgpu_driver_s_hwmon_files(tmp_path):
    from memx_launch.profiling.kernel import amdgpu_power_limits

    address = "0000:0c:00.0"
    hwmon = tmp_path / address / "hwmon" / "hwmon3"
    hwmon.mkdir(parents=True)
    (hwmon / "power1_cap").write_text("600000000\n")
    (hwmon / "power1_cap_max").write_text("750000000\n")
    assert amdgpu_power_limits(address, str(tmp_path)) == (600.0, 750.0)
    assert amdgpu_power_limits("0000:0d:00.0", str(tmp_path)) is None  # another GPU: no files
    (hwmon / "power1_cap_max").write_text("n/a\n")
    assert amdgpu_power_limits(address, str(tmp_path)) is None


def test_an_nvidia_gpu_s_power_limits_come_from_nvml_for_the_gpu_of_its_cuda_uuid(monkeypatch):
    import sys
    import types

    import torch

    from memx_launch.profiling.kernel import power_limits

    # NVML numbers every GPU of the machine; CUDA index 0 of this process is the one of uuid "b".
    limits = {"GPU-a": (700_000, 700_000), "GPU-b": (500_000, 700_000)}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetEnforcedPowerLimit=lambda handle: limits[handle][0],
        nvmlDeviceGetPowerManagementLimitConstraints=lambda handle: (200_000, limits[handle][1]))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="b"))
    assert power_limits(0) == (500.0, 700.0)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: no limit known, no error
    assert power_limits(0) is None
