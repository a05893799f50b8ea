"""The GPU check rehearsed on a machine without a GPU: proof that the offline check on a GPU host without
index access reaches its results table.

    python -m gpu_check.rehearsal [--work .gpu-rehearsal] [--wheelhouse .whl]

1. Builds the wheelhouse for the target host (CPython 3.12, as `make gpu-wheels`) and prints its size.
2. Installs it, --no-index, into a bare CPython 3.12 folder and loads every compiled extension it
   carries: the wheels fit the machine's interpreter (skipped where this machine has no 3.12).
3. Emulates the machine: a virtual environment holding only distributions on its list
   (device_packages.txt), hard links of those installed in this environment, with
   opencv-python-headless fetched in place of opencv-python. This environment's Python runs it,
   since the machine's torch (2.11, CUDA 13) exists here only for it.
4. Builds the same pins as wheels for that Python and runs `bash scripts/gpu-check.sh` with it:
   the check must reach its results table, its set-up and environment rows passing and every GPU
   row skipped for want of CUDA, with nothing failing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from packaging.utils import canonicalize_name

from gpu_check.results import Row
from gpu_check.wheelhouse import DEFAULT_LIMIT_MIB, DEVICE_PYTHON, PROVIDED_BY, MiB, build, build_local, device_packages, report

__all__ = ["device_distributions", "verdict"]

REPO = Path(__file__).resolve().parents[1]
SETUP_PARTS = ("set-up", "environment")
PIP_QUIET = ("-q", "--disable-pip-version-check", "--root-user-action=ignore")
CHECK_LIMIT_S = 900
COMPARED = ("torch", "torchvision", "onnxruntime", "onnx", "numpy")


def differences(device: Mapping[str, str | None], linked: int) -> str:
    """How the emulated host differs from the image listed in device_packages.txt."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    versions = []
    for name in COMPARED:
        try:
            mine = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            mine = "none"
        versions.append(f"{name} {mine} here, {device.get(name) or '?'} there")
    return (f"Python {here} here, 3.12.3 there (the same pins, built for {here}); " + "; ".join(versions)
            + f"; {linked} of the machine's {len(device)} listed distributions, those installed here; no GPU")


def verdict(rows: Sequence[Row]) -> list[str]:
    """What keeps the rehearsal from passing: a failing row, a set-up or environment row that is not
    passing (info and warn excepted), a GPU part's row not skipped for want of CUDA."""
    problems = []
    for row in rows:
        where = f"{row.part} / {row.check}: {row.result}"
        if row.result == "FAIL":
            problems.append(f"{where}: {row.detail}")
        elif row.part not in SETUP_PARTS and not (row.result == "skipped" and "CUDA" in row.detail):
            problems.append(f"{where} where a skip for want of CUDA was due: {row.detail}")
    parts = {row.part for row in rows}
    problems += [f"no {part} rows" for part in ("environment", "gpu tests") if part not in parts]
    return problems


def results_rows(text: str) -> list[Row]:
    """The rows of results.md (part, check, result, detail)."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4 and cells[2] not in ("result", "---"):
            rows.append(Row(cells[0], cells[1], cells[2], " | ".join(cells[3:])))
    return rows


def device_distributions(available: Iterable[str], device: Iterable[str]) -> tuple[list[str], list[str]]:
    """(installed here and on the machine's list: linked), (on the list, provided for, missing here: fetched)."""
    here = {canonicalize_name(name) for name in available}
    listed = {canonicalize_name(name) for name in device}
    providers = {canonicalize_name(p) for p in PROVIDED_BY.values()} & listed
    return sorted(here & listed), sorted(providers - here)


def _run(command: Sequence[str]) -> None:
    """A pip command, quiet unless it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-2000:]}")


def link_distribution(name: str, site: Path) -> int:
    """Hard links (copies across file systems) of a distribution's files in `site`; how many."""
    dist = importlib.metadata.distribution(name)
    root = Path(str(dist.locate_file("")))
    count = 0
    for file in dist.files or []:
        if file.parts and file.parts[0] == "..":
            continue  # scripts outside site-packages
        source, target = root / file, site / file
        if not source.is_file() or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        count += 1
    return count


def emulate_device(folder: Path, device: dict[str, str | None]) -> tuple[Path, int]:
    """A venv of this Python holding only the machine's distributions; its python, and how many."""
    shutil.rmtree(folder, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    names = [dist.metadata["Name"] for dist in importlib.metadata.distributions()]
    linked, fetched = device_distributions(names, device)
    files = sum(link_distribution(name, site) for name in linked)
    print(f"rehearsal: the machine emulated: {len(linked)} of its distributions linked from here ({files} files)")
    for name in fetched:  # e.g. opencv-python-headless, the machine's cv2, where this environment has opencv-python
        pinned = _provided_version(name)
        print(f"rehearsal: fetching {pinned} for it")
        _run([str(python), "-m", "pip", "install", *PIP_QUIET, "--no-deps", pinned])
    return python, len(linked) + len(fetched)


def _provided_version(provider: str) -> str:
    """`provider==V` where this environment has the distribution it stands in for at V, else `provider`."""
    for name, by in PROVIDED_BY.items():
        if canonicalize_name(by) == provider:
            try:
                return f"{provider}=={importlib.metadata.version(name)}"
            except importlib.metadata.PackageNotFoundError:
                break
    return provider


def python312() -> str | None:
    """A CPython 3.12 that runs here: pyenv's, or python3.12 on the PATH (a pyenv shim may not run)."""
    candidates = [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"), reverse=True)]
    candidates += [found] if (found := shutil.which("python3.12")) else []
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"],
                               capture_output=True, check=False)
        if probe.returncode == 0:
            return candidate
    return None


LOAD_EXTENSIONS = r"""
import importlib, pathlib, sys
root = pathlib.Path(sys.argv[1]); sys.path[:0] = sys.argv[1:]; bad = []
for path in sorted(root.rglob("*.so")):
    if any(part.endswith((".libs", ".dist-info")) for part in path.relative_to(root).parts):
        continue
    name = ".".join(path.relative_to(root).with_name(path.name.split(".")[0]).parts)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        print(f"{name}: needs {exc.name} (the machine's)")
    except Exception as exc:
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
    else:
        print(f"{name}: loaded")
print("\n".join(bad)); sys.exit(1 if bad else 0)
"""


def check_on_312(wheelhouse: Path, work: Path, device: dict[str, str | None]) -> str:
    """Install the wheelhouse into a bare CPython 3.12 folder, --no-index, and import every compiled
    extension it carries, beside the machine's packages they need (fetched for 3.12, at the versions
    tested here)."""
    python = python312()
    if python is None:
        return "skipped: no CPython 3.12 on this machine"
    target, machine = work / "cp312-target", work / "cp312-machine"
    for folder in (target, machine):
        shutil.rmtree(folder, ignore_errors=True)
    pip = [python, "-m", "pip", "install", *PIP_QUIET, "--no-deps", "--no-compile", "--target"]
    _run([*pip, str(target), "--no-index", *map(str, sorted(wheelhouse.glob("*.whl")))])
    modules = importlib.metadata.packages_distributions()
    for _ in range(5):
        loaded = subprocess.run([python, "-c", LOAD_EXTENSIONS, str(target), str(machine)], capture_output=True,
                                text=True, check=False)
        lines = loaded.stdout.strip().splitlines()
        if loaded.returncode != 0:
            raise RuntimeError("compiled extensions failed to load on CPython 3.12:\n" + loaded.stdout + loaded.stderr)
        needed = {line.split(" needs ", 1)[1].split(" ", 1)[0] for line in lines if " needs " in line}
        if not needed:
            break
        pins = machine_pins(needed, modules, device)
        _run([*pip, str(machine), *pins])
    version = subprocess.run([python, "-V"], capture_output=True, text=True, check=True).stdout.strip()
    return (f"{version}: every wheel installed (--no-index); {sum(': loaded' in x for x in lines)} compiled extensions "
            f"imported, with {len(list(machine.glob('*.dist-info')))} of the machine's packages beside them")


def machine_pins(modules: set[str], owners: Mapping[str, list[str]], device: Mapping[str, str | None]) -> list[str]:
    """`name==version` (as installed here) of the machine's distributions that provide `modules`."""
    pins = []
    for module in sorted(modules):
        names = [canonicalize_name(n) for n in owners.get(module, [])]
        listed = [n for n in names if n in device]
        if not listed:
            raise RuntimeError(f"a carried extension needs {module!r}, which neither the wheelhouse nor the machine has")
        pins.append(f"{listed[0]}=={importlib.metadata.version(listed[0])}")
    return pins


def rehearse(work: Path, wheelhouse: Path) -> int:
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    limit = int(DEFAULT_LIMIT_MIB * MiB)
    local = work / "local-wheels"
    shutil.rmtree(local, ignore_errors=True)
    build_local(local)
    fits, manifest = build(DEVICE_PYTHON, wheelhouse, limit, local)
    print(report(manifest))
    if not fits:
        return 1
    device = device_packages((Path(__file__).with_name("device_packages.txt")).read_text(encoding="utf-8"))
    print(f"rehearsal: the wheelhouse on CPython 3.12: {check_on_312(wheelhouse, work, device)}")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    emulated = work / f"wheels-{here}"
    build(here, emulated, limit, local)
    python, linked = emulate_device(work / "device", device)
    out, scratch = work / "out", work / "tmp"
    shutil.rmtree(out, ignore_errors=True)
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHON": str(python), "GPU_WHEELS": str(emulated), "TMPDIR": str(scratch)}
    env.pop("VIRTUAL_ENV", None)
    print(f"rehearsal: bash scripts/gpu-check.sh {out} (PYTHON={python}, GPU_WHEELS={emulated})", flush=True)
    done = subprocess.run(["bash", "scripts/gpu-check.sh", str(out)], cwd=REPO, env=env, timeout=CHECK_LIMIT_S,
                          check=False)
    results = out / "results.md"
    problems = verdict(results_rows(results.read_text(encoding="utf-8"))) if results.is_file() else ["no results.md"]
    print(f"rehearsal: gpu-check.sh exited {done.returncode}; {time.monotonic() - started:.0f} s in all")
    for problem in problems:
        print(f"rehearsal: NOT AS DUE: {problem}")
    print(f"rehearsal: differs from the listed image: {differences(device, linked)}")
    print("rehearsal: passed" if not problems else "rehearsal: failed")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / ".gpu-rehearsal")
    parser.add_argument("--wheelhouse", type=Path, default=REPO / ".whl")
    args = parser.parse_args(argv)
    return rehearse(args.work.resolve(), args.wheelhouse.resolve())


if __name__ == "__main__":
    raise SystemExit(main())
