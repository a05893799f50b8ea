"""Fleet state has one writer: `router/serving/fleet_state.py` for the plan, the deployments and
schedulers, `router/serving/model_residency.py` for a model's residency. Every change to the first
is one `FleetChange` given to `FleetState.apply`, which returns the fleet's next generation.

Two checks: at run time the mappings `FleetState` hands out are read-only views and `Residency`'s
fields have no setters; and statically, no module of `router/` but those two writes into them
(an assignment, a `del`, or a mutating method on a mapping called deployments or schedulers, or
an assignment to a field of something called residency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from router.errors import ModelNotFound, ModelUnavailable
from router.serving.fleet_state import FleetState, Forget, Replan, Serve, Stage, Withdraw
from router.serving.model_residency import Residency
from router.serving.runtime import Runtime
from tests.test_fleet import fleet, scripted
from tests.test_runtime import ask, make_runtime, running

ROUTER = Path(__file__).resolve().parents[1] / "router"
FLEET_MAPPINGS = {"deployments", "_deployments", "schedulers", "_schedulers", "device_errors", "_device_errors",
                  "retired", "_retired", "attached", "_attached"}
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


def test_the_mappings_handed_out_are_read_only(tmp_path: Path) -> None:
    state = FleetState(make_runtime(tmp_path, fleet(scripted("a"))).core.plan)
    for mapping in (state.deployments, state.schedulers, state.device_errors):
        with pytest.raises(TypeError):
            mapping["m"] = object()  # type: ignore[index]


@pytest.mark.parametrize("field", ["holders", "held", "held_down", "restarts", "load_error", "retry_at", "loads"])
def test_residency_fields_change_only_through_its_transitions(field: str) -> None:
    residency = Residency()
    with pytest.raises(AttributeError):
        setattr(residency, field, 1)


# -- changes as values, each one generation ----------------------------------------------------------


def _members(runtime: Runtime) -> list[str]:
    """The instance keys the CPU scheduler runs, in the order they joined."""
    return [runner.key for _, runner in runtime.core._state.schedulers["cpu"]._members]


async def test_each_change_is_applied_whole_and_advances_the_generation_by_one(tmp_path: Path) -> None:
    async with running(make_runtime(tmp_path, fleet(scripted("a"), scripted("b")))) as runtime:
        state = runtime.core._state
        start = state.generation
        old = state.get("b")
        new = runtime.core._build("b", state.plan, 2)
        assert state.apply(Stage(new)) == start + 1
        assert state.apply(Stage(new)) == start + 2  # staged once: the scheduler runs each instance once
        assert _members(runtime).count("b/0@2") == 1 and state.get("b") is old  # staged, not serving
        assert state.apply(Serve(new)) == start + 3
        assert state.get("b") is new and state.find_instance("b/0") == (old, old.instances[0])  # draining, findable
        with pytest.raises(ValueError, match="serves"):
            state.apply(Forget(new))  # a serving deployment is withdrawn or replaced first
        assert state.apply(Forget(old)) == start + 4
        assert "b/0" not in _members(runtime)
        with pytest.raises(KeyError):
            state.find_instance("b/0")
        plan = state.plan
        with pytest.raises(ModelNotFound):
            state.apply(Withdraw("nope", plan))
        assert state.generation == start + 4  # a change refused changes nothing
        assert state.apply(Withdraw("b")) == start + 5
        assert "b" not in state.deployments and state.find_instance("b/0@2")[0] is new
        assert state.apply(Replan(plan)) == start + 6 and state.plan is plan


async def test_the_runtimes_generation_moves_with_each_operators_change_and_not_with_requests(tmp_path: Path) -> None:
    async with running(make_runtime(tmp_path, fleet(scripted("a"), budget_mb=100))) as runtime:
        core = runtime.core
        start = core.generation
        await runtime.submit("a", ask("x"))
        assert core.generation == start  # serving is no change
        await runtime.put_model("b", {"plugin": "scripted"})
        added = core.generation
        assert added > start and core.plan.models.keys() == {"a", "b"}
        outcome, _ = await runtime.put_model("b", {"plugin": "scripted"})
        assert outcome == "unchanged" and core.generation == added
        await runtime.put_model("b", {"plugin": "scripted", "options": {"weights_bytes": 2_000_000}})
        changed = core.generation
        assert changed > added and _members(runtime).count("b/0@2") == 1 and "b/0" not in _members(runtime)
        await runtime.delete_model("b")
        assert core.generation > changed and "b" not in core.plan.models and "b" not in core.deployments
        assert [key for key in _members(runtime) if key.startswith("b/")] == []


async def test_a_replacement_that_fails_to_load_leaves_the_old_deployment_serving_and_the_new_one_forgotten(
    tmp_path: Path,
) -> None:
    async with running(make_runtime(tmp_path, fleet(scripted("m", residency="always"), budget_mb=100))) as runtime:
        old = runtime.core._state.get("m")
        with pytest.raises(ModelUnavailable, match="old version keeps serving"):
            await runtime.put_model("m", {"plugin": "scripted", "residency": "always",
                                          "options": {"load_error": "bad checkpoint"}})
        assert runtime.core._state.get("m") is old and _members(runtime) == ["m/0"]
        assert (await runtime.submit("m", ask("still"))).output["id"] == "still"
