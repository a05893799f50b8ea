# The two commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
# The releases the tests run with. From PyPI on Linux x86-64 these are CUDA 13 builds (NVIDIA driver
# 580 or newer), which run on the CPU too; for a CUDA 12 driver, take PyTorch's own CUDA 12 build, e.g.
# `make serve TORCH_INDEX=https://download.pytorch.org/whl/cu126` (docs/gpu.md).
TORCH  := torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?=
CONFIG ?= config/fleet.yaml
DEMO   := model_store/yolov8n.pt model_store/resnet18.pt model_store/resnet18-b.pt

.PHONY: serve test test-tools check gpu-check bench protos clean

serve: $(VENV)/.serve $(DEMO)
	$(BIN)/model-router serve --config $(CONFIG)

test: $(VENV)/.test $(VENV)/.ray $(DEMO) test-tools
	$(BIN)/ruff check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Debian's prometheus (with promtool) and chromium for the operators' view tests; see the script.
test-tools:
	@bash scripts/test-tools.sh

check: $(VENV)/.serve
	$(BIN)/model-router check --config $(CONFIG)

# The acceptance test of a GPU host (docs/gpu.md), with this .venv: results in gpu-check-out/results.md.
# GPU_WHEELS= keeps gpu-check.sh off .whl/.
gpu-check: $(VENV)/.test $(VENV)/.ray
	GPU_WHEELS= PYTHON=$(BIN)/python bash scripts/gpu-check.sh

# A GPU host without index access (docs/gpu.md): the wheels its check needs and its image lacks
# (gpu_check/device_packages.txt), into .whl/ (fails above 60 MiB); and the whole check rehearsed on
# this machine, in a bare environment holding only that image's packages.
.PHONY: gpu-wheels gpu-rehearsal wheels
gpu-wheels: $(VENV)/.test
	$(BIN)/python -m gpu_check.wheelhouse --out .whl

gpu-rehearsal: $(VENV)/.test
	$(BIN)/python -m gpu_check.rehearsal --wheelhouse .whl

# The router and its bundled plugins as wheels in dist/ (install with
# `pip install --find-links dist vision-model-router vision-model-router-yolo ...`).
wheels: $(BIN)/python
	$(PIP) wheel --quiet --no-deps -w dist . plugins/yolo plugins/resnet plugins/engines plugins/onnx plugins/tensorrt

# Every contender on every workload and scenario; see benchmarks/run.py. The last full run
# (docs/performance.md, 2026-12-01) took 1,686 s.
bench: $(VENV)/.test $(VENV)/.ray $(VENV)/.bench $(DEMO) test-tools
	$(BIN)/python -m benchmarks.run

# The gRPC front's generated module, from router/grpc/protos/grpc_service.proto (grpcio-tools, a
# test dependency); tests/test_grpc_protos.py fails when the committed module is stale.
protos: $(VENV)/.test
	$(BIN)/python scripts/generate_protos.py

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(PIP) install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	touch $@

$(VENV)/.serve: $(VENV)/.torch pyproject.toml plugins/yolo/pyproject.toml plugins/resnet/pyproject.toml \
		plugins/engines/pyproject.toml plugins/onnx/pyproject.toml plugins/tensorrt/pyproject.toml
	$(PIP) install --quiet -e . -e plugins/yolo -e plugins/resnet -e plugins/engines -e plugins/onnx -e plugins/tensorrt
	touch $@

# The test kit's plugins and the two example plugins of docs/plugins.md, each its own distribution;
# the tracing extra, whose end-to-end test exports to a receiver in the test.
$(VENV)/.test: $(VENV)/.serve tests/plugin_dist/pyproject.toml examples/plugin-mean-colour/pyproject.toml \
		examples/plugin-tiny-cnn/pyproject.toml
	$(PIP) install --quiet -e '.[test,tracing]' -e tests/plugin_dist -e examples/plugin-mean-colour -e examples/plugin-tiny-cnn
	touch $@

# Ray Serve for the cluster tests (the `ray` extra, an 80 MB wheel). Where it cannot be installed
# the cluster tests skip with the reason; under CI=true that is an error.
$(VENV)/.ray: $(VENV)/.test
	$(PIP) install --quiet -e '.[ray]' || { if [ "$$CI" = "true" ]; then exit 1; fi; \
		echo "model-router: Ray Serve could not be installed: the cluster tests will skip"; }
	touch $@

# Bench-only dependencies: the LitServe contender (it brings FastAPI, which the single-queue
# contender uses) and matplotlib for the plot.
$(VENV)/.bench: $(VENV)/.test
	$(PIP) install --quiet litserve==0.2.19 fastapi python-multipart matplotlib
	touch $@

$(DEMO) &: | $(VENV)/.serve
	$(BIN)/model-router store init-demo --store model_store

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
