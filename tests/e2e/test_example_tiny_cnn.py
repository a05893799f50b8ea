"""The second example of docs/plugins.md, `examples/plugin-tiny-cnn`: a torch CNN that loads where
the fleet puts it (`cuda:N` or the CPU) through its checkpoint in the model store, with its memory
estimate. A real `model-router serve` serves it on the CPU here; the `gpu` test runs it on
`cuda:0` and skips cleanly without one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from router.sdk import Payload, PluginContext, example_jpeg
from tests.conftest import REPO, RouterProcess, serve

FLEET = """
model_store: {store}
models:
  tiny:
    plugin: tiny-cnn
    device: cpu
    options: {{weights: tiny-cnn.pt, top_k: 3}}
    batch: {{max_size: 8, max_delay_ms: 300}}
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint written by the example's own command, as its README says."""
    root = tmp_path_factory.mktemp("tiny_store")
    done = subprocess.run([sys.executable, "-m", "tiny_cnn", str(root / "tiny-cnn.pt")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(root / "tiny-cnn.pt")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("tiny_serve"), FLEET.format(store=store)) as process:
        yield process


def plugin(store: Path, **options: Any) -> Any:
    from tiny_cnn import TinyCnnOptions, TinyCnnPlugin

    return TinyCnnPlugin(TinyCnnOptions(weights="tiny-cnn.pt", **options), PluginContext("tiny", store))


def photos() -> list[bytes]:
    return [example_jpeg(40 + 13 * i, 30 + 7 * i, seed=i).body for i in range(6)]


@pytest.mark.e2e
def test_it_serves_each_photo_its_own_answer_in_shared_batches(server: RouterProcess, store: Path) -> None:
    local = plugin(store, top_k=3)  # the same checkpoint in this process: each photo's answer run alone
    local.load("cpu")

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return list(await asyncio.gather(*(
                client.post("/models/tiny/predict", content=body, headers={"content-type": "image/jpeg"})
                for body in photos())))

    responses = asyncio.run(send())
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    assert max(r.json()["timing"]["batch_size"] for r in responses) > 1, "the requests should have been batched"
    for response, body in zip(responses, photos(), strict=True):
        answer = response.json()["result"]
        alone = local.postprocess(local.predict_batch([item := local.preprocess(Payload(body, "image/jpeg"))])[0], item)
        assert [c["label"] for c in answer["top_k"]] == [c["label"] for c in alone["top_k"]]
        assert np.allclose([c["score"] for c in answer["top_k"]], [c["score"] for c in alone["top_k"]], atol=1e-5)
        assert answer["image"] == alone["image"]


@pytest.mark.e2e
def test_it_reports_its_distribution_device_and_memory_estimate(server: RouterProcess, store: Path) -> None:
    described = httpx.get(f"{server.url}/models/tiny", timeout=30).json()
    assert described["state"] == "ready"
    assert described["plugin"]["distribution"] == "vision-model-router-example-tiny-cnn"
    local = plugin(store)
    local.load("cpu")
    estimate = local.memory_estimate()
    memory = described["memory"]
    assert (memory["weights_bytes"], memory["per_item_bytes"], memory["fixed_bytes"], memory["source"]) == (
        estimate.weights_bytes, estimate.per_item_bytes, estimate.fixed_bytes, "estimate")
    photo = httpx.post(f"{server.url}/models/tiny/predict", files={"file": ("street.jpg",
                       (REPO / "examples" / "street.jpg").read_bytes(), "image/jpeg")}, timeout=30)
    assert photo.status_code == 200 and photo.json()["result"]["image"] == {"width": 640, "height": 480}
    assert httpx.post(f"{server.url}/models/tiny/predict", content=b"{}", headers={"content-type": "application/json"},
                      timeout=30).status_code == 415


def test_its_memory_estimate_counts_the_weights_and_each_image(store: Path) -> None:
    from tiny_cnn.network import SIDE

    local = plugin(store)
    local.load("cpu")
    estimate = local.memory_estimate()
    assert estimate.weights_bytes == sum(p.numel() * 4 for p in local.network.parameters())
    assert estimate.per_item_bytes > 3 * SIDE * SIDE * 4  # the upload, and every layer's output on top of it
    assert estimate.fixed_bytes > 0


@pytest.mark.parametrize(("device", "message"), [
    ("cuda:7", "model 'tiny': device 'cuda:7' is not here: torch"),
    ("tpu:0", "model 'tiny': device 'tpu:0' is not valid; accepted: 'cpu' or 'cuda:N'"),
])
def test_a_device_it_cannot_use_is_refused_naming_the_model(store: Path, device: str, message: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises((RuntimeError, ValueError), match=message.replace("(", r"\(")):
        plugin(store).load(device)


def test_missing_weights_are_refused_naming_the_model_and_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model 'tiny': weights .*tiny-cnn.pt' not found; write them with "
                                                r"`python -m tiny_cnn PATH`"):
        plugin(tmp_path).load("cpu")


@pytest.mark.gpu
def test_on_cuda_it_answers_as_on_the_cpu_within_its_memory_estimate(store: Path) -> None:
    import torch

    cpu, gpu = plugin(store, top_k=5), plugin(store, top_k=5)
    cpu.load("cpu")
    gpu.load("cuda:0")
    items = [gpu.preprocess(Payload(body, "image/jpeg")) for body in photos()] * 2  # a batch of 12
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    on_gpu = gpu.predict_batch(items)
    peak = torch.cuda.max_memory_allocated() - before
    estimate = gpu.memory_estimate()
    assert peak <= estimate.fixed_bytes + len(items) * estimate.per_item_bytes, (peak, estimate)
    on_cpu = cpu.predict_batch(items)
    for a, b in zip(on_gpu, on_cpu, strict=True):
        assert list(a.ids) == list(b.ids)
        assert np.allclose(a.scores, b.scores, atol=1e-4)
    gpu.unload()
