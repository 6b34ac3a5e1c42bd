"""shared/worker/gpu_telemetry.py: NVML's readings as gauges (against a stand-in for NVML, which cannot run
here), nothing at all on the CPU, and the series on a real GPU (-m gpu)."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pynvml
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from shared.worker.gpu_telemetry import THROTTLE_REASONS, GpuTelemetry, serve_worker_metrics, watch_gpu

GIB = 1 << 30
HANDLE = object()  # NVML's handle of the device, opaque to the telemetry


class FakeNvml:
    """pynvml's calls for one device, in the state a test sets; each checks it is given the handle."""

    NVMLError = pynvml.NVMLError
    NVML_CLOCK_SM, NVML_CLOCK_MEM = pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self):
        self.reasons = pynvml.nvmlClocksEventReasonGpuIdle
        self.power_supported = True

    def _device(self, handle):
        assert handle is HANDLE

    def nvmlDeviceGetIndex(self, handle):
        self._device(handle)
        return 3

    def nvmlDeviceGetClockInfo(self, handle, clock):
        self._device(handle)
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 3201}[clock]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._device(handle)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 41

    def nvmlDeviceGetPowerUsage(self, handle):
        self._device(handle)
        if not self.power_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 352_500  # milliwatts

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._device(handle)
        return SimpleNamespace(gpu=87, memory=45)  # percent

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._device(handle)
        return SimpleNamespace(used=80 * GIB, free=61 * GIB, total=141 * GIB)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        self._device(handle)
        return self.reasons


@pytest.fixture()
def nvml():
    return FakeNvml()


@pytest.fixture()
def registry(nvml) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(GpuTelemetry(nvml, HANDLE))
    return registry


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    """One scrape's gpu_* samples, by name without the prefix, and by reason for the flags; all of gpu 3
    (NVML's index, not CUDA's)."""
    samples = {}
    for family in registry.collect():
        for sample in family.samples:
            assert sample.labels.pop("gpu") == "3", sample
            samples[sample.labels.get("reason", sample.name.removeprefix("pdserve:gpu_"))] = sample.value
    return samples


def throttling(registry: CollectorRegistry) -> set[str]:
    samples = scrape(registry)
    assert {samples[reason] for reason in THROTTLE_REASONS} <= {0.0, 1.0}
    return {reason for reason in THROTTLE_REASONS if samples[reason]}


def test_nvml_readings_become_gauges_in_base_units(registry):
    samples = scrape(registry)
    assert samples["sm_clock_hertz"] == 1980e6 and samples["memory_clock_hertz"] == 3201e6
    assert samples["temperature_celsius"] == 41 and samples["power_watts"] == 352.5
    assert samples["utilization_ratio"] == 0.87 and samples["memory_utilization_ratio"] == 0.45
    assert samples["memory_used_bytes"] == 80 * GIB and samples["memory_total_bytes"] == 141 * GIB
    assert {reason: samples[reason] for reason in THROTTLE_REASONS} == {
        reason: float(reason == "gpu_idle") for reason in THROTTLE_REASONS}


def test_each_throttle_reason_is_its_own_flag_and_a_change_is_logged_once(nvml, registry):
    with capture_logs() as logs:
        assert throttling(registry) == {"gpu_idle"}  # no work: nothing to warn about
        nvml.reasons = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        assert throttling(registry) == {"sw_power_cap", "hw_thermal_slowdown"}
        throttling(registry)  # the same state again: no second line
        nvml.reasons |= pynvml.nvmlClocksEventReasonGpuIdle  # idle besides: the same throttling
        assert throttling(registry) == {"gpu_idle", "sw_power_cap", "hw_thermal_slowdown"}
        nvml.reasons = pynvml.nvmlClocksEventReasonSwPowerCap
        throttling(registry)
        nvml.reasons = pynvml.nvmlClocksEventReasonGpuIdle
        throttling(registry)
        throttling(registry)
    assert [(e["log_level"], e["event"], e.get("reasons")) for e in logs] == [
        ("warning", "gpu throttling", ["hw_thermal_slowdown", "sw_power_cap"]),
        ("warning", "gpu throttling", ["sw_power_cap"]),
        ("info", "gpu no longer throttling", None)]


def test_a_reading_the_board_lacks_is_left_out_and_logged_once(nvml, registry):
    nvml.power_supported = False
    with capture_logs() as logs:
        for _ in range(2):
            samples = scrape(registry)
            assert "power_watts" not in samples and samples["temperature_celsius"] == 41
    assert [(e["event"], e["reading"]) for e in logs] == [("gpu reading unavailable", "pdserve:gpu_power_watts")]


def test_a_cpu_worker_never_touches_nvml():
    registry = CollectorRegistry()
    with capture_logs() as logs:
        assert watch_gpu("cpu", registry) is None
    assert logs == [] and list(registry.collect()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="NVML is there: nothing to go without")
def test_without_nvml_a_gpu_worker_runs_on_without_telemetry():
    registry = CollectorRegistry()
    with capture_logs() as logs:
        assert watch_gpu("cuda:0", registry) is None
    assert [e["event"] for e in logs] == ["gpu telemetry off"]
    assert list(registry.collect()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_worker_serves_its_gpu_with_sane_values():
    held = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")  # at least this much is in use
    torch.cuda.synchronize()
    server = serve_worker_metrics("127.0.0.1:0", "cuda:0")  # port 0: any free one
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("pdserve:gpu_")}
    gpus = {dict(labels)["gpu"] for _, labels in samples}
    assert len(gpus) == 1 and gpus.pop().isdigit(), samples
    value = {name.removeprefix("pdserve:gpu_"): v for (name, labels), v in samples.items() if len(labels) == 1}
    assert 100e6 < value["sm_clock_hertz"] < 5e9 and 100e6 < value["memory_clock_hertz"] < 10e9, value
    assert 5 < value["temperature_celsius"] < 100 and 10 < value["power_watts"] < 2000, value
    assert 0 <= value["utilization_ratio"] <= 1 and 0 <= value["memory_utilization_ratio"] <= 1, value
    assert held.numel() <= value["memory_used_bytes"] <= value["memory_total_bytes"] < 1 << 40, value
    throttled = {dict(labels)["reason"]: v for (name, labels), v in samples.items() if name.endswith("throttled")}
    assert set(throttled) == set(THROTTLE_REASONS) and set(throttled.values()) <= {0.0, 1.0}, throttled
