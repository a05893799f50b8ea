"""System shared memory (the V2 shared-memory extension): regions clients register by the key of a
POSIX shared memory object, and tensors read from and written to them by offset and size.

What a client can reach: a key names one object directly under /dev/shm (`/name` or `name`: no
other directory, no `..`, no symbolic link, only a regular file), and by default only a client on
this host (a loopback peer) may use shared memory at all (`MODEL_ROUTER_SHARED_MEMORY`). Every
read and write is checked against the registered region and goes through pread/pwrite on the
object's file descriptor, never a mapping: an object that another process shrinks gives a short
read and a clear error, not a SIGBUS. A region unregistered while a request uses it stays open
until that request is done with it (each use holds a lease).

One registry per front process, shared by its HTTP and gRPC endpoints, owned by the app's
lifespan (closed at shutdown). On a split host (`workers` > 1) the fronts share one table of
registrations (`table`, a directory of the host's run directory: one small file per region, created
with O_EXCL): a region registered through one front is read through any other, as a client whose
next connection lands on another front expects; each front opens the object itself on first use and
checks the table on every use, so an unregistration through one front holds for all of them.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from router.errors import Forbidden, InputError, PayloadTooLarge, RegionNotFound, Unimplemented, brief

__all__ = [
    "CUDA_UNSUPPORTED",
    "ClientRegions",
    "RegionSlice",
    "RegionStatus",
    "SharedMemoryMode",
    "SharedMemoryRegistry",
    "is_local_client",
    "refuse_cuda",
]

log = logging.getLogger("router.shared_memory")
SharedMemoryMode = Literal["loopback", "any", "off"]
SHM_DIRECTORY: Final = Path("/dev/shm")
MAX_REGIONS: Final = 256
MAX_NAME: Final = 256
CUDA_UNSUPPORTED: Final = ("CUDA shared memory is not supported by this server; send the tensor in the request or "
                           "in system shared memory")


@dataclass(frozen=True)
class RegionSlice:
    """Part of a registered region, as a tensor's shared_memory_* parameters name it."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass
class _Region:
    status: RegionStatus
    fd: int
    writable: bool
    users: int = 0
    retired: bool = False
    token: str = ""


def is_local_client(host: str | None) -> bool:
    """Whether a peer address is this host: a loopback address, or a Unix socket (host None)."""
    if host is None:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_cuda() -> Unimplemented:
    return Unimplemented(CUDA_UNSUPPORTED)


class SharedMemoryRegistry:
    """The registered regions of one front process. Registered and read from the event loop and from
    decoding threads alike: one lock guards the map and the leases."""

    def __init__(self, mode: SharedMemoryMode = "loopback", *, directory: Path = SHM_DIRECTORY,
                 max_regions: int = MAX_REGIONS, table: Path | None = None) -> None:
        self.mode = mode
        self.directory = directory
        self.max_regions = max_regions
        self.table = table  # the fronts' shared registrations on a split host; None: this process's own
        if table is not None:
            table.mkdir(parents=True, exist_ok=True)
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    # -- who may use it ----------------------------------------------------------------------------

    def check_client(self, host: str | None) -> None:
        """Refuse (403) a client that this server's setting keeps away from shared memory."""
        if self.mode == "off":
            raise Forbidden("shared memory is turned off on this server (MODEL_ROUTER_SHARED_MEMORY=off)")
        if self.mode == "loopback" and not is_local_client(host):
            raise Forbidden(f"shared memory is only for clients on this host; {brief(host, 60)} is not a loopback "
                            "address (MODEL_ROUTER_SHARED_MEMORY=any allows every client)")

    def for_client(self, host: str | None, read_limit: int) -> ClientRegions:
        return ClientRegions(self, host, read_limit)

    # -- register, status, unregister ----------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> RegionStatus:
        """Open the object `key` under the shared memory directory and register `byte_size` bytes of
        it from `offset` as region `name`. InputError for every way it can be wrong."""
        _check_name(name)
        filename = _object_name(key)
        if byte_size <= 0 or offset < 0:
            raise InputError(f"region {brief(name, 64)}: offset must be >= 0 and byte_size > 0, got {offset} and {byte_size}")
        with self._lock:
            self._check_room(name)
        fd, writable = self._open(filename, key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InputError(f"region {brief(name, 64)}: offset {offset} + byte_size {byte_size} runs past the end of "
                                 f"{brief(key, 80)} ({size} bytes)")
            status = RegionStatus(name, key, offset, byte_size)
            with self._lock:
                self._check_room(name)  # again: another registration may have won while the file opened
                token = self._publish(status) if self.table is not None else ""
                self._regions[name] = _Region(status, fd, writable, token=token)
        except BaseException:
            os.close(fd)
            raise
        log.info("shared memory region registered", extra={"region": name[:64], "key": key[:80], "offset": offset,
                                                           "byte_size": byte_size, "writable": writable})
        return status

    def _check_room(self, name: str) -> None:
        if self.table is not None:
            self._sync_with_table()
        if name in self._regions:
            raise InputError(f"a shared memory region named {brief(name, 64)} is registered already; unregister it first")
        if len(self._regions) >= self.max_regions or (self.table is not None and
                                                       len(self._table_files()) >= self.max_regions):
            raise InputError(f"{self.max_regions} shared memory regions are registered, the most this server holds; "
                             "unregister one first")

    def _open(self, filename: str, key: str) -> tuple[int, bool]:
        """The object's file descriptor, read-write where allowed, else read-only."""
        try:
            directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise InputError(f"system shared memory is not available on this host (no {self.directory})") from None
        try:
            for flags, writable in ((os.O_RDWR, True), (os.O_RDONLY, False)):
                try:
                    fd = os.open(filename, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
                except PermissionError:
                    continue
                except OSError as exc:
                    raise _open_error(key, exc) from None
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise InputError(f"shared memory key {brief(key, 80)} is not a regular file under /dev/shm")
                return fd, writable
            raise InputError(f"shared memory key {brief(key, 80)}: permission denied")
        finally:
            os.close(directory)

    # -- the fronts' shared table (split host) ----------------------------------------------------

    def _entry_path(self, name: str) -> Path:
        assert self.table is not None
        return self.table / (hashlib.sha256(name.encode()).hexdigest() + ".json")

    def _publish(self, status: RegionStatus) -> str:
        """Write the registration to the table, failing as 'registered already' where another front
        won the name (O_EXCL). Returns the entry's token (a re-registration gets a new one)."""
        token = secrets.token_hex(8)
        entry = {"name": status.name, "key": status.key, "offset": status.offset, "byte_size": status.byte_size,
                 "token": token}
        try:
            fd = os.open(self._entry_path(status.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise InputError(f"a shared memory region named {brief(status.name, 64)} is registered already; "
                             "unregister it first") from None
        with os.fdopen(fd, "w") as out:
            json.dump(entry, out)
        return token

    def _table_files(self) -> list[Path]:
        """The table's entries in the order they were registered (a file gone meanwhile: left out)."""
        assert self.table is not None
        dated = []
        for path in self.table.glob("*.json"):
            try:
                dated.append((path.stat().st_mtime_ns, path))
            except FileNotFoundError:
                continue
        return [path for _, path in sorted(dated)]

    @staticmethod
    def _read_entry(path: Path) -> dict | None:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # being written, or gone
        return entry if isinstance(entry, dict) and "token" in entry else None

    def _sync_with_table(self, only: str | None = None) -> None:
        """Retire local regions the table no longer holds (unregistered through another front), or
        holds under another token (registered again). Called with the lock held."""
        names = [only] if only is not None else list(self._regions)
        for name in names:
            region = self._regions.get(name)
            if region is None:
                continue
            entry = self._read_entry(self._entry_path(name))
            if entry is None or entry["token"] != region.token:
                self._retire(self._regions.pop(name))

    def _adopt(self, name: str) -> _Region | None:
        """The region another front registered, opened here on first use. Called with the lock held."""
        entry = self._read_entry(self._entry_path(name))
        if entry is None:
            return None
        status = RegionStatus(entry["name"], entry["key"], int(entry["offset"]), int(entry["byte_size"]))
        fd, writable = self._open(_object_name(status.key), status.key)
        region = _Region(status, fd, writable, token=entry["token"])
        self._regions[name] = region
        return region

    @staticmethod
    def _retire(region: _Region) -> None:
        region.retired = True
        if region.users == 0:
            os.close(region.fd)

    def status(self, name: str | None = None) -> list[RegionStatus]:
        """Every region, or the one named (404 when it is not registered)."""
        if self.table is not None:
            entries = [self._read_entry(path) for path in self._table_files()]
            found = [RegionStatus(e["name"], e["key"], int(e["offset"]), int(e["byte_size"])) for e in entries if e]
            if not name:
                return found
            named = [status for status in found if status.name == name]
            if not named:
                raise _not_registered(name)
            return named
        with self._lock:
            if not name:
                return [region.status for region in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise _not_registered(name)
        return [region.status]

    def unregister(self, name: str | None = None, *, everywhere: bool = True) -> None:
        """Unregister one region, or every one (no name). Unknown names are not an error, as in Triton.
        On a split host this takes it out of the shared table too, unless `everywhere` is False (a
        front closing at shutdown lets go of its own file descriptors only)."""
        with self._lock:
            if self.table is not None and everywhere:
                for path in ([self._entry_path(name)] if name else self._table_files()):
                    path.unlink(missing_ok=True)
            names = [name] if name else list(self._regions)
            retired = [self._regions.pop(n) for n in names if n in self._regions]
            for region in retired:
                self._retire(region)
        for region in retired:
            log.info("shared memory region unregistered", extra={"region": region.status.name[:64]})

    def close(self) -> None:
        """Unregister everything (at shutdown); a front of a split host closes only its own descriptors
        (the table outlives a front that restarts, and goes with the host's run directory)."""
        self.unregister(None, everywhere=False)

    # -- reading and writing -------------------------------------------------------------------------

    @contextmanager
    def _lease(self, part: RegionSlice, where: str) -> Iterator[_Region]:
        """The region, held open for the duration: unregistering it meanwhile closes it afterwards."""
        with self._lock:
            if self.table is not None:
                self._sync_with_table(part.region)
            region = self._regions.get(part.region)
            if region is None and self.table is not None:
                region = self._adopt(part.region)
            if region is None:
                raise InputError(f"{where}: no shared memory region named {brief(part.region, 64)} is registered")
            region.users += 1
        try:
            registered = region.status.byte_size
            if part.offset + part.byte_size > registered:
                raise InputError(f"{where}: shared_memory_offset {part.offset} + shared_memory_byte_size {part.byte_size} "
                                 f"runs past the end of region {brief(part.region, 64)} ({registered} bytes)")
            yield region
        finally:
            with self._lock:
                region.users -= 1
                if region.retired and region.users == 0:
                    os.close(region.fd)

    def read(self, part: RegionSlice, where: str) -> bytes:
        """The slice's bytes, copied out of the object."""
        with self._lease(part, where) as region:
            start = region.status.offset + part.offset
            chunks, done = [], 0
            while done < part.byte_size:
                chunk = os.pread(region.fd, part.byte_size - done, start + done)
                if not chunk:
                    raise InputError(f"{where}: region {brief(part.region, 64)} ends early: its object "
                                     f"{brief(region.status.key, 80)} is now shorter than registered")
                chunks.append(chunk)
                done += len(chunk)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def write(self, part: RegionSlice, data: bytes, where: str) -> None:
        """Write `data` at the slice's start; it must fit the slice."""
        if len(data) > part.byte_size:
            raise InputError(f"{where}: the output needs {len(data)} bytes, shared_memory_byte_size is {part.byte_size}")
        with self._lease(part, where) as region:
            if not region.writable:
                raise InputError(f"{where}: region {brief(part.region, 64)} is read-only to this server")
            start = region.status.offset + part.offset
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.pwrite(region.fd, view[done:], start + done)


class ClientRegions:
    """One request's use of shared memory: its client's permission checked at first use, and at most
    `read_limit` bytes read in all (the body limit: reading a region costs the server the same memory)."""

    def __init__(self, registry: SharedMemoryRegistry, host: str | None, read_limit: int) -> None:
        self.registry, self.host, self.read_limit = registry, host, read_limit
        self.bytes_read = 0

    def read(self, part: RegionSlice, where: str) -> bytes:
        self.registry.check_client(self.host)
        if self.bytes_read + part.byte_size > self.read_limit:
            raise PayloadTooLarge(f"{where}: the request's shared memory inputs come to more than {self.read_limit} bytes")
        data = self.registry.read(part, where)
        self.bytes_read += len(data)
        return data

    def write(self, part: RegionSlice, data: bytes, where: str) -> None:
        self.registry.check_client(self.host)
        self.registry.write(part, data, where)


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME or not name.isprintable():
        raise InputError(f"a region name must be 1 to {MAX_NAME} printable characters, got {brief(name, 64)}")


def _object_name(key: str) -> str:
    """The file name under the shared memory directory that `key` (shm_open's name) denotes."""
    name = key.removeprefix("/")
    if not name or "/" in name or "\0" in name or name in (".", "..") or len(name.encode()) > 255:
        raise InputError(f"shared memory key {brief(key, 80)} must name one object directly under /dev/shm, "
                         "like '/input0' (no other directory, no '..')")
    return name


def _open_error(key: str, exc: OSError) -> InputError:
    if exc.errno == errno.ENOENT:
        return InputError(f"no shared memory object {brief(key, 80)} exists; create it (shm_open) before registering")
    if exc.errno == errno.ELOOP:
        return InputError(f"shared memory key {brief(key, 80)} is a symbolic link; register the object itself")
    if exc.errno == errno.EISDIR:
        return InputError(f"shared memory key {brief(key, 80)} is not a regular file under /dev/shm")
    return InputError(f"shared memory key {brief(key, 80)} cannot be opened: {exc.strerror}")


def _not_registered(name: str) -> RegionNotFound:
    return RegionNotFound(f"no shared memory region named {brief(name, 64)} is registered")
