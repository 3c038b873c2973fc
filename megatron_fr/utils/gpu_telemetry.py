"""Per-step GPU figures of this rank, as flat metrics for metrics.jsonl and TensorBoard.

    telemetry = GpuTelemetry()          # once per rank, after torch.cuda.set_device
    metrics |= telemetry.sample()       # once per step: {} where there is no NVML

Through NVML (the nvidia-ml-py package, `pynvml`): the device's memory in use and total (all
processes, the CUDA context included), its utilization over NVML's last sample period and
its power draw; through torch: this process's allocated memory and its peak since the
previous sample (torch.cuda.max_memory_allocated, reset after each reading, so each step
reports its own peak). Without NVML (no driver, a CPU machine: pynvml raises
NVMLError_LibraryNotFound) sample() returns {} and the reason is logged once.

NVML numbers devices physically, ignoring CUDA_VISIBLE_DEVICES: torch's device i is entry i
of that variable (an index or a GPU-/MIG- UUID), not NVML's device i.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
GIB = 2**30


def _import_nvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


def nvml_handle(nvml: Any, cuda_index: int, environ: dict[str, str]) -> Any:
    """NVML's handle of torch's CUDA device `cuda_index` under `environ`'s CUDA_VISIBLE_DEVICES."""
    visible = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [entry for entry in visible if entry]
    entry = visible[cuda_index] if visible else str(cuda_index)
    if entry.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(int(entry))


class GpuTelemetry:
    """This rank's GPU, sampled once per step; off (empty samples) without NVML."""

    def __init__(
        self,
        cuda_index: int | None = None,
        nvml: Any | None = None,
        torch_memory: Callable[[], tuple[int, int]] | None = None,
    ):
        """cuda_index: torch's device (default: the current one). nvml, torch_memory: stand-ins
        for pynvml and for (allocated, peak allocated) bytes, for tests."""
        self._handle: Any = None
        """NVML's handle of the device; None: telemetry is off."""
        self._nvml: Any = None
        self._torch_memory = torch_memory
        try:
            nvml = nvml if nvml is not None else _import_nvml()
            nvml.nvmlInit()
            if cuda_index is None:
                cuda_index = _current_cuda_index()
            self._handle = nvml_handle(nvml, cuda_index, dict(os.environ))
            self._nvml = nvml
        except Exception as error:  # NVMLError_*, ImportError, no CUDA device
            log.info("GPU telemetry off: %s: %s", type(error).__name__, error)
            return
        if self._torch_memory is None:
            self._torch_memory = _torch_memory(cuda_index)

    @property
    def enabled(self) -> bool:
        return self._handle is not None

    def sample(self) -> dict[str, float]:
        """{gpu_mem_used_gib, gpu_mem_total_gib, gpu_util_pct, gpu_power_w,
        gpu_torch_allocated_gib, gpu_torch_peak_gib}; {} when off."""
        if self._handle is None or self._torch_memory is None:  # both set when on
            return {}
        nvml, handle = self._nvml, self._handle
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        metrics = {
            "gpu_mem_used_gib": memory.used / GIB,
            "gpu_mem_total_gib": memory.total / GIB,
            "gpu_util_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "gpu_power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # milliwatts
        }
        allocated, peak = self._torch_memory()
        metrics["gpu_torch_allocated_gib"] = allocated / GIB
        metrics["gpu_torch_peak_gib"] = peak / GIB
        return metrics


def _current_cuda_index() -> int:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    return torch.cuda.current_device()


def _torch_memory(cuda_index: int) -> Callable[[], tuple[int, int]]:
    import torch

    def read() -> tuple[int, int]:
        allocated = torch.cuda.memory_allocated(cuda_index)
        peak = torch.cuda.max_memory_allocated(cuda_index)
        torch.cuda.reset_peak_memory_stats(cuda_index)  # the next sample: the next step's peak
        return allocated, peak

    return read
