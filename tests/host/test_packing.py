"""Values across the process boundary: arrays in the arena, the rest in a small pickle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from router.host.arena import Arena
from router.host.packing import INLINE_BELOW, Packer, unpack


@dataclass(frozen=True)
class Letterboxed:
    pixels: torch.Tensor
    width: int
    height: int


def pair(size: int = 16 << 20) -> tuple[Arena, Arena]:
    owner = Arena.create("test", size)
    assert owner.fd is not None
    return owner, Arena.attach(os.dup(owner.fd), size)


def test_a_tensor_crosses_as_a_region_and_a_small_skeleton() -> None:
    sender, receiver = pair()
    item = Letterboxed(torch.randint(0, 255, (3, 64, 64), dtype=torch.uint8), 810, 1080)
    packed, packing = Packer(sender).pack(item)
    assert len(packed.skeleton) < 400 and [size for _, size in packed.regions] == [3 * 64 * 64]
    assert packing.offsets == [packed.regions[0][0]]
    back = unpack(packed, receiver)
    assert (back.width, back.height) == (810, 1080) and torch.equal(back.pixels, item.pixels)
    sender.map[packed.regions[0][0]] = 7  # a view, not a copy: the receiver sees the sender's memory
    assert back.pixels.flatten()[0].item() == 7


def test_small_arrays_and_plain_values_travel_inside_the_message() -> None:
    sender, _ = pair()
    value: dict[str, Any] = {"id": "x", "boxes": torch.zeros((5, 6)), "scores": np.arange(10), "half": torch.ones(3, dtype=torch.bfloat16)}
    packed, packing = Packer(sender).pack(value)
    assert packed.regions == () and packing.offsets == []
    back = unpack(packed, None)
    assert back["id"] == "x" and torch.equal(back["boxes"], value["boxes"]) and back["half"].dtype == torch.bfloat16
    back["scores"][0] = 5  # writable, like the sender's
    assert sender.regions == 0


def test_a_full_arena_sends_the_bytes_in_the_message_instead() -> None:
    sender, receiver = pair(INLINE_BELOW * 2)
    big = np.ones(INLINE_BELOW * 4, np.uint8)
    packed, packing = Packer(sender).pack(big)
    assert packed.regions == () and packing.inline_buffers == 1
    assert np.array_equal(unpack(packed, receiver), big)
