"""A device's memory, as its scheduler knows it: what the router has promised there (the ledger:
weights booked at load, reservations held by running batches), and what a live reading shows
(probes behind one interface: NVML for `cuda:N`, host RAM or this process's own memory for `cpu`;
a scripted one for tests lives in the test kit, tests/probes.py).

Only a device's scheduler books its ledger and reads its probe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "HostMemoryProbe",
    "MemoryLedger",
    "MemoryProbe",
    "MemoryReading",
    "NvmlProbe",
    "ProbeError",
    "ProcessMemoryProbe",
    "Reservation",
    "make_probe",
]


# -- the ledger: what the router promised ---------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    batch_id: int
    model: str
    bytes: int


class MemoryLedger:
    """Bytes the router has promised on one device. Owned by that device's scheduler."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._weights: dict[str, int] = {}  # instance key -> bytes
        self._weights_model: dict[str, str] = {}  # instance key -> model
        self._reservations: dict[int, Reservation] = {}
        self._next_id = 0
        self.peak_bytes = 0

    def book_weights(self, instance_key: str, model: str, nbytes: int) -> None:
        self._weights[instance_key] = nbytes
        self._weights_model[instance_key] = model
        self._update_peak()

    def release_weights(self, instance_key: str) -> None:
        self._weights.pop(instance_key, None)
        self._weights_model.pop(instance_key, None)

    def reserve(self, model: str, nbytes: int) -> Reservation:
        self._next_id += 1
        reservation = Reservation(self._next_id, model, nbytes)
        self._reservations[reservation.batch_id] = reservation
        self._update_peak()
        return reservation

    def release(self, reservation: Reservation) -> None:
        self._reservations.pop(reservation.batch_id, None)

    @property
    def weights_bytes(self) -> int:
        return sum(self._weights.values())

    @property
    def reserved_bytes(self) -> int:
        """Outstanding batch reservations."""
        return sum(r.bytes for r in self._reservations.values())

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.reserved_bytes

    @property
    def running_batches(self) -> int:
        return len(self._reservations)

    def model_bytes(self, model: str) -> int:
        """Weights plus running reservations of one model on this device."""
        weights = sum(b for key, b in self._weights.items() if self._weights_model[key] == model)
        return weights + sum(r.bytes for r in self._reservations.values() if r.model == model)

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)


# -- probes: what a live reading shows -------------------------------------------------------------


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
    """Host RAM: used = total - available. On Linux, MemTotal and MemAvailable straight from
    /proc/meminfo (the scheduler reads it around every batch: psutil's full parse cost ten times
    as much); psutil elsewhere."""

    def __init__(self, device: str = "cpu") -> None:
        import psutil

        self.device = device
        self._psutil = psutil
        try:
            self._meminfo: int | None = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._meminfo = None

    def read(self) -> MemoryReading:
        if self._meminfo is not None:
            text = os.pread(self._meminfo, 8192, 0)
            total, available = _meminfo_kib(text, b"MemTotal:"), _meminfo_kib(text, b"MemAvailable:")
            if total is not None and available is not None:
                return MemoryReading((total - available) * 1024, total * 1024).check()
        memory = self._psutil.virtual_memory()
        return MemoryReading(memory.total - memory.available, memory.total).check()

    def close(self) -> None:
        if self._meminfo is not None:
            os.close(self._meminfo)
            self._meminfo = None


def _meminfo_kib(text: bytes, field: bytes) -> int | None:
    """A /proc/meminfo field's value in KiB (`MemTotal:   24684124 kB`), or None if absent."""
    at = text.find(field)
    if at < 0:
        return None
    end = text.find(b"\n", at)
    try:
        return int(text[at + len(field):end if end >= 0 else None].split()[0])
    except (ValueError, IndexError):
        return None


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
