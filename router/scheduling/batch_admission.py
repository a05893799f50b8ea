"""Batch admission: a pure function from (candidates, device state) to the batches admitted.

No I/O, no clock, no locks. The device scheduler gathers the inputs, calls `admit_batches`,
and dispatches the batches it admits. (Requests meet the deadline gate earlier, in
`router.scheduling.service_time`; this rule is about memory.)

Mirrored copies (shadow candidates) take only spare capacity: a batch of them is admitted only when
no real item waits on the device (`DeviceState.real_waiting`) and no real candidate is offered, and
never holds back a real batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["AdmittedBatch", "BatchAdmission", "Candidate", "DeviceState", "admit_batches", "fits", "spare_only"]


@dataclass(frozen=True)
class Candidate:
    """An idle instance whose model has a due batch."""

    model: str
    instance: str
    queued: int  # live tickets in the model's queue (shared by its instances)
    max_batch: int
    per_item_bytes: int
    fixed_bytes: int
    model_budget: int | None  # bytes for weights + running batches; None = only the device budget
    model_bytes: int  # weights + running reservations of this model on the device
    share: float  # device-seconds served / weight; lower goes first
    shadow: bool = False  # a batch of mirrored copies (`queued` counts those alone); never beside real items

    def batch_bytes(self, n: int) -> int:
        return self.fixed_bytes + n * self.per_item_bytes


@dataclass(frozen=True)
class DeviceState:
    budget_bytes: int
    used_bytes: int | None  # live reading; None when the probe failed
    reserved_bytes: int  # outstanding reservations of running batches
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    paused: bool = False  # the previous admission's pause state (hysteresis)
    running_batches: int = 0  # batches running on the device now
    max_concurrent_batches: int | None = None  # None: as many as memory allows
    real_waiting: int = 0  # real items queued or being prepared on the device: mirrored batches wait


@dataclass(frozen=True)
class AdmittedBatch:
    model: str
    instance: str
    size: int
    reserve_bytes: int
    shadow: bool = False  # mirrored copies only


@dataclass(frozen=True)
class BatchAdmission:
    admits: list[AdmittedBatch] = field(default_factory=list)
    paused: bool = False
    blocked: str | None = None  # a model whose head waits for memory; nobody behind it goes first
    reason: str = ""


def largest_fitting(candidate: Candidate, want: int, room: int) -> int:
    """The largest n <= want whose batch estimate fits in room (0 if none)."""
    if candidate.per_item_bytes <= 0:
        return want if candidate.fixed_bytes <= room else 0
    n = (room - candidate.fixed_bytes) // candidate.per_item_bytes
    return max(0, min(want, n))


def fits(candidate: Candidate, n: int, device: DeviceState, resident_bytes: int = 0) -> bool:
    """Whether a batch of n could ever fit once nothing else runs, with `resident_bytes` of
    weights still loaded on the device."""
    need = candidate.batch_bytes(n)
    model_ok = candidate.model_budget is None or candidate.model_bytes + need <= candidate.model_budget
    return model_ok and resident_bytes + need <= device.budget_bytes


def _paused(device: DeviceState) -> bool:
    assert device.used_bytes is not None
    share = device.used_bytes / device.budget_bytes if device.budget_bytes > 0 else 1.0
    if device.paused:
        return share > device.low_watermark
    return share >= device.high_watermark


def spare_only(candidates: Sequence[Candidate], device: DeviceState) -> list[Candidate]:
    """The candidates that may go: mirrored ones only while no real item waits on the device."""
    real = [c for c in candidates if not c.shadow]
    return real if real or device.real_waiting > 0 else list(candidates)


def admit_batches(candidates: Sequence[Candidate], device: DeviceState) -> BatchAdmission:
    """Admit batches while reading + reservations + estimate stays within the device budget and
    each model's budget, and while fewer than `max_concurrent_batches` run. Fair order by `share`;
    a head that cannot fit blocks those behind it. Mirrored candidates only in spare capacity."""
    if device.used_bytes is None:
        return BatchAdmission(paused=True, reason="memory probe unavailable; admission paused")
    if _paused(device):
        return BatchAdmission(paused=True, reason="device memory above the high watermark; admission paused")
    limit = device.max_concurrent_batches
    slots = None if limit is None else limit - device.running_batches
    if slots is not None and slots <= 0:
        return BatchAdmission(reason=f"{device.running_batches} batch(es) running, the device's limit is {limit}")
    free = device.budget_bytes - device.used_bytes - device.reserved_bytes
    candidates = spare_only(candidates, device)
    left = {(c.model, c.shadow): c.queued for c in candidates}
    booked = {c.model: c.model_bytes for c in candidates}
    admits: list[AdmittedBatch] = []
    for c in sorted(candidates, key=lambda c: (c.share, c.model, c.instance)):
        want = min(c.max_batch, left[c.model, c.shadow])
        if want <= 0:
            continue
        model_room = None if c.model_budget is None else c.model_budget - booked[c.model]
        n = largest_fitting(c, want, free if model_room is None else min(free, model_room))
        if n == 0:
            if model_room is not None and largest_fitting(c, 1, model_room) == 0:
                continue  # held back by its own budget only: others may go
            return BatchAdmission(admits, blocked=c.model, reason=f"{c.model}: batch of 1 waits for device memory")
        need = c.batch_bytes(n)
        admits.append(AdmittedBatch(c.model, c.instance, n, need, c.shadow))
        free -= need
        left[c.model, c.shadow] -= n
        booked[c.model] += need
        if slots is not None and len(admits) == slots:
            return BatchAdmission(admits, reason=f"the device's limit of {limit} concurrent batch(es) is reached")
    return BatchAdmission(admits)
