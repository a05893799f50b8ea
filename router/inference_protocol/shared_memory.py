"""System shared memory (the V2 shared-memory extension): regions clients register by the key of a
POSIX shared memory object, and tensors read from and written to them by offset and size.

Who may use it (docs/security.md, "Shared memory"): by default only a client on this host (a
loopback peer; `MODEL_ROUTER_SHARED_MEMORY`). With keys set, every region belongs to the key that
registered it: only that key sees it in status, reads or writes it, or unregisters it (a region's
name is the owner's own: another key may register the same name). Registering needs an admin key
unless `MODEL_ROUTER_SHARED_MEMORY_REGISTER=inference`. With no keys set every client is one
owner, as in Triton: any client that may use shared memory sees and uses every region.

What a key can reach: one object directly under /dev/shm (`/name` or `name`: no other directory, no
`..`, no symbolic link, only a regular file), whose name starts with `MODEL_ROUTER_SHARED_MEMORY_PREFIX`
and whose owner (fstat) is the server's uid or `MODEL_ROUTER_SHARED_MEMORY_OWNER_UID`. Every read
and write is checked against the registered region and goes through pread/pwrite on the object's
file descriptor, never a mapping: an object that another process shrinks gives a short read and a
clear error, not a SIGBUS. A region unregistered while a request uses it stays open until that
request is done with it (each use holds a lease).

One registry per front process, shared by its HTTP and gRPC endpoints, owned by the app's
lifespan (closed at shutdown). On a split host the fronts share one table of registrations
(`router.inference_protocol.shared_memory_table`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from router.config import ServerSettings
from router.errors import Forbidden, InputError, PayloadTooLarge, RegionNotFound, Unimplemented, brief
from router.inference_protocol.shared_memory_table import RegionEntry, RegionTable, already_registered

__all__ = [
    "CUDA_UNSUPPORTED",
    "Caller",
    "ClientRegions",
    "RegionSlice",
    "RegionStatus",
    "RegisterRule",
    "SharedMemoryMode",
    "SharedMemoryRegistry",
    "is_local_client",
    "refuse_cuda",
]

log = logging.getLogger("router.shared_memory")
SharedMemoryMode = Literal["loopback", "any", "off"]
RegisterRule = Literal["admin", "inference"]
SHM_DIRECTORY: Final = Path("/dev/shm")
MAX_REGIONS: Final = 256
SERVER_UID: Final = os.geteuid()
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


@dataclass(frozen=True)
class Caller:
    """Who uses shared memory: the client's address (None: a Unix socket), the owner its key makes it
    (an id of the key, never the key; '' with no keys set), and whether it may register regions."""

    host: str | None
    owner: str = ""
    may_register: bool = True


@dataclass
class _Region:
    owner: str
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
    """The registered regions of one front process, by owner and name. Registered and read from the
    event loop and from decoding threads alike: one lock guards the map and the leases.

    `register`: which keys may register (with keys set); `prefix`: what every object's name starts
    with; `object_uid`: the uid that must own every object (None: any owner)."""

    def __init__(self, mode: SharedMemoryMode = "loopback", *, directory: Path = SHM_DIRECTORY,
                 max_regions: int = MAX_REGIONS, table: Path | None = None, register: RegisterRule = "admin",
                 prefix: str = "", object_uid: int | None = SERVER_UID) -> None:
        self.mode = mode
        self.directory = directory
        self.max_regions = max_regions
        self.register_rule = register
        self.prefix = prefix
        self.object_uid = object_uid
        self.table = RegionTable(table) if table is not None else None  # None: this process's own
        self._regions: dict[tuple[str, str], _Region] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: ServerSettings, *, table: Path | None = None) -> SharedMemoryRegistry:
        """The registry the MODEL_ROUTER_SHARED_MEMORY* settings ask for."""
        uid = settings.shared_memory_owner_uid
        return cls(settings.shared_memory, table=table, register=settings.shared_memory_register,
                   prefix=settings.shared_memory_prefix,
                   object_uid=None if uid == "any" else SERVER_UID if uid == "server" else uid)

    # -- who may use it ----------------------------------------------------------------------------

    def caller(self, host: str | None, owner: str, admin: bool) -> Caller:
        """The caller a client is: `owner` names the key it presented ('' with no keys set, when
        `admin` is true too), `admin` whether that key is an admin key."""
        return Caller(host, owner, admin or self.register_rule == "inference")

    def check_client(self, caller: Caller) -> None:
        """Refuse (403) a client that this server's setting keeps away from shared memory."""
        if self.mode == "off":
            raise Forbidden("shared memory is turned off on this server (MODEL_ROUTER_SHARED_MEMORY=off)")
        if self.mode == "loopback" and not is_local_client(caller.host):
            raise Forbidden(f"shared memory is only for clients on this host; {brief(caller.host, 60)} is not a "
                            "loopback address (MODEL_ROUTER_SHARED_MEMORY=any allows every client)")

    def check_may_register(self, caller: Caller) -> None:
        self.check_client(caller)
        if not caller.may_register:
            raise Forbidden("registering shared memory needs an admin key "
                            "(MODEL_ROUTER_SHARED_MEMORY_REGISTER=inference lets inference keys register)")

    def for_client(self, caller: Caller, read_limit: int) -> ClientRegions:
        return ClientRegions(self, caller, read_limit)

    # -- register, status, unregister ----------------------------------------------------------------

    def register(self, caller: Caller, name: str, key: str, offset: int, byte_size: int) -> RegionStatus:
        """Open the object `key` under the shared memory directory and register `byte_size` bytes of
        it from `offset` as the caller's region `name`. Forbidden (403) for a caller or an object this
        server's settings refuse; InputError for every other way it can be wrong."""
        self.check_may_register(caller)
        _check_name(name)
        filename = _object_name(key)
        if not filename.startswith(self.prefix):
            raise Forbidden(f"shared memory key {brief(key, 80)}: this server registers only objects whose name starts "
                            f"with {self.prefix!r} (MODEL_ROUTER_SHARED_MEMORY_PREFIX)")
        if byte_size <= 0 or offset < 0:
            raise InputError(f"region {brief(name, 64)}: offset must be >= 0 and byte_size > 0, got {offset} and {byte_size}")
        with self._lock:
            self._check_room(caller.owner, name)
        fd, writable = self._open(filename, key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InputError(f"region {brief(name, 64)}: offset {offset} + byte_size {byte_size} runs past the end of "
                                 f"{brief(key, 80)} ({size} bytes)")
            status = RegionStatus(name, key, offset, byte_size)
            with self._lock:
                self._check_room(caller.owner, name)  # again: another registration may have won while the file opened
                token = self.table.publish(caller.owner, name, key, offset, byte_size).token if self.table is not None else ""
                self._regions[caller.owner, name] = _Region(caller.owner, status, fd, writable, token=token)
        except BaseException:
            os.close(fd)
            raise
        log.info("shared memory region registered", extra={"region": name[:64], "key": key[:80], "offset": offset,
                                                           "byte_size": byte_size, "writable": writable})
        return status

    def _check_room(self, owner: str, name: str) -> None:
        if self.table is not None:
            self._sync_with_table()
        if (owner, name) in self._regions:
            raise already_registered(name)
        if len(self._regions) >= self.max_regions or (self.table is not None and self.table.count() >= self.max_regions):
            raise InputError(f"{self.max_regions} shared memory regions are registered, the most this server holds; "
                             "unregister one first")

    def _open(self, filename: str, key: str) -> tuple[int, bool]:
        """The object's file descriptor, read-write where allowed, else read-only; a file that is not
        a regular file, or not owned by the uid the settings allow, is refused."""
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
                try:
                    self._check_object(os.fstat(fd), key)
                except BaseException:
                    os.close(fd)
                    raise
                return fd, writable
            raise InputError(f"shared memory key {brief(key, 80)}: permission denied")
        finally:
            os.close(directory)

    def _check_object(self, info: os.stat_result, key: str) -> None:
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"shared memory key {brief(key, 80)} is not a regular file under /dev/shm")
        if self.object_uid is not None and info.st_uid != self.object_uid:
            raise Forbidden(f"shared memory object {brief(key, 80)} is owned by uid {info.st_uid}; this server uses only "
                            f"objects owned by uid {self.object_uid} (MODEL_ROUTER_SHARED_MEMORY_OWNER_UID)")

    # -- the fronts' shared table (split host) ----------------------------------------------------

    def _sync_with_table(self, only: tuple[str, str] | None = None) -> None:
        """Retire local regions the table no longer holds (unregistered through another front), or
        holds under another token (registered again). Called with the lock held."""
        assert self.table is not None
        for owner, name in [only] if only is not None else list(self._regions):
            region = self._regions.get((owner, name))
            if region is None:
                continue
            entry = self.table.entry(owner, name)
            if entry is None or entry.token != region.token:
                self._retire(self._regions.pop((owner, name)))

    def _adopt(self, owner: str, name: str) -> _Region | None:
        """The region another front registered, opened here on first use. Called with the lock held."""
        assert self.table is not None
        entry = self.table.entry(owner, name)
        if entry is None:
            return None
        fd, writable = self._open(_object_name(entry.key), entry.key)
        region = _Region(owner, _status_of(entry), fd, writable, token=entry.token)
        self._regions[owner, name] = region
        return region

    @staticmethod
    def _retire(region: _Region) -> None:
        region.retired = True
        if region.users == 0:
            os.close(region.fd)

    def status(self, caller: Caller, name: str | None = None) -> list[RegionStatus]:
        """The caller's regions, or its one named (404 when it has none of that name)."""
        self.check_client(caller)
        if self.table is not None:
            found = [_status_of(entry) for entry in self.table.entries(caller.owner)]
        else:
            with self._lock:
                found = [region.status for region in self._regions.values() if region.owner == caller.owner]
        if not name:
            return found
        named = [status for status in found if status.name == name]
        if not named:
            raise _not_registered(name)
        return named

    def unregister(self, caller: Caller, name: str | None = None) -> None:
        """Unregister one of the caller's regions, or every one (no name). Unknown names are not an
        error, as in Triton. On a split host this takes it out of the shared table too."""
        self.check_client(caller)
        with self._lock:
            if self.table is not None:
                for each in [name] if name else [entry.name for entry in self.table.entries(caller.owner)]:
                    self.table.remove(caller.owner, each)
            names = [(caller.owner, name)] if name else [key for key in self._regions if key[0] == caller.owner]
            self._release(names)

    def close(self) -> None:
        """Let go of every region (at shutdown). A front of a split host closes only its own
        descriptors: the table outlives a front that restarts, and goes with the host's run directory."""
        with self._lock:
            self._release(list(self._regions))

    def _release(self, keys: list[tuple[str, str]]) -> None:
        """Called with the lock held."""
        retired = [self._regions.pop(key) for key in keys if key in self._regions]
        for region in retired:
            self._retire(region)
            log.info("shared memory region unregistered", extra={"region": region.status.name[:64]})

    # -- reading and writing -------------------------------------------------------------------------

    @contextmanager
    def _lease(self, owner: str, part: RegionSlice, where: str) -> Iterator[_Region]:
        """The owner's region, held open for the duration: unregistering it meanwhile closes it afterwards."""
        with self._lock:
            if self.table is not None:
                self._sync_with_table((owner, part.region))
            region = self._regions.get((owner, part.region))
            if region is None and self.table is not None:
                region = self._adopt(owner, part.region)
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

    def read(self, owner: str, part: RegionSlice, where: str) -> bytes:
        """The slice's bytes of the owner's region, copied out of the object."""
        with self._lease(owner, part, where) as region:
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

    def write(self, owner: str, part: RegionSlice, data: bytes, where: str) -> None:
        """Write `data` at the slice's start in the owner's region; it must fit the slice."""
        if len(data) > part.byte_size:
            raise InputError(f"{where}: the output needs {len(data)} bytes, shared_memory_byte_size is {part.byte_size}")
        with self._lease(owner, part, where) as region:
            if not region.writable:
                raise InputError(f"{where}: region {brief(part.region, 64)} is read-only to this server")
            start = region.status.offset + part.offset
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.pwrite(region.fd, view[done:], start + done)


class ClientRegions:
    """One request's use of shared memory: its caller's permission checked at first use, only the
    caller's own regions, and at most `read_limit` bytes read in all (the body limit: reading a
    region costs the server the same memory)."""

    def __init__(self, registry: SharedMemoryRegistry, caller: Caller, read_limit: int) -> None:
        self.registry, self.caller, self.read_limit = registry, caller, read_limit
        self.bytes_read = 0

    def read(self, part: RegionSlice, where: str) -> bytes:
        self.registry.check_client(self.caller)
        if self.bytes_read + part.byte_size > self.read_limit:
            raise PayloadTooLarge(f"{where}: the request's shared memory inputs come to more than {self.read_limit} bytes")
        data = self.registry.read(self.caller.owner, part, where)
        self.bytes_read += len(data)
        return data

    def write(self, part: RegionSlice, data: bytes, where: str) -> None:
        self.registry.check_client(self.caller)
        self.registry.write(self.caller.owner, part, data, where)


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


def _status_of(entry: RegionEntry) -> RegionStatus:
    return RegionStatus(entry.name, entry.key, entry.offset, entry.byte_size)


def _not_registered(name: str) -> RegionNotFound:
    return RegionNotFound(f"no shared memory region named {brief(name, 64)} is registered")
