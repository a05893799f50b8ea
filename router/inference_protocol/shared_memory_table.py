"""The fronts' shared table of system shared memory registrations on a split host (`workers` > 1): a
directory of the host's run directory, one small file per region (created with O_EXCL, mode 0600),
named by a hash of its owner and name. A region registered through one front is read through any
other; each front opens the object itself and checks the table on every use, so an unregistration
through one front holds for all of them. `router.inference_protocol.shared_memory` is its one user.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from router.errors import InputError, brief

__all__ = ["RegionEntry", "RegionTable", "already_registered"]


@dataclass(frozen=True)
class RegionEntry:
    """One registration as the table holds it. `owner`: the id of the key that registered it ('' with
    no keys set); `token`: new for each registration, so a name registered again is told apart."""

    owner: str
    name: str
    key: str
    offset: int
    byte_size: int
    token: str


def already_registered(name: str) -> InputError:
    return InputError(f"a shared memory region named {brief(name, 64)} is registered already; unregister it first")


class RegionTable:
    """The registrations every front of one host sees."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, owner: str, name: str) -> Path:
        return self.directory / (hashlib.sha256(f"{owner}\0{name}".encode()).hexdigest() + ".json")

    def publish(self, owner: str, name: str, key: str, offset: int, byte_size: int) -> RegionEntry:
        """Write a registration, failing as 'registered already' where another front won the name (O_EXCL)."""
        entry = RegionEntry(owner, name, key, offset, byte_size, secrets.token_hex(8))
        try:
            fd = os.open(self._path(owner, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise already_registered(name) from None
        with os.fdopen(fd, "w") as out:
            json.dump(entry.__dict__, out)
        return entry

    def entry(self, owner: str, name: str) -> RegionEntry | None:
        return self._read(self._path(owner, name))

    def entries(self, owner: str | None = None) -> list[RegionEntry]:
        """Every registration (of `owner` only, where given), in the order they were registered."""
        found = (self._read(path) for path in self._files())
        return [entry for entry in found if entry is not None and (owner is None or entry.owner == owner)]

    def count(self) -> int:
        return len(self._files())

    def remove(self, owner: str, name: str) -> None:
        self._path(owner, name).unlink(missing_ok=True)

    def _files(self) -> list[Path]:
        """The entries' files in the order they were written (a file gone meanwhile: left out)."""
        dated = []
        for path in self.directory.glob("*.json"):
            try:
                dated.append((path.stat().st_mtime_ns, path))
            except FileNotFoundError:
                continue
        return [path for _, path in sorted(dated)]

    @staticmethod
    def _read(path: Path) -> RegionEntry | None:
        try:
            data = json.loads(path.read_text())
            return RegionEntry(str(data["owner"]), str(data["name"]), str(data["key"]), int(data["offset"]),
                               int(data["byte_size"]), str(data["token"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None  # being written, gone, or written by an older version
