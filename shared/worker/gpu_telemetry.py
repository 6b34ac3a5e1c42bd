"""The state of a worker's GPU, read through NVML and served with the worker's metrics: clocks,
temperature, power, utilization, memory, and why the clocks are held down.

A collector that reads NVML when Prometheus scrapes, rather than a thread that samples: nothing
runs between scrapes, every scrape sees the device as it is then rather than as of the last
sample, and the reads happen in the metrics server's thread, off the worker's loop (NVML's calls
go through ctypes, which lets go of the GIL while they run). The cost of that choice: throttling
is seen, and logged, only when a scrape looks, so throttling that comes and goes between two
scrapes is missed by the log as it is by the gauges.

NVML numbers the host's devices (nvidia-smi's index), whatever CUDA_VISIBLE_DEVICES shows this
process: the worker's device is found by its UUID, and the series' `gpu` label is NVML's index,
the one nvidia-smi and DCGM show.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

import pynvml
import structlog
import torch
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from shared.runtime import metrics

log = structlog.get_logger()

# NVML's clock event reasons, by the `reason` label of pdserve:gpu_clocks_throttled.
THROTTLE_REASONS = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
IDLE = "gpu_idle"  # clocks down for want of work: nothing to warn about
THROTTLED = "pdserve:gpu_clocks_throttled"

# name, help, and how to read it from (nvml, handle); in Prometheus' base units.
READINGS: tuple[tuple[str, str, Callable], ...] = (
    ("pdserve:gpu_sm_clock_hertz", "The GPU's SM clock.",
     lambda nvml, h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM) * 1e6),
    ("pdserve:gpu_memory_clock_hertz", "The GPU's memory clock.",
     lambda nvml, h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM) * 1e6),
    ("pdserve:gpu_temperature_celsius", "The GPU die's temperature.",
     lambda nvml, h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
    ("pdserve:gpu_power_watts", "The board's power draw.",
     lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1e3),
    ("pdserve:gpu_utilization_ratio", "Share of NVML's last sample period in which a kernel ran.",
     lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100),
    ("pdserve:gpu_memory_utilization_ratio", "Share of NVML's last sample period in which memory was read or written.",
     lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).memory / 100),
    ("pdserve:gpu_memory_used_bytes", "Device memory in use, by every process on the GPU.",
     lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used),
    ("pdserve:gpu_memory_total_bytes", "Device memory in all.",
     lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).total),
)


class GpuTelemetry(Collector):
    """One GPU's gauges, read at each scrape. nvml: the pynvml module; handle: the device's."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        self.gpu = str(nvml.nvmlDeviceGetIndex(handle))
        self.lock = threading.Lock()  # two scrapes may run at once, in two threads
        self.unavailable: set[str] = set()  # readings whose failure is already logged
        self.throttling: frozenset[str] = frozenset()  # reasons other than idle, as last seen

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, read in READINGS:
            value = self._read(name, lambda: read(self.nvml, self.handle))
            if value is not None:
                family = GaugeMetricFamily(name, documentation, labels=["gpu"])
                family.add_metric([self.gpu], value)
                yield family
        mask = self._read(THROTTLED, lambda: self.nvml.nvmlDeviceGetCurrentClocksEventReasons(self.handle))
        if mask is None:
            return
        self._log_throttling(frozenset(r for r, bit in THROTTLE_REASONS.items() if mask & bit and r != IDLE))
        family = GaugeMetricFamily(THROTTLED, "1 while NVML reports this reason for the clocks being held down.",
                                   labels=["gpu", "reason"])
        for reason, bit in THROTTLE_REASONS.items():
            family.add_metric([self.gpu, reason], 1.0 if mask & bit else 0.0)
        yield family

    def _read(self, name: str, read: Callable[[], float]) -> float | None:
        """None where NVML fails (a reading the board does not support, a GPU gone): that series
        is left out of the scrape, which still serves the rest; logged once per reading."""
        try:
            return read()
        except self.nvml.NVMLError as exc:
            with self.lock:
                first = name not in self.unavailable
                self.unavailable.add(name)
            if first:
                log.warning("gpu reading unavailable", gpu=self.gpu, reading=name, error=str(exc))
            return None

    def _log_throttling(self, reasons: frozenset[str]) -> None:
        """Logged once per change of the reasons other than idle: a warning while there are any."""
        with self.lock:
            changed, self.throttling = reasons != self.throttling, reasons
        if changed and reasons:
            log.warning("gpu throttling", gpu=self.gpu, reasons=sorted(reasons))
        elif changed:
            log.info("gpu no longer throttling", gpu=self.gpu)


def watch_gpu(device: str, registry: CollectorRegistry) -> GpuTelemetry | None:
    """Registers the telemetry of `device` ("cuda:0": torch's name, as this process sees the GPUs).
    Anything but a CUDA device gets nothing, and NVML is never loaded. Where NVML cannot serve it
    (no driver library, no device of the UUID CUDA gives) the worker runs on without, with a warning."""
    torch_device = torch.device(device)
    if torch_device.type != "cuda":
        return None
    try:
        pynvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(torch_device.index or 0).uuid
        telemetry = GpuTelemetry(pynvml, pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"))
    except pynvml.NVMLError as exc:
        log.warning("gpu telemetry off", device=device, error=str(exc))
        return None
    registry.register(telemetry)
    log.info("gpu telemetry on", device=device, gpu=telemetry.gpu)
    return telemetry


def serve_worker_metrics(address: str, device: str) -> WSGIServer | None:
    """A worker's endpoint: its pages and queues (metrics.WORKER) and, on a GPU, the GPU's state."""
    server = metrics.serve(address, metrics.WORKER)
    if server is not None:
        watch_gpu(device, REGISTRY)
    return server
