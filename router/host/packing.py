"""Python values across the process boundary with their large buffers in shared memory.

A value is pickled (protocol 5) with its large buffers out of band: numpy arrays give theirs
natively, and CPU torch tensors are reduced to numpy arrays for it. Each such buffer is copied
into a region of the sender's arena, and the message carries only the skeleton (a few dozen
bytes for a preprocessed image) and the regions. Buffers under `INLINE_BELOW` bytes, and any
that does not fit while the arena is full, stay in the pickle. The receiver rebuilds the value
over views of the arena: nothing is copied on its side, and the views stay valid until the
sender frees the regions (which it does only once the receiver is done with them).

A `Packer` reuses one pickler (making one costs more than pickling a small value): each thread
that packs has its own.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.host.arena import Arena
from router.host.messages import Packed

__all__ = ["INLINE_BELOW", "Packer", "Packing", "unpack"]

#: Buffers smaller than this travel in the pickle: a region costs more than the copy.
INLINE_BELOW = 4096


@dataclass
class Packing:
    """What one `pack` used of the arena: the regions to free once the receiver is done."""

    offsets: list[int] = field(default_factory=list)
    inline_buffers: int = 0  # large buffers that went in the pickle because the arena was full


def _reduce_tensor(tensor: Any) -> Any:
    """A CPU tensor as `torch.from_numpy(array)`, so its memory is an out-of-band buffer; anything
    numpy cannot hold (bfloat16, sparse, on a device, requiring grad) as torch pickles it."""
    if tensor.device.type == "cpu" and not tensor.requires_grad and tensor.layout.__repr__() == "torch.strided":
        try:
            array = tensor.contiguous().numpy()
        except (TypeError, RuntimeError):
            pass
        else:
            return _from_numpy, (array,)
    return tensor.__reduce_ex__(5)


def _from_numpy(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)


def _pickler_class() -> type[pickle.Pickler]:
    """A pickler whose dispatch table reduces torch tensors, once torch is imported (the C pickler
    reads the table when it is made, so the table is the class's)."""
    table: dict[type, Callable[[Any], Any]] = dict(copyreg.dispatch_table)
    torch = sys.modules.get("torch")
    if torch is not None:
        table[torch.Tensor] = _reduce_tensor
    return type("_Pickler", (pickle.Pickler,), {"dispatch_table": table})


class Packer:
    """Packs values into one arena (or, with none, entirely into the pickle)."""

    def __init__(self, arena: Arena | None) -> None:
        self.arena = arena
        self._out = io.BytesIO()
        self._with_torch = "torch" in sys.modules
        self._pickler = _pickler_class()(self._out, 5, buffer_callback=self._place)
        self._regions: list[tuple[int, int]] = []
        self._packing = Packing()

    def pack(self, value: Any) -> tuple[Packed, Packing]:
        """The value as a `Packed`, and the regions it took (free them once the receiver is done)."""
        self._watch_torch()
        out, packing = self._out, Packing()
        self._regions, self._packing = [], packing
        out.seek(0)
        out.truncate()
        self._pickler.clear_memo()
        try:
            self._pickler.dump(value)
        except BaseException:
            if self.arena is not None:
                for offset in packing.offsets:
                    self.arena.free(offset)
            raise
        return Packed(out.getvalue(), tuple(self._regions)), packing

    def _place(self, buffer: pickle.PickleBuffer) -> bool:
        """Out of band (False) into the arena when large and there is room; else in the pickle."""
        raw = buffer.raw()
        size = raw.nbytes
        if size < INLINE_BELOW or self.arena is None:
            return True
        offset = self.arena.alloc(size)
        if offset is None:
            self._packing.inline_buffers += 1
            return True
        self.arena.map[offset:offset + size] = raw
        self._packing.offsets.append(offset)
        self._regions.append((offset, size))
        return False

    def _watch_torch(self) -> None:
        """Reduce torch tensors once torch is imported (plugins import it lazily)."""
        if not self._with_torch and "torch" in sys.modules:
            self._with_torch = True
            self._pickler = _pickler_class()(self._out, 5, buffer_callback=self._place)


def unpack(packed: Packed, arena: Arena | None) -> Any:
    """The value again; its large buffers are views of `arena`, valid until the sender frees them."""
    if not packed.regions:
        return pickle.loads(packed.skeleton)
    if arena is None:
        raise pickle.UnpicklingError("a value with buffers in shared memory, but no arena to read them from")
    view = memoryview(arena.map)
    return pickle.loads(packed.skeleton, buffers=[view[offset:offset + size] for offset, size in packed.regions])
