"""The shared-memory arena: first fit, merging on free, bounded, and visible in the other mapping."""

from __future__ import annotations

import os

import pytest

from router.host.arena import ALIGN, Arena


def test_regions_are_aligned_reused_and_merged_when_freed() -> None:
    arena = Arena.create("test", 64 * ALIGN)
    a, b, c = arena.alloc(10), arena.alloc(ALIGN + 1), arena.alloc(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert arena.used_bytes == 4 * ALIGN
    arena.free(b)
    assert arena.alloc(ALIGN) == ALIGN  # first fit takes the hole
    arena.free(ALIGN)
    arena.free(a)
    arena.free(c)
    assert arena.regions == 0 and arena.used_bytes == 0
    assert arena.alloc(64 * ALIGN) == 0  # everything merged back into one region
    arena.close()


def test_a_full_arena_says_so_and_a_double_free_raises() -> None:
    arena = Arena.create("test", 4 * ALIGN)
    assert arena.alloc(4 * ALIGN) == 0
    assert arena.alloc(1) is None
    arena.free(0)
    with pytest.raises(KeyError):
        arena.free(0)
    arena.close()


def test_the_other_side_sees_what_the_owner_wrote() -> None:
    owner = Arena.create("test", 4096)
    assert owner.fd is not None
    other = Arena.attach(os.dup(owner.fd), owner.size)
    offset = owner.alloc(5)
    assert offset is not None
    owner.map[offset:offset + 5] = b"hello"
    assert bytes(other.map[offset:offset + 5]) == b"hello"
    owner.reset()
    assert owner.regions == 0
    other.close()
    owner.close()
