"""System shared memory (the V2 extension) against a real server, with tritonclient's own
`shared_memory` utilities over HTTP and gRPC: inputs and outputs in regions answer as inline
tensors do; registration, status, unregistration, bounds and keys are checked; CUDA shared memory
is declared unsupported."""

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
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from router.sdk.images import decode_image
from router.sdk.plugin import Payload
from tests.conftest import REPO, RouterProcess, serve

pytestmark = pytest.mark.e2e

FLEET = f"""
model_store: {REPO / "model_store"}
models:
  resnet18:
    plugin: resnet
    options: {{arch: resnet18, weights: resnet18.pt, top_k: 5}}
    batch: {{max_size: 4, max_delay_ms: 2}}
  echo:
    plugin: scripted
"""
PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("shm"), FLEET) as process:
        yield process


def client(server: RouterProcess, protocol: str) -> Any:
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(server.grpc_address)
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def module(protocol: str) -> Any:
    return grpcclient if protocol == "grpc" else httpclient


def region(made: list[Any], size: int) -> tuple[Any, str, str]:
    name = f"r-{uuid.uuid4().hex[:8]}"
    key = f"/model-router-test-{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region(name, key, size)
    made.append(handle)
    return handle, name, key


def square_pixels() -> np.ndarray[Any, Any]:
    return decode_image(Payload((REPO / "examples" / "square.png").read_bytes(), "image/png"))[None]  # [1, H, W, 3]


def error_of(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def answers(result: Any) -> list[Any]:
    return [json.loads(element) for element in result.as_numpy("OUTPUT")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pixels_and_answers_through_shared_memory_match_inline_tensors(
    server: RouterProcess, protocol: str, regions: list[Any],
) -> None:
    triton, tc = client(server, protocol), module(protocol)
    pixels = square_pixels()
    inline = tc.InferInput("IMAGE", list(pixels.shape), "UINT8")
    inline.set_data_from_numpy(pixels)
    [expected] = answers(triton.infer("resnet18", [inline]))

    handle, name, key = region(regions, pixels.nbytes)
    shm.set_shared_memory_region(handle, [pixels])
    triton.register_system_shared_memory(name, key, pixels.nbytes)
    out_handle, out_name, out_key = region(regions, 4096)
    triton.register_system_shared_memory(out_name, out_key, 4096)
    try:
        tensor = tc.InferInput("IMAGE", list(pixels.shape), "UINT8")
        tensor.set_shared_memory(name, pixels.nbytes)
        [got] = answers(triton.infer("resnet18", [tensor]))
        assert got == expected
        output = tc.InferRequestedOutput("OUTPUT")
        output.set_shared_memory(out_name, 4096)
        described = triton.infer("resnet18", [tensor], outputs=[output]).get_output("OUTPUT")
        if protocol == "http":  # the answer is in the region, not the response
            assert "data" not in described and described["parameters"]["shared_memory_region"] == out_name
        else:
            assert described.parameters["shared_memory_region"].string_param == out_name
        [written] = shm.get_contents_as_numpy(out_handle, np.object_, [1])
        assert json.loads(written) == expected
    finally:
        triton.unregister_system_shared_memory()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_regions_are_listed_and_unregistered(server: RouterProcess, protocol: str, regions: list[Any]) -> None:
    triton, tc = client(server, protocol), module(protocol)
    handle, name, key = region(regions, 64)
    document = serialize_byte_tensor(np.array([b'{"id": "from-shm"}'], dtype=np.object_)).item()
    shm.set_shared_memory_region(handle, [np.array(document, dtype=np.object_)], offset=8)
    triton.register_system_shared_memory(name, key, 56, offset=8)
    status = triton.get_system_shared_memory_status(name)
    listed = status if protocol == "http" else [status.regions[name]]
    assert [(r["name"], r["key"], int(r["offset"]), int(r["byte_size"])) if protocol == "http" else
            (r.name, r.key, r.offset, r.byte_size) for r in listed] == [(name, key, 8, 56)]
    tensor = tc.InferInput("JSON", [1], "BYTES")
    tensor.set_shared_memory(name, len(document))
    assert [a["id"] for a in answers(triton.infer("echo", [tensor]))] == ["from-shm"]

    triton.unregister_system_shared_memory(name)
    gone = error_of(lambda: triton.infer("echo", [tensor]))
    assert f"no shared memory region named '{name}' is registered" in gone.message()
    missing = error_of(lambda: triton.get_system_shared_memory_status(name))
    assert missing.status() in ("404", "StatusCode.NOT_FOUND")
    triton.unregister_system_shared_memory(name)  # again: nothing to do, as in Triton


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bounds_and_keys_are_checked(server: RouterProcess, protocol: str, regions: list[Any]) -> None:
    triton, tc = client(server, protocol), module(protocol)
    bad = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    _, name, key = region(regions, 64)
    past_end = error_of(lambda: triton.register_system_shared_memory(name, key, 64, offset=8))
    assert past_end.status() == bad and "offset 8 + byte_size 64 runs past the end" in past_end.message()
    for wrong_key, words in [("/../../etc/passwd", "must name one object directly under /dev/shm"),
                             ("/a/b", "must name one object directly under /dev/shm"),
                             (f"/model-router-absent-{uuid.uuid4().hex}", "exists; create it (shm_open)")]:
        refused = error_of(lambda wrong_key=wrong_key: triton.register_system_shared_memory(name, wrong_key, 8))
        assert refused.status() == bad and words in refused.message(), refused.message()
    link = Path("/dev/shm") / f"model-router-link-{uuid.uuid4().hex}"
    link.symlink_to("/etc/hostname")
    try:
        linked = error_of(lambda: triton.register_system_shared_memory(name, "/" + link.name, 4))
        assert "is a symbolic link" in linked.message()
    finally:
        link.unlink()

    triton.register_system_shared_memory(name, key, 64)
    try:
        assert "registered already" in error_of(lambda: triton.register_system_shared_memory(name, key, 64)).message()
        def pixels_in(size: int, offset: int = 0) -> Any:  # a fresh input each time: tritonclient keeps old offsets
            tensor = tc.InferInput("IMAGE", [1, 4, 4, 3], "UINT8")
            tensor.set_shared_memory(name, size, offset=offset)
            return tensor

        beyond = error_of(lambda: triton.infer("resnet18", [pixels_in(48, offset=32)]))
        assert beyond.status() == bad
        assert "shared_memory_offset 32 + shared_memory_byte_size 48 runs past the end of region" in beyond.message()
        short = error_of(lambda: triton.infer("resnet18", [pixels_in(40)]))
        assert "needs 48 bytes, the binary data has 40" in short.message()
        tensor = pixels_in(48)
        output = tc.InferRequestedOutput("OUTPUT")
        output.set_shared_memory(name, 8)
        small = error_of(lambda: triton.infer("resnet18", [tensor], outputs=[output]))
        assert "the output needs" in small.message() and "shared_memory_byte_size is 8" in small.message()
    finally:
        triton.unregister_system_shared_memory(name)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cuda_shared_memory_is_declared_unsupported(server: RouterProcess, protocol: str) -> None:
    triton = client(server, protocol)
    refused = error_of(lambda: triton.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64))
    assert refused.status() == ("400" if protocol == "http" else "StatusCode.UNIMPLEMENTED")  # as Triton answers
    assert "CUDA shared memory is not supported" in refused.message()
    if protocol == "http":  # the route's own summary says the status it answers
        schema = httpx.get(f"{server.url}/schema/openapi.json", timeout=30).json()
        summary = schema["paths"]["/v2/cudasharedmemory/region/{name}/register"]["post"]["summary"]
        assert f"({refused.status()}," in summary, summary
    status = triton.get_cuda_shared_memory_status()
    assert (status == []) if protocol == "http" else (len(status.regions) == 0)
    triton.unregister_cuda_shared_memory()  # nothing registered: nothing to do


def test_shared_memory_can_be_turned_off(tmp_path: Path, regions: list[Any]) -> None:
    with serve(tmp_path, "models:\n  echo: {plugin: scripted}\n", env={"MODEL_ROUTER_SHARED_MEMORY": "off"}) as server:
        _, name, key = region(regions, 8)
        for protocol, code in (("http", "403"), ("grpc", "StatusCode.PERMISSION_DENIED")):
            refused = error_of(lambda protocol=protocol: client(server, protocol).register_system_shared_memory(name, key, 8))
            assert refused.status() == code and "turned off" in refused.message()
    assert not any(os.path.islink(p) for p in Path("/dev/shm").glob("model-router-link-*"))
