"""Dependencies whose internals we use are bounded to the releases we test, and the installed ones
are inside those bounds: a fresh install cannot pick up a release that breaks the server unseen.

To move a bound: install the new release, run the tests named in `PRIVATE_USES` for it, then
change the requirement in its pyproject.toml.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO


@dataclass(frozen=True)
class PrivateUse:
    distribution: str
    pyproject: str  # where the requirement is declared (relative to the repository)
    extra: str | None  # the optional-dependencies group, or None for the main dependencies
    what: str  # which internals, where
    tests: str  # what to run against a new release before widening the bound


PRIVATE_USES = [
    PrivateUse("uvicorn", "pyproject.toml", None,
               "router/http/protocol.py subclasses uvicorn.protocols.http.httptools_impl.HttpToolsProtocol (its "
               "parser callbacks and attributes) and builds RequestResponseCycle by hand; router/http/server.py "
               "overrides Server.handle_exit",
               "tests/e2e/test_http_limits.py tests/e2e/test_early_refusal.py tests/e2e/test_serving.py"),
    PrivateUse("httptools", "pyproject.toml", None,
               "router/http/protocol.py drives the parser under uvicorn's protocol (its errors, get_method, "
               "should_upgrade)",
               "tests/e2e/test_http_limits.py tests/e2e/test_early_refusal.py"),
    PrivateUse("litestar", "pyproject.toml", None,
               "the whole HTTP layer (public API only: the bound is the next major version)",
               "tests/e2e tests/test_ui_state.py"),
    PrivateUse("ray", "pyproject.toml", "ray",
               "router/cluster/ray_router.py implements ray.serve.request_router.RequestRouter, an alpha API",
               "tests/cluster"),
    PrivateUse("ultralytics", "plugins/yolo/pyproject.toml", None,
               "plugins/yolo uses ultralytics.nn.autobackend.AutoBackend, ultralytics.utils.nms and "
               "ultralytics.utils.ops, internals that move between releases",
               "tests/plugins/test_yolo.py tests/plugins/test_parity.py"),
]


def requirement(use: PrivateUse) -> Requirement:
    project = tomllib.loads((REPO / use.pyproject).read_text(encoding="utf-8"))["project"]
    declared = project["dependencies"] if use.extra is None else project["optional-dependencies"][use.extra]
    found = [Requirement(text) for text in declared if Requirement(text).name == use.distribution]
    assert len(found) == 1, f"{use.pyproject} should declare {use.distribution} once, found {found}"
    return found[0]


def upper_bound(req: Requirement) -> Version | None:
    """The release the requirement stops before (`<X`), or pins (`==X`); None when unbounded above."""
    bounds = [Version(spec.version) for spec in req.specifier if spec.operator in ("<", "<=", "==", "~=")]
    return min(bounds) if bounds else None


@pytest.mark.parametrize("use", PRIVATE_USES, ids=[use.distribution for use in PRIVATE_USES])
def test_a_dependency_whose_internals_we_use_is_bounded_above(use: PrivateUse) -> None:
    req = requirement(use)
    assert upper_bound(req) is not None, (
        f"{use.pyproject} requires {req} with no upper bound, but {use.what}: bound it to the releases tested")


@pytest.mark.parametrize("use", PRIVATE_USES, ids=[use.distribution for use in PRIVATE_USES])
def test_the_installed_release_is_one_we_test(use: PrivateUse) -> None:
    req = requirement(use)
    try:
        installed = version(use.distribution)
    except PackageNotFoundError:
        pytest.skip(f"{use.distribution} is not installed here (the {use.extra or 'main'} dependencies)")
    assert req.specifier.contains(installed, prereleases=True), (
        f"{use.distribution} {installed} is installed, but model-router is tested with {req} ({use.pyproject}): "
        f"{use.what}. Install a release inside the bound (pip install '{req}'), or run {use.tests} against "
        f"{installed} and widen the bound if they pass.")


def test_the_bounds_see_a_release_outside_them() -> None:
    """The check itself: a release past the bound is refused, one inside it accepted."""
    req = Requirement("uvicorn[standard]>=0.54,<0.55")
    assert upper_bound(req) == Version("0.55")
    assert req.specifier.contains("0.54.3") and not req.specifier.contains("0.55.0")
    assert upper_bound(Requirement("uvicorn>=0.30")) is None


def test_every_private_use_names_files_that_exist() -> None:
    for use in PRIVATE_USES:
        for path in use.tests.split():
            assert (REPO / path).exists(), f"{use.distribution}: {path} does not exist"
        assert (REPO / use.pyproject).exists()

