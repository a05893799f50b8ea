"""The GPU check's first part: what this machine is (GPU, driver, CUDA, the versions that matter),
whether the wheelhouse's distributions are installed, whether every requirement of the check's
dependency tree is met, and whether every module the check uses imports. Prints the machine's
description and writes OUT/environment.md.

    python -m gpu_check.environment OUT [--wheelhouse .whl]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pkgutil
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from gpu_check.results import Row, part_table
from gpu_check.wheelhouse import LEFT_OUT, PROVIDED_BY, ROOTS, Lookup, Node, installed, walk

__all__ = ["import_modules", "unmet", "with_providers"]

PART = "environment"
# Packages whose every module the check may import, and single modules beside them.
PACKAGES = ("router", "model_router_yolo", "model_router_resnet", "model_router_engines", "model_router_onnx",
            "model_router_tensorrt", "router_testkit")
MODULES = ("benchmarks.loadgen", "benchmarks.systems", "benchmarks.workloads", "benchmarks.direct", "benchmarks.gpu",
           "gpu_check.surge", "gpu_check.throughput", "ultralytics", "litestar", "uvicorn", "pydantic_settings",
           "simplejpeg", "pynvml", "onnxruntime", "onnx", "onnxscript", "cv2", "httpx", "pytest_asyncio")
# Modules that need a package the wheelhouse does not carry: package, and why they may be missing.
OPTIONAL = {"ray": "Ray is not carried (a 76 MiB wheel): the cluster modules and check skip",
            "tensorrt": "TensorRT is not carried: the engine builds skip"}
VERSIONS = ("torch", "torchvision", "onnxruntime", "onnx", "numpy", "opencv-python-headless", "opencv-python",
            "pillow", "nvidia-ml-py", "ultralytics", "litestar", "uvicorn", "pydantic", "simplejpeg", "tensorrt", "ray")


def with_providers(lookup: Lookup) -> Lookup:
    """`lookup`, where a missing distribution with a provider (PROVIDED_BY) answers with the provider."""

    def find(name: str) -> tuple[str, list[str]] | None:
        found = lookup(name)
        return lookup(PROVIDED_BY[name]) if found is None and name in PROVIDED_BY else found

    return find


def unmet(tree: Mapping[str, Node], missing: list[str]) -> list[tuple[str, str]]:
    """(who requires, what) for each requirement of the tree that what is installed does not meet;
    the packages the check does without (LEFT_OUT) excepted."""
    problems = []
    for name in missing:
        if name not in LEFT_OUT:
            parents = sorted(p for p, node in tree.items() for r in node.requires if canonicalize_name(r.name) == name)
            problems += [(parent, f"{parent} requires {name}, which is not installed") for parent in parents or ["?"]]
    for name, node in sorted(tree.items()):
        for requirement in node.requires:
            target = tree.get(canonicalize_name(requirement.name))
            if target is not None and not requirement.specifier.contains(target.version, prereleases=True):
                problems.append((name, f"{name} {node.version} requires {requirement}; installed: {target.version}"))
    return problems


def requirements_row(device_side: set[str]) -> Row:
    """FAIL where a carried distribution's requirement is unmet; warn where only the machine's own are."""
    tree, missing = walk(ROOTS, with_providers(installed), {})
    problems = unmet(tree, missing)
    failing = [text for requirer, text in problems if requirer not in device_side]
    result = "FAIL" if failing else ("warn" if problems else "pass")
    detail = "; ".join(text for _, text in problems) or f"all met ({len(tree)} distributions)"
    return Row(PART, "requirements of the check's tree", result, detail)


def module_names() -> list[str]:
    """Every module of PACKAGES (found without importing them), then MODULES."""
    names = []
    for package in PACKAGES:
        names.append(package)
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            names += [info.name for info in pkgutil.walk_packages(spec.submodule_search_locations, package + ".")
                      if not info.name.endswith("__main__")]
    return names + list(MODULES)


def import_modules(names: list[str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Import each module: (imported, {module: why it may be missing}, {module: its error})."""
    imported, optional, failed = [], {}, {}
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            (optional if root in OPTIONAL else failed)[name] = OPTIONAL.get(root, f"ModuleNotFoundError: {exc}")
        except Exception as exc:  # noqa: BLE001  (any import error is what this part exists to find)
            failed[name] = f"{type(exc).__name__}: {exc}"
        else:
            imported.append(name)
    return imported, optional, failed


def imports_row() -> Row:
    imported, optional, failed = import_modules(module_names())
    if failed:
        return Row(PART, "imports", "FAIL", "; ".join(f"{m}: {e}" for m, e in failed.items()))
    why = sorted(set(optional.values()))
    return Row(PART, "imports", "pass", f"{len(imported)} modules imported" +
               (f"; {len(optional)} skipped: " + "; ".join(why) if optional else ""))


def describe_machine() -> tuple[list[str], Row]:
    """Lines describing the machine, and its info row."""
    import torch

    lines = [f"python {platform.python_version()} ({sys.executable})"]
    lines += [f"{name} {found[0] if (found := installed(name)) else 'not installed'}" for name in VERSIONS]
    lines.append(f"torch CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
                 f"CUDA available {torch.cuda.is_available()}")
    try:
        import onnxruntime

        lines.append("onnxruntime providers " + ", ".join(onnxruntime.get_available_providers()))
    except ImportError as exc:
        lines.append(f"onnxruntime not importable: {exc}")
    if not torch.cuda.is_available():
        return lines, Row(PART, "GPU", "info", "no CUDA: torch.cuda.is_available() is False; every GPU part skips")
    props = torch.cuda.get_device_properties(0)
    gpu = f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}"
    lines.append(f"GPU 0: {gpu}; {torch.cuda.device_count()} visible")
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = f"driver {pynvml.nvmlSystemGetDriverVersion()}, CUDA driver {pynvml.nvmlSystemGetCudaDriverVersion_v2()}"
    except Exception as exc:  # noqa: BLE001  (NVML's own errors; the NVML checks report them again)
        driver = f"NVML unavailable: {exc}"
    lines.append(driver)
    return lines, Row(PART, "GPU", "info", f"{gpu}; {driver}; torch {torch.__version__} (CUDA {torch.version.cuda})")


def read_manifest(wheelhouse: Path | None) -> dict[str, Any] | None:
    path = wheelhouse / "wheelhouse.json" if wheelhouse else None
    return json.loads(path.read_text(encoding="utf-8")) if path and path.is_file() else None


def wheelhouse_rows(manifest: Mapping[str, Any] | None) -> list[Row]:
    """Each carried distribution installed at its version; the machine's versions beside those tested."""
    if manifest is None:
        return [Row(PART, "wheelhouse", "info", "none: the check runs with the environment it was started in")]
    wrong = [f"{name} {version} (found {found[0] if found else 'none'})" for name, version in manifest["carried"].items()
             if (found := installed(name)) is None or found[0] != version]
    rows = [Row(PART, "carried wheels installed", "FAIL" if wrong else "pass",
                f"not as carried: {', '.join(wrong)}" if wrong else
                f"{len(manifest['carried'])} distributions, {manifest['total_bytes'] / 2**20:.1f} MiB, --no-index")]
    differ = [f"{name} {found[0]} (tested with {pins['tested_here']})" for name, pins in manifest["device_side"].items()
              if (found := installed(name)) is not None and found[0] != pins["tested_here"]]
    rows.append(Row(PART, "the machine's versions", "info",
                    ("differ from the tests' here: " + ", ".join(differ)) if differ else "as tested here"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--wheelhouse", type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(args.wheelhouse)
    rows = wheelhouse_rows(manifest)
    rows.append(requirements_row(set(manifest["device_side"]) if manifest else set()))
    rows.append(imports_row())
    lines, machine = describe_machine()
    print("\n".join(lines))
    table = part_table((row.check, row.result, row.detail) for row in [machine, *rows])
    (args.out / "environment.md").write_text(table, encoding="utf-8")
    return 1 if any(row.result == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
