#!/usr/bin/env bash
# GPU checks, in one go, for a machine with a CUDA GPU (about 5 minutes, at most 9):
#   1. the `gpu`-marked tests: NVML probe vs CUDA, CUDA memory profiling, a real CUDA out-of-memory
#      split and retried, residency on cuda:0 (on-demand models evicted by NVML, memory back), onnxruntime's CUDA provider with IO binding, TensorRT engines built and
#      served against eager PyTorch (each skips, with its reason, where its library is missing);
#      JPEG decode on the device (gpu_decode, nvJPEG): ResNet against torchvision's reference and
#      YOLO against ultralytics' predict on the parity photos (tests/plugins/test_device_decode.py;
#      not yet run on a GPU);
#   2. scripts/gpu_engine_check.py: both demo models exported to ONNX, and to TensorRT where it is
#      installed (ResNet in fp16), a short load of every engine through a real router beside its
#      eager original with their answers compared at batch 1 and 8, and the scheduler's ledger
#      compared with NVML's readings under load;
#   3. scripts/gpu_cluster_check.py: the Ray cluster with two device replicas on one GPU
#      (num_gpus: 0.5 each), NVML admission in each, round robin through the cluster front.
# Writes OUT_DIR/results.md, a short table of every check, and the logs beside it.
#   bash scripts/gpu-check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out/engines"
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

"$python" - <<'PY' | tee "$out/device.txt"
import importlib.util
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("device", props.name, f"{props.total_memory / 2**30:.1f} GiB")
for name in ("onnxruntime", "tensorrt"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(name, "not installed")
        continue
    module = __import__(name)
    extra = module.get_available_providers() if name == "onnxruntime" else ""
    print(name, module.__version__, extra)
PY

PYTHONUNBUFFERED=1 timeout 240 "$python" -m pytest -m gpu -p no:cacheprovider -rA \
    --junitxml="$out/gpu-tests.xml" tests 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}

PYTHONUNBUFFERED=1 timeout 300 "$python" scripts/gpu_engine_check.py "$out/engines" --device auto \
    2>&1 | tee "$out/engines.log"
engines_status=${PIPESTATUS[0]}
[ "$engines_status" -eq 124 ] && echo "| engine checks | FAIL | timed out after 300 s; see engines.log |" >> "$out/engines/engines.md"
"$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" && PYTHONUNBUFFERED=1 timeout 240 "$python" -m benchmarks.gpu --out "$out/bench" 2>&1 | tee "$out/bench.log"  # GPU benchmark: models sharing the card, ledger vs NVML

"$python" -c "import sys, torch, ray; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
    && PYTHONUNBUFFERED=1 timeout 300 "$python" scripts/gpu_cluster_check.py "$out" 2>&1 | tee "$out/cluster.log"

"$python" - "$out/gpu-tests.xml" "$out/engines/engines.md" <<'PY' | tee "$out/results.md"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
print("| check | result | detail |")
print("| --- | --- | --- |")
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"| gpu-marked tests | FAIL | no junit report: {exc} |")
else:
    for case in root.iter("testcase"):
        outcome, detail = "pass", f"{float(case.get('time', 0)):.2f} s"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, detail = tag, (found.get("message") or "")[:160].replace("|", "/").replace("\n", " ")
        print(f"| test {case.get('name')} | {outcome} | {detail} |")
engines = Path(sys.argv[2])
rows = engines.read_text().splitlines()[2:] if engines.is_file() else ["| engine checks | FAIL | no engines.md |"]
cluster = engines.parent.parent / "cluster.md"
rows += cluster.read_text().splitlines()[2:] if cluster.is_file() else ["| cluster check | not run | no GPU or no Ray |"]
print("\n".join(rows))
PY
[ "$status" -ne 0 ] && exit "$status"
exit "$engines_status"
