"""The shared memory registry as an object: regions in a directory of the test's own (the registry's
injected /dev/shm), every bound, key and lifecycle error, leases across an unregister, objects that
shrink under it, and who may use it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.errors import Forbidden, InputError, PayloadTooLarge, RegionNotFound
from router.inference_protocol.shared_memory import (
    Caller,
    RegionSlice,
    RegionStatus,
    SharedMemoryRegistry,
    is_local_client,
)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    (tmp_path / "frame").write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    return tmp_path


@pytest.fixture
def registry(directory: Path) -> SharedMemoryRegistry:
    return SharedMemoryRegistry(directory=directory, max_regions=3)


#: A client on this host, with no keys set: the one owner every such client is.
LOCAL = Caller("127.0.0.1")


def refused(call: object, error: type[Exception] = InputError) -> str:
    with pytest.raises(error) as caught:
        call()  # type: ignore[operator]
    return str(caught.value)


def test_register_read_write_status_unregister(registry: SharedMemoryRegistry, directory: Path) -> None:
    assert registry.register(LOCAL, "in", "/frame", 256, 512) == RegionStatus("in", "/frame", 256, 512)
    assert registry.read("", RegionSlice("in", 4, 4), "input x") == bytes([4, 5, 6, 7])  # 256 + 4 into the object
    registry.write("", RegionSlice("in", 8, 3), b"abc", "output y")
    assert (directory / "frame").read_bytes()[264:267] == b"abc"
    registry.register(LOCAL, "all", "frame", 0, 1024)  # the key with or without its slash
    assert [s.name for s in registry.status(LOCAL)] == ["in", "all"] and registry.status(LOCAL, "all")[0].byte_size == 1024
    registry.unregister(LOCAL, "in")
    assert refused(lambda: registry.status(LOCAL, "in"), RegionNotFound) == "no shared memory region named 'in' is registered"
    registry.unregister(LOCAL, "in")  # unknown: nothing to do
    registry.unregister(LOCAL)
    assert registry.status(LOCAL) == []


@pytest.mark.parametrize(("key", "words"), [
    ("/../frame", "must name one object directly under /dev/shm"),
    ("/sub/frame", "must name one object directly under /dev/shm"),
    ("/", "must name one object directly under /dev/shm"),
    ("..", "must name one object directly under /dev/shm"),
    ("/absent", "no shared memory object '/absent' exists"),
    ("/link", "is a symbolic link"),
    ("/fifo", "is not a regular file"),
    ("/dir", "is not a regular file"),
])
def test_keys_stay_inside_the_directory(registry: SharedMemoryRegistry, directory: Path, key: str, words: str) -> None:
    (directory / "link").symlink_to(directory / "frame")
    os.mkfifo(directory / "fifo")
    (directory / "dir").mkdir()
    (directory / "sub").mkdir()
    (directory / "sub" / "frame").write_bytes(b"x" * 8)
    assert words in refused(lambda: registry.register(LOCAL, "r", key, 0, 8))
    assert registry.status(LOCAL) == []


@pytest.mark.parametrize(("offset", "size", "words"), [
    (1000, 100, "offset 1000 + byte_size 100 runs past the end of '/frame' (1024 bytes)"),
    (0, 0, "offset must be >= 0 and byte_size > 0"),
    (-1, 8, "offset must be >= 0 and byte_size > 0"),
])
def test_a_region_must_fit_its_object(registry: SharedMemoryRegistry, offset: int, size: int, words: str) -> None:
    assert words in refused(lambda: registry.register(LOCAL, "r", "/frame", offset, size))


def test_names_are_unique_bounded_and_counted(registry: SharedMemoryRegistry) -> None:
    registry.register(LOCAL, "a", "/frame", 0, 8)
    assert "registered already" in refused(lambda: registry.register(LOCAL, "a", "/frame", 0, 8))
    assert "1 to 256 printable characters" in refused(lambda: registry.register(LOCAL, "x" * 300, "/frame", 0, 8))
    assert "1 to 256 printable characters" in refused(lambda: registry.register(LOCAL, "", "/frame", 0, 8))
    registry.register(LOCAL, "b", "/frame", 0, 8)
    registry.register(LOCAL, "c", "/frame", 0, 8)
    assert "3 shared memory regions are registered" in refused(lambda: registry.register(LOCAL, "d", "/frame", 0, 8))


def test_slices_are_checked_against_their_region(registry: SharedMemoryRegistry) -> None:
    registry.register(LOCAL, "r", "/frame", 0, 16)
    assert "runs past the end of region 'r' (16 bytes)" in refused(lambda: registry.read("", RegionSlice("r", 8, 9), "input x"))
    assert refused(lambda: registry.read("", RegionSlice("s", 0, 1), "input x")).startswith(
        "input x: no shared memory region named 's' is registered")
    assert "the output needs 5 bytes, shared_memory_byte_size is 4" in refused(
        lambda: registry.write("", RegionSlice("r", 0, 4), b"12345", "output y"))


def test_a_region_unregistered_while_in_use_stays_open_until_released(registry: SharedMemoryRegistry) -> None:
    registry.register(LOCAL, "r", "/frame", 0, 16)
    with registry._lease("", RegionSlice("r", 0, 4), "input x") as region:
        registry.unregister(LOCAL, "r")
        assert registry.status(LOCAL) == []  # gone for new requests...
        assert os.pread(region.fd, 4, 0) == bytes([0, 1, 2, 3])  # ...but the one using it still reads
    with pytest.raises(OSError):
        os.fstat(region.fd)  # closed once released
    assert "no shared memory region named 'r'" in refused(lambda: registry.read("", RegionSlice("r", 0, 4), "input x"))


def test_an_object_that_shrinks_gives_an_error_not_a_crash(registry: SharedMemoryRegistry, directory: Path) -> None:
    registry.register(LOCAL, "r", "/frame", 512, 512)
    os.truncate(directory / "frame", 600)  # another process shrinks it: a mapping would SIGBUS here
    assert "ends early: its object '/frame' is now shorter than registered" in refused(
        lambda: registry.read("", RegionSlice("r", 0, 512), "input x"))


def test_a_read_only_object_can_be_read_not_written(registry: SharedMemoryRegistry, directory: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (directory / "frame").chmod(0o444)
    if os.geteuid() == 0:  # root may write any file: refuse read-write opens as the kernel would for others
        real_open = os.open

        def open_as_a_user(path: str, flags: int, *args: object, **kwargs: object) -> int:
            if flags & os.O_RDWR and path == "frame":
                raise PermissionError(13, "Permission denied")
            return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", open_as_a_user)
    registry.register(LOCAL, "r", "/frame", 0, 16)
    assert registry.read("", RegionSlice("r", 0, 2), "input x") == b"\x00\x01"
    assert "is read-only to this server" in refused(lambda: registry.write("", RegionSlice("r", 0, 2), b"ab", "output y"))


def test_one_requests_reads_are_bounded(registry: SharedMemoryRegistry) -> None:
    registry.register(LOCAL, "r", "/frame", 0, 1024)
    regions = registry.for_client(LOCAL, read_limit=600)
    assert len(regions.read(RegionSlice("r", 0, 500), "input a")) == 500 and regions.bytes_read == 500
    assert "inputs come to more than 600 bytes" in refused(lambda: regions.read(RegionSlice("r", 0, 200), "input b"),
                                                           PayloadTooLarge)


def test_who_may_use_shared_memory(directory: Path) -> None:
    assert [is_local_client(h) for h in ("127.0.0.1", "127.8.0.1", "::1", None, "10.0.0.2", "example.org")] == [
        True, True, True, True, False, False]
    SharedMemoryRegistry("loopback", directory=directory).check_client(Caller("::1"))
    far = Caller("192.168.1.5")
    assert "only for clients on this host" in refused(
        lambda: SharedMemoryRegistry("loopback", directory=directory).register(far, "r", "/frame", 0, 8), Forbidden)
    SharedMemoryRegistry("any", directory=directory).register(far, "r", "/frame", 0, 8)
    off = SharedMemoryRegistry("off", directory=directory)
    for call in (lambda: off.register(LOCAL, "r", "/frame", 0, 8), lambda: off.status(LOCAL), lambda: off.unregister(LOCAL),
                 lambda: off.for_client(LOCAL, 100).read(RegionSlice("r", 0, 1), "x")):
        assert "turned off" in refused(call, Forbidden)


@pytest.mark.parametrize("shared", [False, True], ids=["one-process", "split-host-table"])
def test_a_region_belongs_to_the_key_that_registered_it(directory: Path, tmp_path: Path, shared: bool) -> None:
    """Key B neither sees, reads, writes nor unregisters key A's region, and may use the same name;
    with no keys set (owner '') every client is one owner. Also across the fronts of a split host."""
    table = tmp_path / "regions" if shared else None
    registry = SharedMemoryRegistry(directory=directory, table=table)
    other = SharedMemoryRegistry(directory=directory, table=table) if shared else registry  # B's front
    a, b = registry.caller("127.0.0.1", "key-a", admin=True), other.caller("127.0.0.1", "key-b", admin=True)
    registry.register(a, "in", "/frame", 0, 16)
    assert other.status(b) == [] and [s.name for s in other.status(a)] == ["in"]
    assert refused(lambda: other.status(b, "in"), RegionNotFound) == "no shared memory region named 'in' is registered"
    for use in (lambda: other.for_client(b, 100).read(RegionSlice("in", 0, 1), "input x"),
                lambda: other.for_client(b, 100).write(RegionSlice("in", 0, 1), b"z", "output y")):
        assert refused(use).endswith("no shared memory region named 'in' is registered")
    other.unregister(b)
    other.unregister(b, "in")
    assert other.for_client(a, 100).read(RegionSlice("in", 0, 2), "input x") == b"\x00\x01"
    other.register(b, "in", "/frame", 8, 8)  # B's own region of that name
    assert registry.for_client(b, 100).read(RegionSlice("in", 0, 1), "input x") == b"\x08"
    assert registry.status(LOCAL) == []  # no keys: another owner again
    registry.unregister(a)
    assert other.status(a) == [] and [s.offset for s in registry.status(b)] == [8]
    other.unregister(b)
    assert registry.status(b) == []


def test_registering_needs_a_key_allowed_to(directory: Path) -> None:
    admin_only = SharedMemoryRegistry(directory=directory)
    user = admin_only.caller("127.0.0.1", "key-u", admin=False)
    assert "needs an admin key" in refused(lambda: admin_only.register(user, "r", "/frame", 0, 8), Forbidden)
    assert admin_only.status(user) == []  # status and unregister stay the caller's own
    admin_only.register(admin_only.caller("127.0.0.1", "key-a", admin=True), "r", "/frame", 0, 8)
    users_too = SharedMemoryRegistry(directory=directory, register="inference")
    users_too.register(users_too.caller("127.0.0.1", "key-u", admin=False), "r", "/frame", 0, 8)


def test_objects_are_checked_against_the_prefix_and_their_owner(directory: Path) -> None:
    (directory / "mr-frame").write_bytes(b"x" * 8)
    prefixed = SharedMemoryRegistry(directory=directory, prefix="mr-")
    assert "only objects whose name starts with 'mr-'" in refused(
        lambda: prefixed.register(LOCAL, "r", "/frame", 0, 8), Forbidden)
    prefixed.register(LOCAL, "r", "/mr-frame", 0, 8)
    owner = os.stat(directory / "frame").st_uid
    other = SharedMemoryRegistry(directory=directory, object_uid=owner + 1)
    words = f"is owned by uid {owner}; this server uses only objects owned by uid {owner + 1}"
    assert words in refused(lambda: other.register(LOCAL, "r", "/frame", 0, 8), Forbidden)
    assert other.status(LOCAL) == []
    SharedMemoryRegistry(directory=directory, object_uid=None).register(LOCAL, "r", "/frame", 0, 8)  # any owner
    SharedMemoryRegistry(directory=directory).register(LOCAL, "r", "/frame", 0, 8)  # the server's uid: its own file
    if os.geteuid() == 0:  # an object another user owns (root can make one): refused by default
        os.chown(directory / "mr-frame", owner + 4242, -1)
        assert f"is owned by uid {owner + 4242}" in refused(
            lambda: SharedMemoryRegistry(directory=directory).register(LOCAL, "s", "/mr-frame", 0, 8), Forbidden)


def test_close_releases_every_region(registry: SharedMemoryRegistry) -> None:
    registry.register(LOCAL, "a", "/frame", 0, 8)
    registry.register(LOCAL, "b", "/frame", 0, 8)
    registry.close()
    assert registry.status(LOCAL) == []


def test_fronts_of_a_split_host_share_one_table(directory: Path, tmp_path: Path) -> None:
    """Two fronts (two registries over one table): a region registered through one is read, listed
    and unregistered through the other; a name is registered once across both; re-registering a
    name through one front is seen by the other, not the old region's descriptor."""
    table = tmp_path / "regions"
    one = SharedMemoryRegistry(directory=directory, max_regions=3, table=table)
    two = SharedMemoryRegistry(directory=directory, max_regions=3, table=table)
    one.register(LOCAL, "in", "/frame", 256, 512)
    assert two.read("", RegionSlice("in", 4, 4), "input x") == bytes([4, 5, 6, 7])
    assert [s.name for s in two.status(LOCAL)] == ["in"]
    assert "is registered already" in refused(lambda: two.register(LOCAL, "in", "/frame", 0, 8))
    (directory / "other").write_bytes(b"z" * 64)
    two.unregister(LOCAL, "in")
    assert refused(lambda: one.read("", RegionSlice("in", 0, 4), "input x")).endswith("no shared memory region named 'in' is registered")
    two.register(LOCAL, "in", "/other", 0, 64)
    assert one.read("", RegionSlice("in", 0, 2), "input x") == b"zz"  # the new registration, not the old descriptor
    one.close()  # a front going away lets go of its descriptors, not of the host's registrations
    assert [s.name for s in two.status(LOCAL)] == ["in"]
    one.register(LOCAL, "a", "/frame", 0, 8)
    one.register(LOCAL, "b", "/frame", 0, 8)
    assert "the most this server holds" in refused(lambda: two.register(LOCAL, "c", "/frame", 0, 8))
    two.unregister(LOCAL)
    assert one.status(LOCAL) == [] and two.status(LOCAL) == []
