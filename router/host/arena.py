"""A shared-memory arena: one memfd mapped by two processes, split into regions by its owner.

The owner (`Arena.create`) allocates and frees; the other side (`Arena.attach`, from the memfd it
was sent) only reads and writes the regions it is told about. A memfd has no name: its memory
goes back to the system when the last process mapping it unmaps or dies, so no path, crash
included, leaves a segment behind. Pages cost nothing until they are touched.

The allocator is first fit over a sorted free list, regions aligned to 64 bytes, with freed
neighbours merged: requests come and go out of order, and a few hundred regions are in use at most.
"""

from __future__ import annotations

import bisect
import mmap
import os

__all__ = ["ALIGN", "Arena"]

ALIGN = 64


class Arena:
    """A mapped memfd of `size` bytes; `alloc`/`free` only in the process that created it."""

    def __init__(self, fd: int, size: int, *, owner: bool) -> None:
        self.size = size
        self.owner = owner
        self.map = mmap.mmap(fd, size)  # keeps its own reference to the file
        self.fd: int | None = fd  # the owner keeps it, to send to the other side
        if not owner:
            os.close(fd)
            self.fd = None
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset
        self._used: dict[int, int] = {}  # offset -> length
        self.used_bytes = 0

    @classmethod
    def create(cls, name: str, size: int) -> Arena:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, size, owner=True)

    @classmethod
    def attach(cls, fd: int, size: int) -> Arena:
        """Map a memfd another process sent (this process owns the descriptor from now on)."""
        return cls(fd, size, owner=False)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free region of at least `nbytes`, or None when there is none that large."""
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for index, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[index]
                else:
                    self._free[index] = (offset + need, length - need)
                self._used[offset] = need
                self.used_bytes += need
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give a region back; freeing one that is not allocated is a bug and raises KeyError."""
        length = self._used.pop(offset)
        self.used_bytes -= length
        index = bisect.bisect(self._free, (offset, length))
        if index < len(self._free) and offset + length == self._free[index][0]:  # merge with the next
            length += self._free.pop(index)[1]
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:  # with the previous
            offset, previous = self._free.pop(index - 1)
            length += previous
            index -= 1
        self._free.insert(index, (offset, length))

    def reset(self) -> None:
        """Every region free again (the other side is gone: nobody reads them any more)."""
        self._free = [(0, self.size)]
        self._used.clear()
        self.used_bytes = 0

    @property
    def regions(self) -> int:
        return len(self._used)

    def close(self) -> None:
        """Unmap, unless views of the memory are still alive (they keep it; it goes with the last one)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.map.close()
        except BufferError:
            pass
