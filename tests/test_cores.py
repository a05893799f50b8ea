"""The three cores under `Serving` (router/serving/facade.py) implement the one narrow interface,
`Core`, member for member, each with its own trace phase; and the wide surface of requests, admin
verbs and drains lives in `Serving` alone. The behaviour of each is what the request-rules contract
test (tests/test_request_rules.py) and the end-to-end tests show."""

from __future__ import annotations

import inspect

import pytest

from router.cluster.front import ClusterRuntime
from router.host.client import EngineClient
from router.serving.facade import Core, Serving
from router.serving.runtime import Runtime

CORES = [Runtime, EngineClient, ClusterRuntime]
#: What `Serving` does once for every layout: no core carries these any more.
SERVING_ONLY = ["submit", "drain", "in_flight", "add_telemetry", "load_model", "unload_model", "put_model",
                "delete_model", "put_pipeline", "delete_pipeline", "put_version", "delete_version", "set_traffic"]


def interface() -> dict[str, object]:
    """`Core`'s methods and properties (its data attributes, `clock` and `telemetry`, are set per instance)."""
    return {name: member for name, member in vars(Core).items()
            if not name.startswith("_") and (callable(member) or isinstance(member, property))}


@pytest.mark.parametrize("core", CORES, ids=lambda core: core.__name__)
def test_each_core_implements_every_member_of_the_interface(core: type) -> None:
    members = interface()
    assert {"lookup", "screen", "run", "ended", "call", "begin_drain", "answer_open"} <= set(members)
    missing = [name for name in members if not hasattr(core, name)]
    assert missing == [], f"{core.__name__} lacks {missing}"
    for name, member in members.items():
        if isinstance(member, property):
            assert isinstance(getattr(core, name), property), f"{core.__name__}.{name} is not a property"
        else:
            wanted = list(inspect.signature(member).parameters)
            got = list(inspect.signature(getattr(core, name)).parameters)
            assert got == wanted, f"{core.__name__}.{name}{got} against Core.{name}{wanted}"
            assert inspect.iscoroutinefunction(getattr(core, name)) == inspect.iscoroutinefunction(member), name
    assert core.phase in {"admission", "replica"}


#: The admin verbs' bodies stay on the one core that holds a fleet editor: `Runtime.call` applies a
#: verb to them (router/serving/verbs.py), in one process or in a split host's engine.
VERB_BODIES = {"load_model", "unload_model", "put_model", "delete_model", "put_pipeline", "delete_pipeline",
               "put_version", "delete_version", "set_traffic"}


@pytest.mark.parametrize("core", CORES, ids=lambda core: core.__name__)
def test_the_request_surface_is_written_once_in_serving(core: type) -> None:
    assert all(hasattr(Serving, name) for name in SERVING_ONLY)
    allowed = VERB_BODIES if core is Runtime else set()
    assert [name for name in SERVING_ONLY if hasattr(core, name) and name not in allowed] == []
