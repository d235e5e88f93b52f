"""The chart's workers follow their GPUs: resources and /dev/shm per GPU, the model sharded
over every GPU of the pod, and what one pod cannot be refused at render (helm template)."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.unit.test_helm_chart import CHART, Release, render

GPU_MODEL = {"name": "Llama-3.1-8B-Instruct"}


def worker(gpus: int, **values: Any) -> Release:
    return Release(render({"worker": {"gpu": {"count": gpus}, "model": GPU_MODEL, **values}}))


def shm(release: Release) -> str:
    volumes = release.deployment("worker")["spec"]["template"]["spec"]["volumes"]
    return str(next(v for v in volumes if v["name"] == "dshm")["emptyDir"]["sizeLimit"])


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_requests_limits_and_shm_scale_with_the_gpus(gpus: int) -> None:
    release = worker(gpus)
    resources = release.container("worker")["resources"]
    assert resources["requests"]["cpu"] == str(4 * gpus)
    assert resources["requests"]["memory"] == f"{48 * gpus}Gi"
    assert resources["limits"]["memory"] == f"{64 * gpus}Gi"
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
    assert shm(release) == f"{8 * gpus}Gi"
    # Tensor parallel over every GPU (one GPU: no sharding, vLLM's default).
    env = release.env("worker")
    assert env.get("TOKENMESH_WORKER_TENSOR_PARALLEL_SIZE") == (str(gpus) if gpus > 1 else None)


def test_what_resources_set_wins_and_the_rest_still_follows_the_gpus() -> None:
    release = worker(
        2,
        resources={"requests": {"cpu": "6"}},
        gpu={"count": 2, "perGpu": {"cpu": 4, "memoryGi": 10, "memoryLimitGi": 20, "shmGi": 3}},
        shmSize="5Gi",
    )
    resources = release.container("worker")["resources"]
    assert resources["requests"]["cpu"] == "6"
    assert resources["requests"]["memory"] == "20Gi" and resources["limits"]["memory"] == "40Gi"
    assert shm(release) == "5Gi"


def test_each_front_end_beyond_the_first_adds_a_core() -> None:
    one = worker(2)
    assert "TOKENMESH_WORKER_FRONTENDS" not in one.env("worker")
    release = worker(2, frontends=3)
    assert release.env("worker")["TOKENMESH_WORKER_FRONTENDS"] == "3"
    assert release.container("worker")["resources"]["requests"]["cpu"] == str(4 * 2 + 2)
    with pytest.raises(helm_python.HelmError, match="frontends"):
        worker(1, frontends=0)


def test_pipeline_stages_split_the_gpus_and_tensor_parallel_takes_the_rest() -> None:
    release = worker(8, engineArgs={"pipeline-parallel-size": 2})
    env = release.env("worker")
    assert env["TOKENMESH_WORKER_TENSOR_PARALLEL_SIZE"] == "4"
    assert '"pipeline-parallel-size":2' in env["TOKENMESH_WORKER_ENGINE_ARGS"]


@pytest.mark.parametrize(
    ("gpus", "values", "message"),
    [
        (16, {}, r"worker.gpu.count \(16\) is more GPUs than one node offers"),
        (8, {"engineArgs": {"pipeline_parallel_size": 3}}, r"must divide worker.gpu.count \(8\)"),
        (4, {"engineArgs": {"tensor_parallel_size": 2}}, r"tensor_parallel_size \(2\) disagrees"),
        (2, {"engineArgs": {"data_parallel_size": 2}}, "scale with worker.replicas"),
        (1, {"engineArgs": {"nnodes": 2}}, "one engine in one pod on one node"),
        (1, {"shmSize": "64Gi"}, r"worker.shmSize \(64Gi\) must be below"),
    ],
)
def test_what_one_pod_cannot_serve_fails_at_render_with_the_reason(
    gpus: int, values: dict[str, Any], message: str
) -> None:
    given = {"worker": {"gpu": {"count": gpus}, "model": GPU_MODEL, **values}}
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(given)  # refused by the templates, not the schema
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(given)
