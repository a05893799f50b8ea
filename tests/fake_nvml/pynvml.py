"""A stand-in for nvidia-ml-py's `pynvml` on machines without a GPU, for a router process started
with this folder first on PYTHONPATH: the real `NvmlProbe` then reads one device whose memory
figures come from the environment, and every Nth read fails as a broken driver would.

    FAKE_NVML_TOTAL_BYTES   total memory (default 16 GiB)
    FAKE_NVML_USED_FRACTION used memory as a share of total (default 0.1)
    FAKE_NVML_FAIL_EVERY    every Nth memory read raises NVMLError (default 0: never)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_reads = 0


class NVMLError(Exception):
    pass


@dataclass(frozen=True)
class _Memory:
    total: int
    used: int
    free: int


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if index != 0:
        raise NVMLError(f"fake NVML has one device, not {index}")
    return 0


def nvmlDeviceGetHandleByUUID(uuid: str) -> int:
    return 0


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:
    global _reads
    _reads += 1
    every = int(os.environ.get("FAKE_NVML_FAIL_EVERY", "0"))
    if every and _reads % every == 0:
        raise NVMLError(f"fake NVML: read {_reads} fails (every {every})")
    total = int(os.environ.get("FAKE_NVML_TOTAL_BYTES", str(16 << 30)))
    used = int(total * float(os.environ.get("FAKE_NVML_USED_FRACTION", "0.1")))
    return _Memory(total, used, total - used)
