"""Fleet state has one writer: `router/serving/fleet_state.py` for the deployments and schedulers,
`router/serving/model_residency.py` for a model's residency.

Two checks: at run time the mappings `FleetState` hands out are read-only views and `Residency`'s
fields have no setters; and statically, no module of `router/` but those two writes into them
(an assignment, a `del`, or a mutating method on a mapping called deployments or schedulers, or
an assignment to a field of something called residency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from router.serving.fleet_state import FleetState
from router.serving.model_residency import Residency

ROUTER = Path(__file__).resolve().parents[1] / "router"
FLEET_MAPPINGS = {"deployments", "_deployments", "schedulers", "_schedulers", "device_errors", "_device_errors",
                  "retired", "_retired"}
MUTATORS = {"pop", "popitem", "clear", "update", "setdefault", "__setitem__", "__delitem__"}
WRITERS = {"deployments": "serving/fleet_state.py", "residency": "serving/model_residency.py"}


def _named(node: ast.AST, names: set[str]) -> bool:
    """`x.deployments`, `deployments` (a local or attribute called one of `names`)."""
    return (isinstance(node, ast.Attribute) and node.attr in names) or (isinstance(node, ast.Name) and node.id in names)


def writes(source: str) -> list[tuple[int, str, str]]:
    """(line, what is written, whose it is) for every write into fleet state in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for target in targets:
            for each in ast.walk(target):
                if isinstance(each, ast.Subscript) and _named(each.value, FLEET_MAPPINGS):
                    found.append((node.lineno, ast.unparse(each), "deployments"))
                elif isinstance(each, ast.Attribute) and _named(each.value, {"residency", "_residency"}):
                    found.append((node.lineno, ast.unparse(each), "residency"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and _named(node.func.value, FLEET_MAPPINGS)):
            found.append((node.lineno, ast.unparse(node.func), "deployments"))
    return sorted(found)


def test_the_scan_finds_writes_of_every_kind() -> None:
    """The static check can fail: each kind of write it looks for, in a snippet."""
    snippet = (
        "runtime.core.deployments['m'] = d\n"
        "del self._schedulers[device]\n"
        "fleet.deployments.pop('m')\n"
        "state._retired.update(old)\n"
        "deployment.residency.held = True\n"
        "d.residency.restarts += 1\n"
        "x = runtime.core.deployments['m']\n"  # a read: not a write
        "n = deployment.residency.holders\n"
    )
    assert [(line, kind) for line, _, kind in writes(snippet)] == [
        (1, "deployments"), (2, "deployments"), (3, "deployments"), (4, "deployments"), (5, "residency"), (6, "residency")]


def test_only_fleet_state_and_model_residency_write_fleet_state() -> None:
    offenders = []
    for path in sorted(ROUTER.rglob("*.py")):
        relative = path.relative_to(ROUTER).as_posix()
        for line, what, kind in writes(path.read_text()):
            if relative != WRITERS[kind]:
                offenders.append(f"router/{relative}:{line}: {what} (only router/{WRITERS[kind]} writes {kind})")
    assert offenders == []


def test_the_mappings_handed_out_are_read_only() -> None:
    state = FleetState()
    for mapping in (state.deployments, state.schedulers, state.device_errors):
        with pytest.raises(TypeError):
            mapping["m"] = object()  # type: ignore[index]


@pytest.mark.parametrize("field", ["holders", "held", "held_down", "restarts", "load_error", "retry_at", "loads"])
def test_residency_fields_change_only_through_its_transitions(field: str) -> None:
    residency = Residency()
    with pytest.raises(AttributeError):
        setattr(residency, field, 1)
