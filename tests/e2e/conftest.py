"""Fixtures the end-to-end tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def regions() -> Iterator[list[Any]]:
    """Shared memory objects (tritonclient handles) a test creates, destroyed afterwards."""
    # Imported here: the GPU check collects tests/e2e on a host that need not have tritonclient.
    import tritonclient.utils.shared_memory as shm

    made: list[Any] = []
    yield made
    for handle in made:
        shm.destroy_shared_memory_region(handle)
