"""The plugin of docs/plugins.md, written from the guide alone: the guide shows exactly the files of
`examples/plugin-mean-colour`, the package imports nothing of the router but `router.sdk`, and a
real `model-router serve` serves it over the native API and KServe V2 with the documented
statuses (400, 413, 415), batching and answers in order."""

from __future__ import annotations

import ast
import asyncio
import io
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO, RouterProcess, metric_value, serve

pytestmark = pytest.mark.e2e

EXAMPLE = REPO / "examples" / "plugin-mean-colour"
GUIDE = REPO / "docs" / "plugins.md"
FLEET = """
models:
  colour:
    plugin: mean-colour
    options: {decimals: 2}
    batch: {max_size: 8, max_delay_ms: 300}
  small:
    plugin: mean-colour
    options: {max_pixels: 5000}
"""


def shown_in_guide(path: str, language: str) -> str:
    """The code block the guide shows right after naming `path`."""
    guide = GUIDE.read_text(encoding="utf-8")
    match = re.search(rf"`{re.escape(path)}`:\n\n```{language}\n(.*?)```\n", guide, re.DOTALL)
    assert match is not None, f"docs/plugins.md shows no {language} block for {path}"
    return match.group(1)


@pytest.mark.parametrize(("path", "language"), [("pyproject.toml", "toml"), ("mean_colour/plugin.py", "python")])
def test_the_guide_shows_the_example_exactly(path: str, language: str) -> None:
    assert shown_in_guide(f"examples/plugin-mean-colour/{path}", language) == (EXAMPLE / path).read_text(encoding="utf-8")


@pytest.mark.parametrize("package", ["plugin-mean-colour/mean_colour", "plugin-tiny-cnn/tiny_cnn"])
def test_the_example_imports_nothing_of_the_router_but_its_sdk(package: str) -> None:
    imported = set()
    for source in (REPO / "examples" / package).glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert {name for name in imported if name.split(".")[0] == "router"} == {"router.sdk"}


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("example"), FLEET) as process:
        yield process


def predict(server: RouterProcess, model: str, body: bytes, media_type: str = "image/png") -> httpx.Response:
    return httpx.post(f"{server.url}/models/{model}/predict", content=body, headers={"content-type": media_type},
                      timeout=30)


def test_it_answers_the_mean_colour(server: RouterProcess) -> None:
    response = predict(server, "colour", png(64, 48, (255, 0, 0)))
    assert response.status_code == 200, response.text
    assert response.json()["result"] == {"rgb": [255.0, 0.0, 0.0], "hex": "#ff0000", "image": {"width": 64, "height": 48}}
    photo = httpx.post(f"{server.url}/models/colour/predict", files={"file": ("street.jpg",
                       (REPO / "examples" / "street.jpg").read_bytes(), "image/jpeg")}, timeout=30)
    assert photo.status_code == 200 and photo.json()["result"]["image"] == {"width": 640, "height": 480}
    described = httpx.get(f"{server.url}/models/colour").json()
    assert described["state"] == "ready"
    assert described["plugin"]["distribution"] == "vision-model-router-example-mean-colour"


def test_concurrent_requests_share_batches_and_each_gets_its_own_answer(server: RouterProcess) -> None:
    colours = [(i * 30, 255 - i * 30, (i * 70) % 256) for i in range(8)]

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return list(await asyncio.gather(*(
                client.post("/models/colour/predict", content=png(20 + i, 10, c), headers={"content-type": "image/png"})
                for i, c in enumerate(colours))))

    responses = asyncio.run(send())
    assert [r.status_code for r in responses] == [200] * 8
    assert [r.json()["result"]["rgb"] for r in responses] == [[float(v) for v in c] for c in colours]
    assert max(r.json()["timing"]["batch_size"] for r in responses) > 1, "the requests should have been batched"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "model_router_requests_total", model="colour", outcome="ok") >= 8


def test_bad_inputs_get_the_documented_statuses(server: RouterProcess) -> None:
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    assert predict(server, "colour", gif.getvalue(), "application/octet-stream").status_code == 415
    assert predict(server, "colour", png(8, 8, (0, 0, 0))[:30]).status_code == 400
    assert predict(server, "colour", b"{}", "application/json").status_code == 415
    too_big = predict(server, "small", png(100, 100, (0, 0, 0)))
    assert too_big.status_code == 413, too_big.text
    assert predict(server, "small", png(20, 20, (0, 0, 255))).json()["result"]["hex"] == "#0000ff"


def test_kserve_v2_pixels_reach_preprocess_as_images(server: RouterProcess) -> None:
    pixels = np.zeros((2, 4, 6, 3), dtype=np.uint8)
    pixels[0, ..., 2] = 255  # blue
    pixels[1, ..., 1] = 128  # dark green
    body = {"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": list(pixels.shape),
                        "data": pixels.reshape(-1).tolist()}]}
    response = httpx.post(f"{server.url}/v2/models/colour/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    answers: list[dict[str, Any]] = [json.loads(item) for item in output["data"]]
    assert [a["hex"] for a in answers] == ["#0000ff", "#008000"]
    assert answers[0]["image"] == {"width": 6, "height": 4}
