"""The wheelhouse that travels to a lent GPU machine: every wheel the GPU check needs that the machine lacks.

    python -m gpu_check.wheelhouse [--python 3.12] [--out .whl] [--limit-mib 60]

The dependency tree is walked through the distributions installed in this environment (so the wheels
carry the versions the test suite runs with), from the router, its plugins and what the check imports,
with markers evaluated for the target Python on x86-64 Linux. What the machine already holds
(device_packages.txt) stays behind; so do the few packages the check can do without (LEFT_OUT). The
router's own projects are built here; the rest is downloaded as CPython wheels for manylinux x86-64.
It prints the total and fails above the limit, naming the largest wheels: everything that travels to
the machine, the working tree included, must stay under 64 MiB.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

__all__ = ["LEFT_OUT", "PROVIDED_BY", "Plan", "build", "device_packages", "plan", "size_verdict", "walk"]

REPO = Path(__file__).resolve().parents[1]
DEVICE_PYTHON = "3.12"  # the lent machine's python3 is 3.12.3
DEFAULT_LIMIT_MIB = 60
MiB = 2**20

# The router's own distributions, built here from their source folders.
LOCAL = {"model-router": ".", "model-router-yolo": "plugins/yolo", "model-router-resnet": "plugins/resnet",
         "model-router-engines": "plugins/engines", "model-router-onnx": "plugins/onnx",
         "model-router-tensorrt": "plugins/tensorrt", "model-router-testkit": "tests/plugin_dist"}
# What the check imports: the router and its plugins, the test kit's plugins, and pytest-asyncio
# (pyproject's asyncio_mode; the machine has pytest but not it).
ROOTS = ("model-router", "model-router-yolo", "model-router-resnet", "model-router-engines[detect,classify,check]",
         "model-router-onnx", "model-router-tensorrt", "model-router-testkit", "pytest-asyncio")
# In the tree, not carried: the check does without them.
LEFT_OUT = {
    "opencv-python": "the machine's opencv-python-headless provides the same cv2 (opencv-python is a 67 MB wheel)",
    "polars": "ultralytics imports polars only to train, plot and benchmark, which the check never does",
    "polars-runtime-32": "polars' 54 MB runtime: ultralytics imports polars only to train, plot and benchmark",
}
# A requirement met by another distribution that installs the same modules.
PROVIDED_BY = {"opencv-python": "opencv-python-headless"}
# Optional parts the wheelhouse never carries, and what the check does without them.
NOT_CARRIED = {
    "ray[serve]": "a 76 MiB wheel: the two-replica cluster check skips with this reason",
    "tensorrt": "GBs of wheels: the TensorRT engine builds and tests skip with the reason",
    "onnxruntime-gpu": "a 244 MiB wheel: the ONNX Runtime CUDA runs skip unless the machine's onnxruntime offers CUDA",
}


@dataclass(frozen=True)
class Pin:
    name: str
    version: str


@dataclass
class Node:
    """One distribution of the tree: its version here, the extras asked of it, who asks for it."""

    version: str
    extras: set[str] = field(default_factory=set)
    required_by: set[str] = field(default_factory=set)
    requires: list[Requirement] = field(default_factory=list)  # those its markers and extras select


@dataclass(frozen=True)
class Plan:
    carried: list[Pin]  # built or downloaded into the wheelhouse
    device_side: list[Pin]  # left to the machine (the version tested here)
    left_out: dict[str, str]  # name: why the check does without it
    missing: list[str]  # needed, yet installed neither here nor on the machine
    warnings: list[str]  # requirements the machine's known versions do not meet


def marker_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of CPython `python` on x86-64 Linux."""
    full = "3.12.3" if python == DEVICE_PYTHON else f"{python}.0"
    return {"python_version": python, "python_full_version": full, "implementation_name": "cpython",
            "implementation_version": full, "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_release": "", "platform_version": ""}


Lookup = Callable[[str], "tuple[str, list[str]] | None"]


def installed(name: str) -> tuple[str, list[str]] | None:
    """(version, requirements) of a distribution installed here, or None."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def walk(roots: Iterable[str], lookup: Lookup, env: Mapping[str, str]) -> tuple[dict[str, Node], list[str]]:
    """The dependency tree under `roots`, with extras, as `lookup` describes each distribution;
    and the names `lookup` does not know."""
    tree: dict[str, Node] = {}
    missing: set[str] = set()
    todo = [(Requirement(root), "") for root in roots]
    while todo:
        requirement, parent = todo.pop()
        name = canonicalize_name(requirement.name)
        node = tree.get(name)
        if node is not None:
            node.required_by |= {parent} - {""}
            if set(requirement.extras) <= node.extras:
                continue
        found = lookup(name)
        if found is None:
            missing.add(name)
            continue
        node = tree.setdefault(name, Node(found[0]))
        node.extras |= set(requirement.extras)
        node.required_by |= {parent} - {""}
        selected = [child for child in map(Requirement, found[1])
                    if child.marker is None or any(child.marker.evaluate({**env, "extra": e}) for e in {"", *node.extras})]
        node.requires = selected
        todo += [(child, name) for child in selected]
    return tree, sorted(missing)


def device_packages(text: str) -> dict[str, str | None]:
    """The machine's packages from device_packages.txt: name (canonical) to version, where known."""
    packages: dict[str, str | None] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = version or None
    return packages


def plan(tree: Mapping[str, Node], device: Mapping[str, str | None], missing: Iterable[str] = ()) -> Plan:
    """Split the tree: carried, left to the machine, left out; and requirements of the carried
    distributions that a version known on the machine does not meet."""
    carried, device_side, left_out = [], [], {}
    for name in sorted(tree):
        if name in LEFT_OUT:
            left_out[name] = LEFT_OUT[name]
        elif name in device:
            device_side.append(Pin(name, tree[name].version))
        else:
            carried.append(Pin(name, tree[name].version))
    warnings = []
    for pin in carried:
        for requirement in tree[pin.name].requires:
            target = canonicalize_name(requirement.name)
            version = device.get(target)
            if version and not requirement.specifier.contains(version, prereleases=True):
                warnings.append(f"{pin.name} {pin.version} requires {requirement}; the machine has {target} {version}")
    not_found = [name for name in missing if name not in device and name not in LEFT_OUT]
    return Plan(carried, device_side, left_out, not_found, warnings)


def size_verdict(sizes: Mapping[str, int], limit_bytes: int, largest: int = 5) -> tuple[bool, str]:
    """Whether the wheelhouse fits, and a line saying so (naming the largest wheels when it does not)."""
    total = sum(sizes.values())
    line = f"{len(sizes)} wheels, {total / MiB:.1f} MiB (limit {limit_bytes / MiB:.0f} MiB)"
    if total <= limit_bytes:
        return True, line
    top = sorted(sizes.items(), key=lambda item: -item[1])[:largest]
    return False, f"{line}: too large; the largest: " + ", ".join(f"{name} {size / MiB:.1f} MiB" for name, size in top)


def platforms() -> list[str]:
    """manylinux x86-64 tags pip must name one by one: 2_28 (as torch's wheels) down to manylinux1."""
    return [f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def build_local(dest: Path) -> list[Path]:
    """Wheels of the router's own projects, built from copies so the worktree gets no build folders."""
    dest.mkdir(parents=True, exist_ok=True)
    junk = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".venv", "*.pyc")
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-src-") as scratch:
        sources = []
        for name, folder in LOCAL.items():
            source = Path(scratch) / name
            if folder == ".":
                source.mkdir()
                for part in ("pyproject.toml", "README.md"):
                    shutil.copy2(REPO / part, source / part)
                shutil.copytree(REPO / "router", source / "router", ignore=junk)
            else:
                shutil.copytree(REPO / folder, source, ignore=junk)
            sources.append(str(source))
        _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), *sources)
    return sorted(dest.glob("*.whl"))


def download(pins: Iterable[Pin], python: str, dest: Path) -> None:
    """CPython `python` manylinux x86-64 wheels of exactly these pins, without their dependencies."""
    tags = [arg for tag in platforms() for arg in ("--platform", tag)]
    _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
         *tags, "-d", str(dest), *(f"{pin.name}=={pin.version}" for pin in pins))


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        noise = "is ignored: it is neither a file nor a directory"
        lines = [line for line in done.stderr.splitlines() if noise not in line]
        raise RuntimeError(f"pip {args[0]} failed:\n" + "\n".join(lines[-20:]))


def _wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-", 1)[0])


def build(python: str, out: Path, limit_bytes: int, local_wheels: Path | None = None) -> tuple[bool, dict[str, object]]:
    """Build the wheelhouse into `out` (stale wheels removed); whether it fits, and its manifest."""
    device = device_packages((Path(__file__).with_name("device_packages.txt")).read_text(encoding="utf-8"))
    tree, missing = walk(ROOTS, installed, marker_environment(python))
    chosen = plan(tree, device, missing)
    if chosen.missing:
        raise RuntimeError("needed but installed neither here nor on the machine: " + ", ".join(chosen.missing))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-local-") as scratch:
        built = sorted(local_wheels.glob("*.whl")) if local_wheels else build_local(Path(scratch))
        for wheel in built:
            shutil.copy2(wheel, out / wheel.name)
    download([pin for pin in chosen.carried if pin.name not in LOCAL], python, out)
    wanted = {pin.name for pin in chosen.carried}
    for stale in out.glob("*.whl"):
        if _wheel_name(stale) not in wanted:
            stale.unlink()
    sizes = {path.name: path.stat().st_size for path in sorted(out.glob("*.whl"))}
    fits, verdict = size_verdict(sizes, limit_bytes)
    manifest = {
        "python": python, "verdict": verdict, "total_bytes": sum(sizes.values()), "wheels": sizes,
        "carried": {pin.name: pin.version for pin in chosen.carried},
        "device_side": {pin.name: {"tested_here": pin.version, "on_the_machine": device.get(pin.name)}
                        for pin in chosen.device_side},
        "left_out": chosen.left_out, "not_carried": NOT_CARRIED, "warnings": chosen.warnings,
    }
    (out / "wheelhouse.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return fits, manifest


def report(manifest: Mapping[str, object]) -> str:
    """What the build prints: the verdict, the largest wheels, what was left behind and why."""
    wheels: Mapping[str, int] = manifest["wheels"]  # type: ignore[assignment]
    lines = [f"wheelhouse for CPython {manifest['python']} (manylinux x86-64): {manifest['verdict']}"]
    lines += [f"  {size / MiB:6.2f} MiB  {name}" for name, size in sorted(wheels.items(), key=lambda i: -i[1])[:8]]
    left_out: Mapping[str, str] = manifest["left_out"]  # type: ignore[assignment]
    not_carried: Mapping[str, str] = manifest["not_carried"]  # type: ignore[assignment]
    lines += [f"  left out {name}: {why}" for name, why in {**left_out, **not_carried}.items()]
    device_side: Mapping[str, Mapping[str, str]] = manifest["device_side"]  # type: ignore[assignment]
    lines.append(f"  left to the machine: {len(device_side)} packages it already has")
    lines += [f"  warning: {line}" for line in manifest["warnings"]]  # type: ignore[attr-defined]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=DEVICE_PYTHON, help="the target CPython, as 3.12")
    parser.add_argument("--out", type=Path, default=REPO / ".whl")
    parser.add_argument("--limit-mib", type=float, default=DEFAULT_LIMIT_MIB)
    args = parser.parse_args(argv)
    try:
        fits, manifest = build(args.python, args.out.resolve(), int(args.limit_mib * MiB))
    except RuntimeError as exc:
        print(f"gpu-wheels: {exc}", file=sys.stderr)
        return 1
    print(report(manifest))
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
