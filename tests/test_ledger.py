"""MemoryLedger: weights booked per instance, batch reservations, per-model totals and the peak."""

from __future__ import annotations

from router.scheduling.memory import MemoryLedger


def test_booked_weights_count_until_released() -> None:
    ledger = MemoryLedger("cuda:0")
    ledger.book_weights("a/0", "a", 500)
    ledger.book_weights("b/0", "b", 300)

    assert ledger.weights_bytes == 800
    ledger.release_weights("a/0")
    assert ledger.weights_bytes == 300
    assert ledger.model_bytes("a") == 0


def test_rebooking_an_instance_replaces_its_weights() -> None:
    ledger = MemoryLedger("cpu")
    ledger.book_weights("a/0", "a", 500)
    ledger.book_weights("a/0", "a", 200)

    assert ledger.weights_bytes == 200


def test_releasing_unknown_weights_is_harmless() -> None:
    ledger = MemoryLedger("cpu")
    ledger.book_weights("a/0", "a", 500)
    ledger.release_weights("nope/0")

    assert ledger.weights_bytes == 500


def test_reservations_are_held_until_released() -> None:
    ledger = MemoryLedger("cuda:0")
    first = ledger.reserve("a", 100)
    second = ledger.reserve("a", 40)

    assert first.batch_id != second.batch_id
    assert (ledger.reserved_bytes, ledger.running_batches) == (140, 2)
    ledger.release(first)
    assert (ledger.reserved_bytes, ledger.running_batches) == (40, 1)


def test_releasing_a_reservation_twice_counts_once() -> None:
    ledger = MemoryLedger("cpu")
    reservation = ledger.reserve("a", 100)
    ledger.reserve("a", 30)
    ledger.release(reservation)
    ledger.release(reservation)

    assert ledger.reserved_bytes == 30


def test_total_is_weights_plus_reservations() -> None:
    ledger = MemoryLedger("cpu")
    ledger.book_weights("a/0", "a", 500)
    ledger.reserve("a", 70)

    assert ledger.total_bytes == 570


def test_model_bytes_sums_that_models_instances_and_batches_only() -> None:
    ledger = MemoryLedger("cuda:0")
    ledger.book_weights("a/0", "a", 500)
    ledger.book_weights("a/1", "a", 500)
    ledger.book_weights("b/0", "b", 300)
    ledger.reserve("a", 60)
    ledger.reserve("b", 7)

    assert ledger.model_bytes("a") == 1060
    assert ledger.model_bytes("b") == 307
    assert ledger.model_bytes("c") == 0


def test_peak_remembers_the_highest_total() -> None:
    ledger = MemoryLedger("cuda:0")
    ledger.book_weights("a/0", "a", 500)
    big = ledger.reserve("a", 300)
    ledger.release(big)
    ledger.reserve("a", 100)

    assert ledger.total_bytes == 600
    assert ledger.peak_bytes == 800
