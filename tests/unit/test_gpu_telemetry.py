"""GPU telemetry: off (empty, logged once) where NVML is missing, as on this CPU machine with
the real pynvml; the metrics from a stand-in of pynvml's functions, with CUDA_VISIBLE_DEVICES
mapped to NVML's physical numbering."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_fr.utils import gpu_telemetry
from megatron_fr.utils.gpu_telemetry import GIB, GpuTelemetry, nvml_handle


class StubNvml:
    """pynvml's calls the telemetry makes, with fixed answers per physical device."""

    def __init__(self):
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("index", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("uuid", uuid)

    def nvmlDeviceGetMemoryInfo(self, handle):
        assert handle == ("index", 5)
        return SimpleNamespace(used=30 * GIB, total=80 * GIB, free=50 * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 612_345  # milliwatts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without a GPU")
def test_without_nvml_samples_are_empty_and_the_reason_is_logged_once(caplog):
    import pynvml  # the real nvidia-ml-py: raises NVMLError_LibraryNotFound here

    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()
    with caplog.at_level(logging.INFO, logger=gpu_telemetry.__name__):
        telemetry = GpuTelemetry()
        assert not telemetry.enabled
        assert telemetry.sample() == {} and telemetry.sample() == {}
    off = [r for r in caplog.records if "GPU telemetry off" in r.getMessage()]
    assert len(off) == 1 and "NVMLError" in off[0].getMessage()


def test_metrics_from_nvml_and_torch_are_flat_floats(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    peaks = iter([(2 * GIB, 9 * GIB), (2 * GIB, 3 * GIB)])
    telemetry = GpuTelemetry(cuda_index=1, nvml=StubNvml(), torch_memory=lambda: next(peaks))
    assert telemetry.sample() == {
        "gpu_mem_used_gib": 30.0,
        "gpu_mem_total_gib": 80.0,
        "gpu_util_pct": 87.0,
        "gpu_power_w": 612.345,
        "gpu_torch_allocated_gib": 2.0,
        "gpu_torch_peak_gib": 9.0,
    }
    assert telemetry.sample()["gpu_torch_peak_gib"] == 3.0  # each step its own peak


def test_cuda_visible_devices_maps_to_nvml_devices():
    nvml = StubNvml()
    assert nvml_handle(nvml, 0, {}) == ("index", 0)
    assert nvml_handle(nvml, 1, {"CUDA_VISIBLE_DEVICES": "6, 3"}) == ("index", 3)
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
    assert nvml_handle(nvml, 1, uuids) == ("uuid", "GPU-bbbb")
