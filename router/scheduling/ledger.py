"""The memory ledger of one device: weights booked at load, reservations held by running batches."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryLedger", "Reservation"]


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
