"""Who may use system shared memory, against real servers over HTTP and gRPC (tritonclient): with
keys set a region belongs to the key that registered it, registering needs an admin key unless the
setting lets inference keys register, objects are checked against a name prefix and their owner's
uid, and the client's address is the connection's peer unless proxy headers are turned on."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import serialize_byte_tensor

from tests.conftest import RouterProcess, serve
from tests.e2e.test_shared_memory import client, error_of, module

pytestmark = pytest.mark.e2e

FLEET = "models:\n  echo: {plugin: scripted}\n"
USER = "inference-key-0123456789"
ADMIN_A = "admin-key-a-0123456789"
ADMIN_B = "admin-key-b-0123456789"
KEYS = {"MODEL_ROUTER_API_KEYS": USER, "MODEL_ROUTER_ADMIN_KEYS": f"{ADMIN_A},{ADMIN_B}"}
PROTOCOLS = ["http", "grpc"]
FORBIDDEN = {"http": "403", "grpc": "StatusCode.PERMISSION_DENIED"}
BAD = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
DOCUMENT = serialize_byte_tensor(np.array([b'{"id": "secret"}'], dtype=np.object_)).item()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("owners"), FLEET, env=KEYS) as process:
        yield process


def new_object(made: list[Any], size: int, prefix: str = "model-router-test-") -> tuple[Any, str]:
    key = f"/{prefix}{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region(key, key, size)
    made.append(handle)
    return handle, key


def listed(status: Any, protocol: str) -> list[str]:
    return [r["name"] for r in status] if protocol == "http" else list(status.regions)


def json_input(protocol: str, region: str) -> Any:
    tensor = module(protocol).InferInput("JSON", [1], "BYTES")
    tensor.set_shared_memory(region, len(DOCUMENT))
    return tensor


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_inference_key_cannot_register_by_default_an_admin_key_can(
    keyed: RouterProcess, protocol: str, regions: list[Any],
) -> None:
    triton = client(keyed, protocol)
    _, key = new_object(regions, 64)
    refused = error_of(lambda: triton.register_system_shared_memory("r", key, 64, headers=bearer(USER)))
    assert refused.status() == FORBIDDEN[protocol] and "needs an admin key" in refused.message(), refused.message()
    assert listed(triton.get_system_shared_memory_status(headers=bearer(USER)), protocol) == []
    triton.register_system_shared_memory("r", key, 64, headers=bearer(ADMIN_A))
    try:
        assert listed(triton.get_system_shared_memory_status(headers=bearer(ADMIN_A)), protocol) == ["r"]
    finally:
        triton.unregister_system_shared_memory(headers=bearer(ADMIN_A))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_region_is_seen_used_and_unregistered_by_its_own_key_only(
    keyed: RouterProcess, protocol: str, regions: list[Any],
) -> None:
    """Key B (another admin key; the inference key too) does not see A's regions in status, cannot
    read A's input region or write A's output region by name, and B's unregister-all leaves A's."""
    triton, tc = client(keyed, protocol), module(protocol)
    handle, key = new_object(regions, 64)
    shm.set_shared_memory_region(handle, [np.array(DOCUMENT, dtype=np.object_)])
    out_handle, out_key = new_object(regions, 256)
    a = bearer(ADMIN_A)
    triton.register_system_shared_memory("in", key, 64, headers=a)
    triton.register_system_shared_memory("out", out_key, 256, headers=a)
    try:
        for other in (ADMIN_B, USER):
            b = bearer(other)
            assert listed(triton.get_system_shared_memory_status(headers=b), protocol) == []
            missing = error_of(lambda b=b: triton.get_system_shared_memory_status("in", headers=b))
            assert missing.status() in ("404", "StatusCode.NOT_FOUND")
            read = error_of(lambda b=b: triton.infer("echo", [json_input(protocol, "in")], headers=b))
            assert read.status() == BAD[protocol] and "no shared memory region named 'in'" in read.message()
            inline = tc.InferInput("JSON", [1], "BYTES")
            inline.set_data_from_numpy(np.array([b'{"id": "overwrite"}'], dtype=np.object_))
            output = tc.InferRequestedOutput("OUTPUT")
            output.set_shared_memory("out", 256)
            wrote = error_of(lambda b=b, inline=inline, output=output: triton.infer("echo", [inline], outputs=[output],
                                                                                     headers=b))
            assert wrote.status() == BAD[protocol] and "no shared memory region named 'out'" in wrote.message()
            assert bytes(shm.get_contents_as_numpy(out_handle, np.uint8, [256])) == bytes(256)  # untouched
            triton.unregister_system_shared_memory(headers=b)
            triton.unregister_system_shared_memory("in", headers=b)
        assert sorted(listed(triton.get_system_shared_memory_status(headers=a), protocol)) == ["in", "out"]
        output = tc.InferRequestedOutput("OUTPUT")
        output.set_shared_memory("out", 256)
        triton.infer("echo", [json_input(protocol, "in")], outputs=[output], headers=a)
        [written] = shm.get_contents_as_numpy(out_handle, np.object_, [1])
        assert json.loads(written)["id"] == "secret"
    finally:
        triton.unregister_system_shared_memory(headers=a)
    assert listed(triton.get_system_shared_memory_status(headers=a), protocol) == []


def test_objects_outside_the_prefix_or_owned_by_another_uid_are_refused(tmp_path: Path, regions: list[Any]) -> None:
    """With inference keys allowed to register and a name prefix set: an object outside the prefix
    is refused, and one another uid owns (root makes one here; else the uid setting names another)."""
    prefix = "model-router-ok-"
    env = {"MODEL_ROUTER_API_KEYS": USER, "MODEL_ROUTER_SHARED_MEMORY_REGISTER": "inference",
           "MODEL_ROUTER_SHARED_MEMORY_PREFIX": prefix}
    root = os.geteuid() == 0
    if not root:
        env["MODEL_ROUTER_SHARED_MEMORY_OWNER_UID"] = str(os.geteuid() + 1)
    with serve(tmp_path, FLEET, env=env) as server:
        for protocol in PROTOCOLS:
            triton = client(server, protocol)
            _, outside = new_object(regions, 64)
            refused = error_of(lambda triton=triton, outside=outside: triton.register_system_shared_memory("r", outside, 64,
                                                                                         headers=bearer(USER)))
            assert refused.status() == FORBIDDEN[protocol]
            assert f"only objects whose name starts with '{prefix}'" in refused.message(), refused.message()
            _, foreign = new_object(regions, 64, prefix)
            if root:
                os.chown(f"/dev/shm{foreign}", 4242, -1)
            owner = 4242 if root else os.geteuid()
            refused = error_of(lambda triton=triton, foreign=foreign: triton.register_system_shared_memory("r", foreign, 64,
                                                                                         headers=bearer(USER)))
            assert refused.status() == FORBIDDEN[protocol]
            assert f"is owned by uid {owner}; this server uses only objects owned by uid" in refused.message()
            if root:  # one the server's uid owns is taken, from an inference key
                _, own = new_object(regions, 64, prefix)
                triton.register_system_shared_memory("r", own, 64, headers=bearer(USER))
                assert listed(triton.get_system_shared_memory_status(headers=bearer(USER)), protocol) == ["r"]
                triton.unregister_system_shared_memory(headers=bearer(USER))


def register_over_http(server: RouterProcess, key: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/systemsharedmemory/region/r/register", json={"key": key, "byte_size": 8},
                      headers=headers, timeout=30)


@pytest.mark.parametrize("trusted", [False, True])
def test_proxy_headers_are_read_only_where_the_setting_turns_them_on(
    tmp_path: Path, regions: list[Any], trusted: bool,
) -> None:
    """By default a client on 127.0.0.1 that sends X-Forwarded-For: 10.1.2.3 is the loopback peer it
    is; with MODEL_ROUTER_PROXY_HEADERS on (the proxy: 127.0.0.1), it is 10.1.2.3, and refused.
    `Forwarded` (RFC 7239) is never read. The address is only a header's string: no traffic leaves."""
    env = {"MODEL_ROUTER_PROXY_HEADERS": "true"} if trusted else {}
    _, key = new_object(regions, 8)
    with serve(tmp_path, FLEET, env=env) as server:
        forwarded = register_over_http(server, key, {"x-forwarded-for": "10.1.2.3"})
        if trusted:
            assert forwarded.status_code == 403, forwarded.text
            assert "10.1.2.3' is not a loopback address" in forwarded.text
        else:
            assert forwarded.status_code == 200, forwarded.text
            httpx.post(f"{server.url}/v2/systemsharedmemory/unregister", timeout=30).raise_for_status()
        standard = register_over_http(server, key, {"forwarded": "for=10.1.2.3"})
        assert standard.status_code == 200, standard.text


def test_on_a_split_host_a_region_is_its_owners_only_through_every_front(tmp_path: Path, regions: list[Any]) -> None:
    """Two fronts share one table of regions: key B's status and unregister-all, on fresh connections
    the kernel spreads over both fronts, neither see nor remove key A's region, which A still reads."""
    from tests.e2e.test_split_host import fleet, serve_split, until

    handle, key = new_object(regions, 64)
    shm.set_shared_memory_region(handle, [np.array(DOCUMENT, dtype=np.object_)])
    with serve_split(tmp_path, fleet(name="echo"), env={**KEYS, "MODEL_ROUTER_LOG_FORMAT": "json"}) as server:
        client(server, "http").register_system_shared_memory("in", key, 64, headers=bearer(ADMIN_A))

        def fronts_asked() -> set[str]:  # HTTP's paths and gRPC's methods alike
            return {str(r["role"]) for r in server.log_records()
                    if r["message"] == "request" and "systemsharedmemory" in str(r.get("path", "")).lower()}

        # At least 8 connections, and more until the kernel has given both fronts some: it picks a
        # front by each connection's hash, so 8 all land on one front about once in 128 runs.
        for i in range(64):
            protocol = PROTOCOLS[i % 2]
            other = client(server, protocol)  # a new connection each time
            assert listed(other.get_system_shared_memory_status(headers=bearer(ADMIN_B)), protocol) == []
            other.unregister_system_shared_memory(headers=bearer(ADMIN_B))
            if i >= 7 and fronts_asked() == {"front 1", "front 2"}:
                break
        until(lambda: fronts_asked() == {"front 1", "front 2"}, what=f"both fronts answering (so far: {fronts_asked()})")
        for protocol in PROTOCOLS:
            owner = client(server, protocol)
            assert listed(owner.get_system_shared_memory_status(headers=bearer(ADMIN_A)), protocol) == ["in"]
            result = owner.infer("echo", [json_input(protocol, "in")], headers=bearer(ADMIN_A))
            assert [json.loads(e)["id"] for e in result.as_numpy("OUTPUT")] == ["secret"]
