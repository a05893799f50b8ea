"""Versions of a model served for real: config/fleet.versions.yaml, resnet18 split 90/10 between two
differently seeded demo checkpoints (resnet18.pt as version 1, resnet18-b.pt as version 2).

Against a real `model-router serve` of that file: the weighted draw lands within binomial bounds,
a sticky key keeps its version, a pinned version is honoured over native HTTP, KServe V2 and gRPC
(tritonclient), and each version answers as its own checkpoint does when called directly with
torchvision. On a server of its own, a mirror's answers are compared with the stable version's
(the mean agreement equals what the two checkpoints give directly on the same images; an identical
copy agrees 1.0). On a split host (two fronts and an engine), a change of the split made through
one front reaches every front, and the metrics add up every process. Ordered by state (polls),
every wait bounded; no speed asserted.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torchvision
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from PIL import Image
from tritonclient.utils import InferenceServerException

from router.sdk.plugin import Payload
from router.store import init_demo
from tests.conftest import HANG_S, REPO, RouterProcess, metric_value, serve
from tests.e2e.test_split_host import serve_split, until
from tests.plugins.conftest import encode, photo
from tests.plugins.test_resnet import REFERENCE_SCORE_TOLERANCE, direct

pytestmark = pytest.mark.e2e

FLEET_FILE = REPO / "config" / "fleet.versions.yaml"
STORE = REPO / "model_store"
EXAMPLES = REPO / "examples"
NAME = "resnet18"
PREDICT = f"/models/{NAME}/predict"
CHECKPOINTS = {"1": "resnet18.pt", "2": "resnet18-b.pt"}
ROUTE_KEYS = ("versions", "stable", "traffic", "mirror", "rollout")
#: Draws of the 90/10 split: version 2's count is binomial(n, 0.1); 4.5 standard deviations around
#: its mean is crossed by chance about once in 150,000 runs.
DRAWS = 2000
STICKY_KEYS, STICKY_ROUNDS = 60, 3
PINNED = 20


def tiny_png(colour: tuple[int, int, int] = (120, 30, 200)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def versions_fleet() -> str:
    """config/fleet.versions.yaml as shipped, its model store named by an absolute path."""
    text = FLEET_FILE.read_text(encoding="utf-8")
    assert "model_store: ../model_store" in text
    return text.replace("model_store: ../model_store", f"model_store: {STORE}")


def resnet_fleet() -> str:
    """The same file with resnet18 alone (no detector, no pipeline): its versions, split and store."""
    fleet = yaml.safe_load(versions_fleet())
    fleet["models"] = {NAME: fleet["models"][NAME]}
    fleet.pop("pipelines", None)
    return str(yaml.safe_dump(fleet, sort_keys=False))


@pytest.fixture(scope="module")
def store() -> Path:
    """The fleet file's model store: the demo checkpoints, built by init_demo where missing."""
    init_demo(STORE, progress=lambda line: None)
    return STORE


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("versions"), versions_fleet()) as process:
        yield process


@pytest.fixture(scope="module")
def references(store: Path) -> dict[str, torch.nn.Module]:
    """Each version's checkpoint loaded directly into torchvision's resnet18."""
    networks = {}
    for version, filename in CHECKPOINTS.items():
        network = torchvision.models.resnet18(weights=None)
        network.load_state_dict(torch.load(store / filename, weights_only=True))
        networks[version] = network.eval()
    return networks


def version_of(response: httpx.Response) -> str:
    """The version that answered, as the header and the JSON both say it (they must agree)."""
    assert response.status_code == 200, (response.status_code, response.text[:300])
    version = response.headers["x-model-version"]
    assert response.json()["version"] == version and response.json()["model"] == NAME, response.text[:300]
    return version


def top1(response: httpx.Response) -> int:
    return int(response.json()["result"]["top_k"][0]["class_id"])


def post_many(server: RouterProcess, count: int, *, path: str = PREDICT, body: bytes | None = None,
              headers_of: Callable[[int], dict[str, str]] = lambda i: {}, concurrency: int = 8,
              fresh_connections: bool = False) -> list[httpx.Response]:
    """`count` POSTs of a PNG, at most `concurrency` at a time; each on a new connection if asked
    (on a split host, new connections land on either front)."""
    content = tiny_png() if body is None else body

    async def send_all() -> list[httpx.Response]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_keepalive_connections=0) if fresh_connections else httpx.Limits()
        async with httpx.AsyncClient(base_url=server.url, timeout=6 * HANG_S, limits=limits) as client:
            async def one(index: int) -> httpx.Response:
                async with gate:
                    return await client.post(path, content=content,
                                             headers={"content-type": "image/png", **headers_of(index)})

            return list(await asyncio.gather(*(one(i) for i in range(count))))

    return asyncio.run(send_all())


def route_of(server: RouterProcess) -> dict[str, Any]:
    answer = httpx.get(f"{server.url}/models/{NAME}", timeout=HANG_S)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def put_traffic(server: RouterProcess, change: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.put(f"{server.url}/models/{NAME}/traffic", json=change, timeout=HANG_S)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def metrics(server: RouterProcess) -> str:
    return httpx.get(server.url + "/metrics", timeout=HANG_S).text


def outcome_counts(server: RouterProcess) -> dict[str, int]:
    """Answers per version that the route's figures count as ok."""
    return {v: int(route_of(server)["figures"]["outcomes"].get(v, {}).get("ok", 0)) for v in CHECKPOINTS}


# -- the split, the sticky key and the pin, over native HTTP ---------------------------------------


def test_the_90_10_split_draws_version_2_within_binomial_bounds(server: RouterProcess) -> None:
    route = route_of(server)
    assert route["kind"] == "versions" and route["versions"] == ["1", "2"] and route["stable"] == "1"
    assert route["weights"] == {"1": 90.0, "2": 10.0} and route["mirror"] is None
    assert route["deployments"] == {"1": f"{NAME}@1", "2": f"{NAME}@2"}
    before = outcome_counts(server)
    drawn = Counter(version_of(answer) for answer in post_many(server, DRAWS, concurrency=16))
    assert set(drawn) == {"1", "2"} and sum(drawn.values()) == DRAWS, drawn
    bound = 4.5 * math.sqrt(DRAWS * 0.1 * 0.9)
    assert abs(drawn["2"] - DRAWS * 0.1) <= bound, f"version 2 answered {drawn['2']} of {DRAWS}; bound ±{bound:.1f}"
    until(lambda: {v: outcome_counts(server)[v] - before[v] for v in CHECKPOINTS} == dict(drawn), HANG_S,
          f"the route's figures counting the answers {dict(drawn)}")


def test_a_sticky_key_always_gets_the_same_version(server: RouterProcess) -> None:
    keys = [f"customer-{i}" for i in range(STICKY_KEYS)]
    sent = [keys[i % STICKY_KEYS] for i in range(STICKY_KEYS * STICKY_ROUNDS)]  # each key's requests interleaved
    answers = post_many(server, len(sent), headers_of=lambda i: {"X-Route-Key": sent[i]})
    seen: dict[str, set[str]] = defaultdict(set)
    for key, answer in zip(sent, answers, strict=True):
        seen[key].add(version_of(answer))
    changed = {key: versions for key, versions in seen.items() if len(versions) != 1}
    assert not changed, f"keys answered by more than one version: {changed}"
    by_version = Counter(next(iter(versions)) for versions in seen.values())
    # The key's hash is the same in every run: these 60 keys always include some of version 2's 10%.
    assert set(by_version) == {"1", "2"}, by_version


def test_a_pinned_version_is_honoured_by_header_and_by_path(server: RouterProcess) -> None:
    by_header = post_many(server, PINNED, headers_of=lambda i: {"X-Model-Version": "2"})
    by_path = post_many(server, PINNED, path=f"/models/{NAME}/versions/2/predict")
    assert [version_of(a) for a in by_header + by_path] == ["2"] * (2 * PINNED)
    assert version_of(post_many(server, 1, headers_of=lambda i: {"X-Model-Version": "1"})[0]) == "1"


@pytest.mark.parametrize("how", ["header", "path"])
def test_an_unknown_version_is_404_naming_the_versions(server: RouterProcess, how: str) -> None:
    path, headers = (PREDICT, {"X-Model-Version": "9"}) if how == "header" else (f"/models/{NAME}/versions/9/predict", {})
    (answer,) = post_many(server, 1, path=path, headers_of=lambda i: headers)
    assert answer.status_code == 404, answer.text
    detail = answer.json()["detail"]
    listed = re.search(r"versions: ([\w., -]+)$", detail)
    assert "'9'" in detail and listed is not None and listed.group(1).split(", ") == ["1", "2"], detail


# -- KServe V2 over HTTP and gRPC ------------------------------------------------------------------


def triton_client(module: Any, server: RouterProcess) -> Any:
    return module.InferenceServerClient(server.grpc_address if module is grpcclient else server.url.removeprefix("http://"))


def image_tensor(module: Any, data: bytes) -> Any:
    tensor = module.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    return tensor


def infer(client: Any, module: Any, data: bytes, version: str = "") -> tuple[str, int]:
    """(the answer's model_version, its top-1 class)."""
    result = client.infer(NAME, [image_tensor(module, data)], model_version=version)
    response = result.get_response()
    answered = response["model_version"] if module is httpclient else response.model_version
    return answered, int(json.loads(result.as_numpy("OUTPUT")[0])["top_k"][0]["class_id"])


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritonclient_pins_and_reports_the_version(server: RouterProcess, module: Any) -> None:
    data = (EXAMPLES / "square.png").read_bytes()
    client = triton_client(module, server)
    try:
        pinned = {v: infer(client, module, data, v) for v in CHECKPOINTS}
        assert {v: answered for v, (answered, _) in pinned.items()} == {"1": "1", "2": "2"}
        tops = {v: top for v, (_, top) in pinned.items()}
        assert tops["1"] != tops["2"], tops  # the checkpoints differ on this image: the next check means something
        for _ in range(5):
            answered, top = infer(client, module, data)
            assert answered in CHECKPOINTS and top == tops[answered], (answered, top, tops)
        assert client.is_model_ready(NAME, "2") and client.is_model_ready(NAME, "1")
        assert not client.is_model_ready(NAME, "9")
        metadata = client.get_model_metadata(NAME, "2")
        listed = metadata["versions"] if module is httpclient else list(metadata.versions)
        assert listed == ["1", "2"], metadata
        with pytest.raises(InferenceServerException) as refused:
            client.infer(NAME, [image_tensor(module, data)], model_version="9")
        assert refused.value.status() in ("404", "StatusCode.NOT_FOUND"), refused.value
        assert "versions: 1, 2" in refused.value.message(), refused.value
    finally:
        client.close()


def test_v2_metadata_and_readiness_by_version_over_plain_http(server: RouterProcess) -> None:
    with httpx.Client(base_url=server.url + f"/v2/models/{NAME}", timeout=HANG_S) as client:
        for path in ("", "/versions/2", "/versions/1"):
            answer = client.get(path)
            assert answer.status_code == 200 and answer.json()["versions"] == ["1", "2"], (path, answer.text)
            assert answer.json()["name"] == NAME
        assert client.get("/ready").status_code == client.get("/versions/2/ready").status_code == 200
        for path in ("/versions/9/ready", "/versions/9"):
            answer = client.get(path)
            assert answer.status_code == 404 and "versions: 1, 2" in answer.json()["error"], (path, answer.text)


# -- each version answers as its own checkpoint ----------------------------------------------------


def clear_images(references: dict[str, torch.nn.Module], count: int) -> list[Payload]:
    """examples/ and generated pictures whose top-1 leads the second class by more than the
    preprocessing's drift on both checkpoints, so that a top-1 can only match or truly differ."""
    candidates = [Payload((EXAMPLES / n).read_bytes(), t) for n, t in (("street.jpg", "image/jpeg"), ("square.png", "image/png"))]
    candidates += [Payload(encode(photo(96 + 16 * s, 80 + 8 * s, seed=40 + s), "PNG"), "image/png") for s in range(12)]
    chosen = []
    for payload in candidates:
        tops = [direct(network, payload, 2) for network in references.values()]
        if all(first[1] - second[1] > 2 * REFERENCE_SCORE_TOLERANCE for first, second in tops):
            chosen.append(payload)
        if len(chosen) == count:
            return chosen
    raise AssertionError(f"only {len(chosen)} of {len(candidates)} images have a clear top-1 on both checkpoints")


def test_each_version_answers_as_its_checkpoint_does_directly(server: RouterProcess,
                                                              references: dict[str, torch.nn.Module]) -> None:
    images = clear_images(references, 5)
    expected = {v: [direct(references[v], image, 1)[0][0] for image in images] for v in CHECKPOINTS}
    assert expected["1"] != expected["2"], expected
    with httpx.Client(base_url=server.url, timeout=6 * HANG_S) as client:
        for version in CHECKPOINTS:
            answers = [client.post(f"/models/{NAME}/versions/{version}/predict", content=image.body,
                                   headers={"content-type": image.media_type}) for image in images]
            assert [version_of(a) for a in answers] == [version] * len(images)
            assert [top1(a) for a in answers] == expected[version], version


# -- agreement between versions, on a server of its own --------------------------------------------


def distinct_images(count: int) -> list[Payload]:
    images = [Payload(encode(photo(64 + 4 * i, 48 + 4 * i, seed=500 + i), "PNG"), "image/png") for i in range(count)]
    assert len({hashlib.sha256(image.body).digest() for image in images}) == count
    return images


def shadow_settled(server: RouterProcess, version: str, deployment: str) -> tuple[float, float]:
    """(comparisons of `version` with the stable version 1, the copies on `deployment` refused:
    shed, failed or expired), as the metrics count them."""
    text = metrics(server)
    compared = metric_value(text, "model_router_version_agreement_count", model=NAME, version=version, against="1")
    refused = sum(metric_value(text, "model_router_mirror_requests_total", model=deployment, outcome=outcome)
                  for outcome in ("shed", "failed", "expired"))
    return compared, refused


def compare_each(server: RouterProcess, images: list[Payload], version: str) -> list[Payload]:
    """Send the images one at a time, each once the previous one's shadow copy was compared or
    refused; the images whose comparison landed."""
    landed, deployment = [], f"{NAME}@{version}"
    with httpx.Client(base_url=server.url, timeout=6 * HANG_S) as client:
        for image in images:
            compared, refused = shadow_settled(server, version, deployment)
            answer = client.post(PREDICT, content=image.body, headers={"content-type": image.media_type})
            assert version_of(answer) == "1"  # all the traffic goes to the stable version
            deadline = time.monotonic() + HANG_S
            while (now := shadow_settled(server, version, deployment)) == (compared, refused):
                assert time.monotonic() < deadline, f"the shadow copy on {deployment} was neither compared nor refused"
                time.sleep(0.05)
            assert now[0] - compared + now[1] - refused == 1, (compared, refused, now)
            if now[0] > compared:
                landed.append(image)
    return landed


def test_mirrored_answers_are_compared_with_the_stable_version(tmp_path: Path, store: Path,
                                                               references: dict[str, torch.nn.Module]) -> None:
    with serve(tmp_path, resnet_fleet()) as lab:
        generation = route_of(lab)["generation"]
        route = put_traffic(lab, {"weights": {"1": 100}, "mirror": {"version": "2", "percent": 100}})
        assert route["weights"] == {"1": 100.0} and route["mirror"] == {"version": "2", "percent": 100.0}
        assert route["generation"] > generation
        images = distinct_images(20)
        landed = compare_each(lab, images, "2")
        # Sent one at a time, no real request ever waited beside a copy: none had a reason to be shed.
        assert len(landed) == len(images)
        agreeing = sum(direct(references["1"], i, 1)[0][0] == direct(references["2"], i, 1)[0][0] for i in landed)
        figure = route_of(lab)["figures"]["agreement"]["2 vs 1"]
        assert figure["compared"] == len(landed) and math.isclose(figure["mean"] * figure["compared"], agreeing,
                                                                  abs_tol=1e-6), (figure, agreeing)
        text = metrics(lab)
        labels = {"model": NAME, "version": "2", "against": "1"}
        assert metric_value(text, "model_router_version_agreement_count", **labels) == len(landed)
        assert math.isclose(metric_value(text, "model_router_version_agreement_sum", **labels), agreeing, abs_tol=1e-6)
        assert metric_value(text, "model_router_mirror_requests_total", model=f"{NAME}@2", outcome="served") == len(landed)
        assert metric_value(text, "model_router_version_requests_total", model=NAME, version="1", outcome="ok") == len(images)
        assert metric_value(text, "model_router_version_requests_total", model=NAME, version="2", outcome="ok") == 0

        # Only what differs from the stable version: here, nothing but its own checkpoint, version 1's.
        added = httpx.put(f"{lab.url}/models/{NAME}/versions/3", json={"options": {"weights": CHECKPOINTS["1"]}},
                          timeout=6 * HANG_S)
        assert added.status_code == 201 and added.json()["outcome"] == "added", added.text
        assert added.json()["model"]["name"] == f"{NAME}@3"
        route = put_traffic(lab, {"mirror": {"version": "3", "percent": 100}})
        assert route["versions"] == ["1", "2", "3"] and route["weights"] == {"1": 100.0}
        assert route["mirror"] == {"version": "3", "percent": 100.0}
        same = compare_each(lab, images[:6], "3")
        assert len(same) == 6
        figures = route_of(lab)["figures"]["agreement"]
        assert figures["3 vs 1"] == {"compared": 6, "mean": 1.0}, figures
        assert figures["2 vs 1"] == figure, figures  # the mirror moved: version 2 is compared no more


# -- a split host: two fronts and an engine --------------------------------------------------------


def fronts_that_answered(server: RouterProcess) -> set[object]:
    return {r.get("role") for r in server.log_records()
            if r.get("message") == "request" and r.get("path") == PREDICT and r.get("status") == 200}


def test_a_split_host_routes_by_the_engines_split_and_adds_up_every_front(tmp_path: Path, store: Path) -> None:
    with serve_split(tmp_path, resnet_fleet()) as split:
        answered = Counter(version_of(a) for a in post_many(split, 150, fresh_connections=True))
        assert set(answered) == {"1", "2"}, answered  # 150 draws at 10% miss version 2 once in 7 million runs
        until(lambda: fronts_that_answered(split) == {"front 1", "front 2"}, HANG_S, "both fronts answering")

        route = put_traffic(split, {"weights": {"1": 0, "2": 100}})
        assert route["weights"] == {"1": 0.0, "2": 100.0}, route
        streak, deadline = 0, time.monotonic() + 3 * HANG_S
        while streak < 20:  # each on a new connection, so on either front
            assert time.monotonic() < deadline, f"20 answers in a row by version 2 never came: {answered}"
            version = version_of(httpx.post(split.url + PREDICT, content=tiny_png(),
                                            headers={"content-type": "image/png"}, timeout=6 * HANG_S))
            answered[version] += 1
            streak = streak + 1 if version == "2" else 0

        def counted(text: str, version: str) -> float:
            return metric_value(text, "model_router_version_requests_total", model=NAME, version=version, outcome="ok")

        until(lambda: all(counted(metrics(split), v) == answered[v] for v in CHECKPOINTS), HANG_S,
              f"the metrics adding up every front's answers {dict(answered)}")
        weights = {"1": 0.0, "2": 100.0}
        until(lambda: {v: metric_value(metrics(split), "model_router_route_weight", model=NAME, version=v)
                       for v in CHECKPOINTS} == weights, HANG_S, f"model_router_route_weight at {weights}")
