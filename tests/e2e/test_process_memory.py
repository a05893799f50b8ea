"""What each process of a split host loads: the parent supervises and imports no plugin, torch, numpy,
image library, web framework or gRPC; a front loads what its plugins' front hooks need and no more.

The checks read each live process's mapped files (`/proc/PID/maps`): every one of those packages
maps a compiled extension of its own once imported, so a stray import shows there whatever module
made it. The engine, which runs the networks, maps torch: the same check seeing it there is what
makes its absence elsewhere mean something. RSS is held only to a loose bound (it is noisy);
`make bench` states the figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import REPO, RouterProcess, free_port
from tests.e2e.test_default_fleet import EXAMPLES, default_fleet, store  # noqa: F401  # `store` is a fixture
from tests.e2e.test_split_host import roles, serve_split

pytestmark = pytest.mark.e2e

#: Packages whose compiled extensions the parent must not map: torch and its kin, numpy, the image
#: libraries, gRPC, and the web framework's (litestar's multidict, uvicorn's watchfiles).
PARENT_NEVER = ("torch", "torchvision", "numpy", "numpy.libs", "PIL", "pillow.libs", "cv2", "opencv_python.libs",
                "simplejpeg", "grpc", "multidict", "watchfiles")
PARENT_RSS_BOUND = 300 << 20  # a regression guard only: about 40 MB measured, 900 MB before


def extension_packages(pid: int) -> set[str]:
    """The site-packages directories whose shared objects the process maps."""
    found = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if ".so" in path and "/site-packages/" in path:
                found.add(path.split("/site-packages/", 1)[1].split("/", 1)[0])
    return found


def maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return any("/libtorch_cpu" in line for line in maps)


def hooks_in_engine(server: RouterProcess) -> list[str]:
    return [str(r["message"]) for r in server.log_records() if "hooks run in the engine" in str(r.get("message", ""))]


def post_photo(server: RouterProcess, model: str) -> dict[str, object]:
    reply = httpx.post(f"{server.url}/models/{model}/predict", content=(EXAMPLES / "street.jpg").read_bytes(),
                       headers={"content-type": "image/jpeg"}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def test_the_default_fleets_parent_loads_nothing_heavy_and_its_fronts_no_torchvision(
    tmp_path: Path, store: Path,  # noqa: F811  # the fixture imported above
) -> None:
    with serve_split(tmp_path, default_fleet(store)) as server:
        for model in ("yolov8n", "resnet18"):  # every front hook has run in some front
            for _ in range(4):
                post_photo(server, model)
        found = roles(server)
        parent = server.process.pid
        assert maps_libtorch(found["engine"]), "the check must see torch where it is"
        assert not maps_libtorch(parent)
        assert extension_packages(parent) & set(PARENT_NEVER) == set(), extension_packages(parent)
        assert psutil.Process(parent).memory_info().rss < PARENT_RSS_BOUND
        for front in ("front 1", "front 2"):  # ResNet's resize is torch's kernel: torch, but not torchvision
            assert "torchvision" not in extension_packages(found[front]), front
        assert hooks_in_engine(server) == []


def test_a_front_of_a_detector_fleet_never_maps_torch(tmp_path: Path, store: Path) -> None:  # noqa: F811
    fleet = (f"model_store: {store}\nmodels:\n  det:\n    plugin: yolo\n    options: {{model: yolov8n.pt, imgsz: 320}}\n"
             "    batch: {max_size: 4, max_delay_ms: 5}\n")
    with serve_split(tmp_path, fleet) as server:
        answers = [post_photo(server, "det") for _ in range(6)]  # connections of their own: both fronts, likely
        found = roles(server)
        assert all(a["result"]["image"] == {"width": 640, "height": 480} for a in answers), answers[0]
        assert maps_libtorch(found["engine"])
        assert [front for front in ("front 1", "front 2") if maps_libtorch(found[front])] == []
        assert not maps_libtorch(server.process.pid)
        assert hooks_in_engine(server) == []


def test_a_fleet_the_engine_refuses_stops_the_split_host_with_status_2(tmp_path: Path, store: Path) -> None:  # noqa: F811
    """The parent leaves the fleet file to the engine; an engine that refuses it at start-up ends the
    host, as one process refuses it before its port opens (a refused restart is a death like any
    other: test_split_host.py's crash loop)."""
    config = tmp_path / "fleet.yaml"
    config.write_text(f"model_store: {store}\nmodels:\n  clf:\n    plugin: resnet\n    options: {{weights: ../../etc/passwd}}\n",
                      encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODEL_ROUTER_")}
    env |= {"MODEL_ROUTER_CONFIG": str(config), "MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(free_port()),
            "MODEL_ROUTER_GRPC_PORT": "0", "MODEL_ROUTER_WORKERS": "2"}
    done = subprocess.run([sys.executable, "-m", "router", "serve"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout[-3000:]
    assert "resolves outside the model store" in done.stdout and "refused its configuration" in done.stdout
