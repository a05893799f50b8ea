"""Live memory readings behind one interface: NVML for `cuda:N`, host RAM or this process's own
memory for `cpu` (a scripted one for tests lives in the test kit, tests/probes.py).

Only a device's scheduler reads its probe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "HostMemoryProbe",
    "MemoryProbe",
    "MemoryReading",
    "NvmlProbe",
    "ProbeError",
    "ProcessMemoryProbe",
    "make_probe",
]


class ProbeError(RuntimeError):
    """A probe could not produce a trustworthy reading."""


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int
    total_bytes: int

    def check(self) -> MemoryReading:
        """Reject readings that cannot be true, so batch admission never trusts nonsense."""
        if self.total_bytes <= 0 or not 0 <= self.used_bytes <= self.total_bytes:
            raise ProbeError(f"implausible reading: used={self.used_bytes} total={self.total_bytes}")
        return self


@runtime_checkable
class MemoryProbe(Protocol):
    device: str

    def read(self) -> MemoryReading: ...

    def close(self) -> None: ...


class HostMemoryProbe:
    """Host RAM through psutil: used = total - available."""

    def __init__(self, device: str = "cpu") -> None:
        import psutil

        self.device = device
        self._psutil = psutil

    def read(self) -> MemoryReading:
        memory = self._psutil.virtual_memory()
        return MemoryReading(memory.total - memory.available, memory.total).check()

    def close(self) -> None:
        pass


class ProcessMemoryProbe:
    """This router's own memory: the resident set of its process and its children (instances
    with `isolation: process`) above what the process held when the probe opened, out of host RAM.

    On a host shared with other services this budgets what the router adds, not what the
    neighbours use; and it shows an unloaded model's memory coming back.
    """

    def __init__(self, device: str = "cpu") -> None:
        import psutil

        self.device = device
        self._process = psutil.Process()
        self._total = int(psutil.virtual_memory().total)
        self.baseline_bytes = self._tree_rss()

    def _tree_rss(self) -> int:
        import psutil

        total = 0
        for process in [self._process, *self._process.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.Error:  # a child that just exited
                continue
        return int(total)

    def read(self) -> MemoryReading:
        return MemoryReading(max(0, self._tree_rss() - self.baseline_bytes), self._total).check()

    def close(self) -> None:
        pass


class NvmlProbe:
    """GPU memory through NVML (nvidia-ml-py, imported as pynvml).

    `cuda:N` is the N-th visible device, so CUDA_VISIBLE_DEVICES is honoured: NVML itself
    numbers every GPU on the host.
    """

    def __init__(self, device: str) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a core dependency
            raise ProbeError("nvidia-ml-py is not installed; it provides the pynvml module") from exc
        self.device = device
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise ProbeError(f"NVML is not available for {device}: {exc}") from exc
        try:
            self._handle = self._resolve_handle(int(device.split(":", 1)[1]))
        except Exception as exc:
            pynvml.nvmlShutdown()
            if isinstance(exc, ProbeError):
                raise
            raise ProbeError(f"{device}: cannot open the NVML device: {exc}") from exc

    def _resolve_handle(self, logical: int) -> object:
        nvml = self._nvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None or visible.strip() == "":
            return nvml.nvmlDeviceGetHandleByIndex(logical)
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if logical >= len(entries):
            raise ProbeError(f"{self.device}: CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} device(s)")
        entry = entries[logical]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)

    def read(self) -> MemoryReading:
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except self._nvml.NVMLError as exc:
            raise ProbeError(f"NVML read failed for {self.device}: {exc}") from exc
        return MemoryReading(int(info.used), int(info.total)).check()

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def make_probe(device: str, kind: str) -> MemoryProbe | None:
    """The probe a device config asks for; None means the ledger alone governs batch admission."""
    if kind == "none":
        return None
    if kind == "nvml" or (kind == "auto" and device.startswith("cuda")):
        return NvmlProbe(device)
    if kind == "host" or (kind == "auto" and device == "cpu"):
        return HostMemoryProbe(device)
    if kind == "process" and device == "cpu":
        return ProcessMemoryProbe(device)
    raise ProbeError(f"probe {kind!r} cannot read device {device!r}")
