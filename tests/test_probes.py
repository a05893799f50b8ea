"""Memory probes: one contract over every probe available here, then each probe's own behaviour.

NVML device mapping is tested against a fake `pynvml` module behind the same interface.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from router.scheduling.memory import (
    HostMemoryProbe,
    MemoryProbe,
    MemoryReading,
    NvmlProbe,
    ProbeError,
    ProcessMemoryProbe,
    _meminfo_kib,
    make_probe,
)
from tests.probes import ScriptedProbe

MiB = 1024**2


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


CUDA = cuda_available()
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA GPU (torch.cuda.is_available() is False)")]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: HostMemoryProbe("cpu"), id="host"),
        pytest.param(lambda: ProcessMemoryProbe("cpu"), id="process"),
        pytest.param(lambda: ScriptedProbe("cuda:0", [MemoryReading(100, 1000)]), id="scripted"),
        pytest.param(lambda: NvmlProbe("cuda:0"), id="nvml", marks=needs_gpu),
    ],
)
def test_probe_contract(make: Callable[[], MemoryProbe]) -> None:
    probe = make()
    try:
        assert isinstance(probe, MemoryProbe)
        for _ in range(2):
            reading = probe.read()
            assert isinstance(reading, MemoryReading)
            assert reading.total_bytes > 0
            assert 0 <= reading.used_bytes <= reading.total_bytes
    finally:
        probe.close()


def test_host_probe_agrees_with_psutil() -> None:
    probe = HostMemoryProbe()

    reading = probe.read()
    memory = psutil.virtual_memory()

    assert reading.total_bytes == memory.total
    assert abs(reading.used_bytes - (memory.total - memory.available)) < 300 * MiB


def test_host_probe_reads_meminfo_fields_and_falls_back_to_psutil_without_them() -> None:
    text = b"MemTotal:       24684124 kB\nMemFree:   100 kB\nMemAvailable:   20000000 kB\n"
    assert _meminfo_kib(text, b"MemTotal:") == 24684124
    assert _meminfo_kib(text, b"MemAvailable:") == 20000000
    assert _meminfo_kib(b"MemTotal: 5 kB\n", b"MemAvailable:") is None
    probe = HostMemoryProbe()
    probe.close()  # no /proc/meminfo descriptor: psutil answers
    assert probe.read().total_bytes == psutil.virtual_memory().total


def test_process_probe_sees_this_process_grow_and_shrink_above_its_baseline() -> None:
    probe = ProcessMemoryProbe()
    before = probe.read().used_bytes
    block = bytearray(200 * MiB)  # touched: resident
    grown = probe.read().used_bytes
    del block
    shrunk = probe.read().used_bytes
    assert grown - before > 180 * MiB
    assert grown - shrunk > 180 * MiB  # a large block goes back to the system at once
    probe.close()


def test_scripted_probe_repeats_its_last_reading() -> None:
    probe = ScriptedProbe("cuda:0", [MemoryReading(1, 10), MemoryReading(2, 10)])

    assert [probe.read().used_bytes for _ in range(4)] == [1, 2, 2, 2]
    assert probe.reads == 4


def test_scripted_probe_raises_scripted_exceptions_then_continues() -> None:
    probe = ScriptedProbe("cuda:0", [MemoryReading(1, 10), ProbeError("driver hiccup"), MemoryReading(3, 10)])

    assert probe.read().used_bytes == 1
    with pytest.raises(ProbeError, match="driver hiccup"):
        probe.read()
    assert probe.read().used_bytes == 3


def test_scripted_probe_can_read_from_a_callable() -> None:
    readings = iter([MemoryReading(5, 10), MemoryReading(6, 10)])
    probe = ScriptedProbe("cpu", lambda: next(readings))

    assert (probe.read().used_bytes, probe.read().used_bytes) == (5, 6)


def test_scripted_probe_without_readings_raises_probe_error() -> None:
    with pytest.raises(ProbeError, match="no readings"):
        ScriptedProbe("cpu", []).read()


@pytest.mark.parametrize(
    "reading",
    [MemoryReading(11, 10), MemoryReading(0, 0), MemoryReading(-1, 10), MemoryReading(5, -10)],
    ids=["used-above-total", "total-zero", "used-negative", "total-negative"],
)
@pytest.mark.parametrize("as_callable", [False, True], ids=["sequence", "callable"])
def test_implausible_readings_are_rejected(reading: MemoryReading, as_callable: bool) -> None:
    probe = ScriptedProbe("cpu", (lambda: reading) if as_callable else [reading])

    with pytest.raises(ProbeError, match="implausible"):
        probe.read()


# -- NVML behind a fake pynvml -------------------------------------------------------------------


def fake_pynvml(gpu_count: int = 4) -> types.ModuleType:
    """A pynvml stand-in: handle i reports used = 1000 * i; a UUID handle reports used = 4242."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def by_index(index: int) -> tuple[str, Any]:
        if not 0 <= index < gpu_count:
            raise NVMLError("Invalid Argument")
        return ("index", index)

    def memory_info(handle: tuple[str, Any]) -> types.SimpleNamespace:
        if module.fail_reads:  # type: ignore[attr-defined]
            raise NVMLError("GPU is lost")
        used = 4242 if handle[0] == "uuid" else 1000 * handle[1]
        return types.SimpleNamespace(used=used, total=100_000, free=100_000 - used)

    def shutdown() -> None:
        module.shutdowns += 1  # type: ignore[attr-defined]
        if module.fail_shutdown:  # type: ignore[attr-defined]
            raise NVMLError("Uninitialized")

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = by_index  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByUUID = lambda uuid: ("uuid", uuid)  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory_info  # type: ignore[attr-defined]
    module.shutdowns = 0  # type: ignore[attr-defined]
    module.fail_reads = False  # type: ignore[attr-defined]
    module.fail_shutdown = False  # type: ignore[attr-defined]
    return module


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


@pytest.mark.parametrize(
    ("visible", "device", "used"),
    [
        (None, "cuda:2", 2000),
        ("", "cuda:1", 1000),
        ("3,1", "cuda:0", 3000),
        ("3,1", "cuda:1", 1000),
        (" 2 , 0 ", "cuda:0", 2000),
        ("GPU-aaaa,GPU-bbbb", "cuda:1", 4242),
    ],
)
def test_nvml_probe_maps_logical_devices_through_cuda_visible_devices(
    nvml: types.ModuleType, monkeypatch: pytest.MonkeyPatch, visible: str | None, device: str, used: int
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    probe = NvmlProbe(device)

    assert probe.read() == MemoryReading(used, 100_000)
    probe.close()
    assert nvml.shutdowns == 1


def test_nvml_probe_rejects_a_device_beyond_cuda_visible_devices(
    nvml: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")

    with pytest.raises(ProbeError, match="CUDA_VISIBLE_DEVICES='1' lists 1 device"):
        NvmlProbe("cuda:1")
    assert nvml.shutdowns == 1


@pytest.mark.parametrize("device", ["cuda:7", "cpu"], ids=["index-not-on-host", "no-index"])
def test_nvml_probe_handle_failures_are_probe_errors(nvml: types.ModuleType, device: str) -> None:
    try:
        NvmlProbe(device)
    except ProbeError:
        pass
    except Exception as exc:
        raise AssertionError(f"NvmlProbe({device!r}) raised {type(exc).__name__}, not ProbeError") from exc
    else:
        raise AssertionError(f"NvmlProbe({device!r}) did not fail")
    assert nvml.shutdowns == 1


def test_nvml_probe_turns_read_failures_into_probe_errors(nvml: types.ModuleType) -> None:
    probe = NvmlProbe("cuda:0")
    nvml.fail_reads = True  # type: ignore[attr-defined]

    with pytest.raises(ProbeError, match="GPU is lost"):
        probe.read()


def test_nvml_probe_init_failure_is_a_probe_error(nvml: types.ModuleType) -> None:
    def init() -> None:
        raise nvml.NVMLError("Driver Not Loaded")  # type: ignore[attr-defined]

    nvml.nvmlInit = init  # type: ignore[attr-defined]

    with pytest.raises(ProbeError, match="NVML is not available for cuda:0: Driver Not Loaded"):
        NvmlProbe("cuda:0")


def test_nvml_probe_close_ignores_nvml_errors(nvml: types.ModuleType) -> None:
    probe = NvmlProbe("cuda:0")
    nvml.fail_shutdown = True  # type: ignore[attr-defined]

    probe.close()

    assert nvml.shutdowns == 1


@pytest.mark.parametrize(
    ("device", "kind", "expected"),
    [
        ("cpu", "auto", HostMemoryProbe),
        ("cpu", "host", HostMemoryProbe),
        ("cpu", "process", ProcessMemoryProbe),
        ("cuda:0", "host", HostMemoryProbe),
        ("cuda:1", "auto", NvmlProbe),
        ("cuda:0", "nvml", NvmlProbe),
        ("cpu", "none", None),
        ("cuda:0", "none", None),
    ],
)
def test_make_probe_picks_the_probe_for_the_device(
    nvml: types.ModuleType, device: str, kind: str, expected: type | None
) -> None:
    probe = make_probe(device, kind)

    if expected is None:
        assert probe is None
    else:
        assert type(probe) is expected
        assert probe.device == device  # type: ignore[union-attr]


def test_make_probe_rejects_an_unknown_kind() -> None:
    with pytest.raises(ProbeError, match="'bogus'"):
        make_probe("cpu", "bogus")


# -- real NVML -----------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="a CUDA GPU is present; this checks the no-GPU path")
def test_nvml_probe_without_a_gpu_raises_probe_error() -> None:
    with pytest.raises(ProbeError):
        NvmlProbe("cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA GPU (torch.cuda.is_available() is False)")
def test_nvml_probe_agrees_with_torch_on_the_first_visible_gpu(record_property: Any) -> None:
    import torch

    probe = NvmlProbe("cuda:0")
    try:
        reading = probe.read()
        free, total = torch.cuda.mem_get_info(0)
    finally:
        probe.close()
    record_property("figure", f"NVML used {reading.used_bytes / MiB:.0f} MiB, torch {(total - free) / MiB:.0f} MiB "
                              f"(of {total / MiB:.0f} MiB)")

    assert abs(reading.total_bytes - total) <= 0.02 * total
    assert abs(reading.used_bytes - (total - free)) <= 0.02 * total + 512 * MiB
