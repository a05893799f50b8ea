"""The architecture is checked, not only described: import-linter's contracts in pyproject.toml
(layers, no web framework below the HTTP layer, plugins import only the SDK) must hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    assert "ignored" not in done.stdout, "a contract holds only by ignoring imports: " + done.stdout[-2000:]


def test_contracts_make_no_exceptions() -> None:
    """A contract kept by `ignore_imports` hides the very imports it exists to catch."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert [c["id"] for c in contracts if c.get("ignore_imports")] == []


def test_no_import_cycles() -> None:
    """No module of the router, or of any plugin, imports (indirectly) a module that imports it."""
    import grimp

    packages = ["router", "model_router_yolo", "model_router_resnet", "model_router_engines", "model_router_onnx",
                "model_router_tensorrt", "router_testkit", "mean_colour", "tiny_cnn"]
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported in graph.modules and graph.find_shortest_chain(importer=imported, imported=module):
                cycles.append(f"{module} <-> {imported}")
    assert not cycles, "import cycles: " + "; ".join(cycles)
