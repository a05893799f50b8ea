#!/usr/bin/env bash
# GPU checks, in one go, for a machine with a CUDA GPU: the `gpu`-marked tests (NVML probe vs CUDA,
# CUDA memory profiling, a real CUDA out-of-memory split and retried). Writes a short results table.
#   bash scripts/gpu-check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

"$python" - <<'PY' | tee "$out/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("device", props.name, f"{props.total_memory / 2**30:.1f} GiB")
PY

PYTHONUNBUFFERED=1 timeout 480 "$python" -m pytest -m gpu -p no:cacheprovider -rA \
    --junitxml="$out/gpu-tests.xml" tests 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}

"$python" - "$out/gpu-tests.xml" <<'PY' | tee "$out/results.md"
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
print("| check | result | seconds |")
print("| --- | --- | --- |")
for case in root.iter("testcase"):
    outcome = "pass"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            outcome = tag
    print(f"| {case.get('name')} | {outcome} | {float(case.get('time', 0)):.2f} |")
PY
exit "$status"
