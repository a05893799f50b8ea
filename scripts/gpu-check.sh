#!/usr/bin/env bash
# The GPU check, in one go, on a machine with a CUDA GPU (docs/gpu.md):
#   bash scripts/gpu-check.sh [OUT_DIR]
# With a wheelhouse (`make gpu-wheels` builds .whl/; GPU_WHEELS names another, GPU_WHEELS= none) it makes a
# virtual environment that sees the site packages of `python3` (or $PYTHON) and installs the
# wheelhouse into it with --no-index: nothing is fetched. Without one it runs with .venv/bin/python
# (or $PYTHON, or python3) as it is. Then gpu_check.run runs the parts, each under a time limit and
# all within 8 minutes, a failing part never stopping the others: the environment (GPU, driver,
# CUDA, versions, requirements, imports), the `gpu`-marked tests, the 5x surge under an NVML budget,
# ResNet-50 and YOLOv8n throughput, the engine exports and the ledger against NVML, the two-replica
# cluster. It writes OUT_DIR/results.md (one row per check), OUT_DIR/device.txt, OUT_DIR/logs.tar.gz
# and exits 1 when any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
wheels="${GPU_WHEELS-.whl}"  # set but empty: no wheelhouse
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$work/logs"

if [ -n "$wheels" ] && [ -f "$wheels/wheelhouse.json" ]; then
    base="${PYTHON:-python3}"
    venv="$work/venv"
    started=$SECONDS
    # --without-pip, and the base's site packages through a .pth file rather than
    # --system-site-packages: where python3 is itself a venv (as in some GPU images), its packages
    # are its venv's, which --system-site-packages would not show.
    {
        "$base" -m venv --without-pip "$venv" &&
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') &&
        "$base" -c 'import os, site
for path in site.getsitepackages():
    if os.path.isdir(path):
        print(f"import site; site.addsitedir({path!r})")' > "$site/base-site-packages.pth" &&
        "$venv/bin/python" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check -q \
            "$wheels"/*.whl
    } > "$work/logs/install.log" 2>&1
    status=$?
    count=$(ls "$wheels"/*.whl | wc -l)
    if [ "$status" -eq 0 ]; then
        row="| install the wheelhouse | pass | $count wheels from $wheels with --no-index in $((SECONDS - started)) s |"
    else
        row="| install the wheelhouse | FAIL | exit status $status; see logs/install.log: $(tail -n 1 "$work/logs/install.log") |"
    fi
    printf '| check | result | detail |\n| --- | --- | --- |\n%s\n' "$row" > "$work/setup.md"
    python="$venv/bin/python"
    [ -x "$python" ] || python="$base"
else
    python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
fi

export YOLO_OFFLINE=1 YOLO_AUTOINSTALL=false PYTHONUNBUFFERED=1
"$python" -m gpu_check.run "$out" --work "$work" ${wheels:+--wheelhouse "$wheels"}
status=$?
# The logs are in OUT_DIR/logs.tar.gz; GPU_CHECK_KEEP=1 keeps the rest (venv, models, exports) too.
[ "${GPU_CHECK_KEEP:-0}" = 1 ] && echo "gpu-check: work folder kept: $work" || rm -rf "$work"
exit "$status"
