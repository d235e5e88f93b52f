"""The chart's worker pools (worker.pools, decision 0035), rendered offline like
tests/unit/test_helm_chart.py (whose helpers this reuses): a GPU pool and a CPU pool each get
their workers' objects, valid for Kubernetes, serving their own model with their overrides and
the workers' values for the rest; Envoy's config has their clusters and routes exactly as
meshconfig renders them for the same pools; discovery, the gateways and the NetworkPolicies
name them; and pools that can never work are refused at render time, naming the pool."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.support import ROOT
from tests.unit.test_helm_chart import (
    CHART,
    DEFAULTS,
    KUBE_VERSION,
    LONG_RELEASE,
    OPERATOR_APIS,
    PREFIX,
    Release,
    assert_valid,
    pod_labels,
    port_number,
    render,
    selects,
)
from tests.unit.test_meshconfig import envoy_validate
from tokenmesh.common.pools import POOL_HEADER
from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.meshconfig.__main__ import KUBERNETES_HEADER, render_yaml
from tokenmesh.meshconfig.config import kubernetes_profile
from tokenmesh.meshconfig.policy import CHART_HEALTH_CHECKS, CHART_WORKER_BALANCING
from tokenmesh.worker.config import WorkerSettings

# A GPU pool (two GPUs a worker on L4 nodes, a model with an adapter) and a CPU pool (the CPU
# image, no GPU, none of the GPU nodes' tolerations).
GPU_POOL = {
    "name": "code",
    "replicas": 3,
    "model": {
        "name": "Qwen/Qwen2.5-Coder-7B-Instruct",
        "servedName": "coder",
        "loraModules": {"sql": "adapters/sql"},
    },
    "gpu": {"count": 2},
    "engineArgs": {"max_model_len": 16384},
    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
    "podAnnotations": {"team": "code"},
}
CPU_POOL = {
    "name": "cpu",
    "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "servedName": "small"},
    "image": {"variant": "cpu"},
    "gpu": {"count": 0},
    "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "12Gi"}},
    "shmSize": "2Gi",
    "engineArgs": {},
    "nodeSelector": {},
    "tolerations": [],
}
POOLS = [GPU_POOL, CPU_POOL]
# The workers' own values the pools override, so that falling back is visible.
WORKER = {
    "model": {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "servedName": "llama",
        "loraModules": {"chat": "adapters/chat"},
    },
    "engineArgs": {"kv_cache_dtype": "fp8"},
    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    "env": {"TOKENMESH_WORKER_MAX_MODEL_LEN": "8192"},
}
VALUE_SETS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "pools": ({"worker": {**WORKER, "pools": POOLS}}, ()),
    # Every kind of object a pool can have: autoscaling and monitoring.
    "pools-hpa-monitoring": (
        {
            "worker": {**WORKER, "pools": POOLS, "autoscaling": {"enabled": True}},
            "monitoring": {"serviceMonitor": {"enabled": True}},
        },
        OPERATOR_APIS,
    ),
    "pools-keda-mtls": (
        {
            "worker": {
                **WORKER,
                "pools": POOLS,
                "keda": {"enabled": True, "ttft": {"enabled": True}},
            },
            "monitoring": {"serviceMonitor": {"enabled": True}},
            "mtls": {"enabled": True, "existingSecret": "tokenmesh-mtls"},
        },
        OPERATOR_APIS,
    ),
}
RELAY = {"envoy": {"streamRelay": {"enabled": True}, "image": {"repository": "ghcr.io/x/envoy"}}}


@pytest.fixture(scope="module")
def releases() -> dict[str, Release]:
    return {name: Release(render(values, apis)) for name, (values, apis) in VALUE_SETS.items()}


def pool_deployment(release: Release, pool: str) -> dict[str, Any]:
    return release.deployment(f"worker-{pool}")


def pool_env(release: Release, pool: str) -> dict[str, Any]:
    (container,) = pool_deployment(release, pool)["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# ---- the pools' objects


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pool_object_is_valid_for_the_kubernetes_version(
    value_set: str, releases: dict[str, Release]
) -> None:
    assert_valid(releases[value_set].objects)
    report = helm_python.lint(
        CHART, VALUE_SETS[value_set][0], strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["messages"] == [] and report["errors"] == [], report


def test_each_pool_has_the_workers_objects_under_its_own_name(
    releases: dict[str, Release],
) -> None:
    release = releases["pools-hpa-monitoring"]
    keda = releases["pools-keda-mtls"]
    for pool in ("code", "cpu"):
        name = f"{PREFIX}-worker-{pool}"
        labels = pod_labels(release, f"worker-{pool}")
        assert labels["tokenmesh.io/pool"] == pool
        assert labels["app.kubernetes.io/component"] == f"worker-{pool}"
        service = release.get("Service", f"{name}-headless")
        assert service["spec"]["clusterIP"] == "None"
        for selector in (
            service["spec"]["selector"],
            release.get("PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"],
            release.get("NetworkPolicy", name)["spec"]["podSelector"]["matchLabels"],
            release.get("NetworkPolicy", f"{name}-egress")["spec"]["podSelector"]["matchLabels"],
            release.get("ServiceMonitor", name)["spec"]["selector"]["matchLabels"],
        ):
            # Its own pods only: neither the default pool's nor the other pool's.
            assert selects(selector, labels)
            assert not selects(selector, pod_labels(release, "worker"))
            other = "cpu" if pool == "code" else "code"
            assert not selects(selector, pod_labels(release, f"worker-{other}"))
        # The default pool's selectors do not take the pool's pods either.
        assert not selects(release.deployment("worker")["spec"]["selector"]["matchLabels"], labels)
        hpa = release.get("HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        scaled = keda.get("ScaledObject", name)
        assert scaled["spec"]["scaleTargetRef"]["name"] == name
        for trigger in scaled["spec"]["triggers"]:
            assert f'job="{name}-headless"' in trigger["metadata"]["query"]
        # Its workers are workers on the dashboards (service="worker"), of their pool.
        (endpoint,) = release.get("ServiceMonitor", name)["spec"]["endpoints"]
        relabel = {r["targetLabel"]: r.get("replacement") for r in endpoint["relabelings"]}
        assert relabel["service"] == "worker" and relabel["pool"] == pool
        assert endpoint["metricRelabelings"]
        # The workers' ServiceAccount; the workers' mTLS certificate (it names `worker`).
        spec = keda.deployment(f"worker-{pool}")["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == f"{PREFIX}-worker"
        mtls = next(v for v in spec["volumes"] if v["name"] == "mtls")
        assert mtls["secret"]["secretName"] == "tokenmesh-mtls"
        assert {i["key"] for i in mtls["secret"]["items"]} == {"worker.crt", "worker.key", "ca.crt"}
    # One ServiceAccount for every pool's workers.
    assert not any("worker-" in a["metadata"]["name"] for a in release.all("ServiceAccount"))


def test_each_pool_serves_its_model_with_its_overrides(releases: dict[str, Release]) -> None:
    release = releases["pools"]
    code, cpu = pool_env(release, "code"), pool_env(release, "cpu")
    assert code["TOKENMESH_WORKER_MODEL"] == "Qwen/Qwen2.5-Coder-7B-Instruct"
    assert code["TOKENMESH_WORKER_SERVED_MODEL_NAME"] == "coder"
    assert json.loads(code["TOKENMESH_WORKER_LORA_MODULES"]) == {"sql": "adapters/sql"}
    assert json.loads(code["TOKENMESH_WORKER_ENGINE_ARGS"]) == {"max_model_len": 16384}
    assert code["TOKENMESH_WORKER_TENSOR_PARALLEL_SIZE"] == "2"
    assert cpu["TOKENMESH_WORKER_MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cpu["TOKENMESH_WORKER_SERVED_MODEL_NAME"] == "small"
    # The default pool's adapters are its own, never a pool's; engineArgs given replace the
    # workers' whole (none: none).
    assert "TOKENMESH_WORKER_LORA_MODULES" not in cpu
    assert "TOKENMESH_WORKER_ENGINE_ARGS" not in cpu
    default = release.env("worker")
    assert default["TOKENMESH_WORKER_MODEL"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert json.loads(default["TOKENMESH_WORKER_LORA_MODULES"]) == {"chat": "adapters/chat"}
    # What a pool leaves out is the workers': env, shutdown, handover, probes, ports.
    for env in (code, cpu):
        assert env["TOKENMESH_WORKER_MAX_MODEL_LEN"] == "8192"
        for name in ("GRACE_SECONDS", "HANDOVER_ADDRESS", "ENGINE_STALL_SECONDS", "PORT"):
            assert env[f"TOKENMESH_WORKER_{name}"] == default[f"TOKENMESH_WORKER_{name}"]
    worker = release.container("worker")
    code_deployment, cpu_deployment = (pool_deployment(release, p) for p in ("code", "cpu"))
    assert code_deployment["spec"]["replicas"] == 3 and cpu_deployment["spec"]["replicas"] == 1
    gpu_spec = code_deployment["spec"]["template"]["spec"]
    cpu_spec = cpu_deployment["spec"]["template"]["spec"]
    (code_container,) = gpu_spec["containers"]
    (cpu_container,) = cpu_spec["containers"]
    for container in (code_container, cpu_container):
        for key in ("startupProbe", "readinessProbe", "livenessProbe", "ports", "lifecycle"):
            assert container[key] == worker[key], key
    # The GPU pool: two GPUs, resources following them, on its own GPU type.
    resources = code_container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 2
    assert resources["requests"]["cpu"] == "8" and resources["limits"]["memory"] == "128Gi"
    assert gpu_spec["nodeSelector"] == GPU_POOL["nodeSelector"]
    assert (
        gpu_spec["tolerations"]
        == release.deployment("worker")["spec"]["template"]["spec"]["tolerations"]
    )
    assert code_deployment["spec"]["template"]["metadata"]["annotations"] == {"team": "code"}
    # The CPU pool: the CPU image, no GPU, no GPU node selector or toleration, its own shm.
    assert cpu_container["image"].endswith("-cpu")
    assert cpu_container["image"].rsplit(":", 1)[0] == worker["image"].rsplit(":", 1)[0]
    assert not any("gpu" in key for key in cpu_container["resources"]["limits"])
    assert cpu_container["resources"]["requests"]["memory"] == "8Gi"
    assert cpu_container["resources"]["limits"]["memory"] == "12Gi"
    assert "nodeSelector" not in cpu_spec and "tolerations" not in cpu_spec
    shm = next(v for v in cpu_spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == "2Gi"


def test_pools_leave_the_default_workers_as_they_were(releases: dict[str, Release]) -> None:
    without = Release(render({"worker": WORKER}))
    with_pools = releases["pools"]
    for kind, name in (
        ("Deployment", f"{PREFIX}-worker"),
        ("Service", f"{PREFIX}-worker-headless"),
        ("PodDisruptionBudget", f"{PREFIX}-worker"),
        ("NetworkPolicy", f"{PREFIX}-worker"),
    ):
        assert with_pools.get(kind, name) == without.get(kind, name), kind
    assert "TOKENMESH_GATEWAY_WORKER_POOLS" not in without.env("gateway")
    assert "pool" not in without.manifests["tokenmesh/templates/NOTES.txt"]


def test_the_notes_name_each_pool_and_its_model(releases: dict[str, Release]) -> None:
    notes = releases["pools"].manifests["tokenmesh/templates/NOTES.txt"]
    assert "Worker pools beside the workers' llama" in notes
    assert f"  code: coder, Deployment {PREFIX}-worker-code\n" in notes
    assert f"  cpu: small, Deployment {PREFIX}-worker-cpu\n" in notes


# ---- Envoy, discovery, gateways


def meshconfig_chart(tmp_path: Path, pools: tuple[str, ...]) -> Path:
    """The chart with its Envoy files rendered by meshconfig for the pools (as
    scripts/gen_chart_files.py renders them for none)."""
    chart = tmp_path / "tokenmesh"
    shutil.copytree(CHART, chart)
    for relay in (False, True):
        for tls in (False, True):
            for mtls in (False, True):
                options = [
                    name for name, on in (("relay", relay), ("tls", tls), ("mtls", mtls)) if on
                ]
                profile = "-".join(["kubernetes", *options])
                settings = kubernetes_profile(tls=tls, mtls=mtls, relay=relay).model_copy(
                    update={"worker_pools": pools}
                )
                text = render_yaml(
                    settings,
                    KUBERNETES_HEADER.replace("kubernetes", profile, 1),
                    CHART_HEALTH_CHECKS,
                    CHART_WORKER_BALANCING,
                )
                (
                    chart / "files" / (profile.replace("kubernetes", "envoy", 1) + ".yaml")
                ).write_text(text)
    return chart


@pytest.mark.parametrize(
    "values",
    [
        {},
        RELAY,
        {**RELAY, "mtls": {"enabled": True, "existingSecret": "tokenmesh-mtls"}},
        {"envoy": {"workerRouting": {"policy": "picker"}}},
    ],
    ids=["direct", "relay", "relay-mtls", "picker"],
)
def test_envoy_has_each_pools_cluster_and_routes_as_meshconfig_renders_them(
    values: dict[str, Any], tmp_path: Path
) -> None:
    """The chart's config for two pools is the one meshconfig renders for them (worker_pools),
    with the chart's values in its placeholders, relay on and off."""
    pools = ("code", "cpu")
    chart = Release(render({**values, "worker": {"pools": POOLS}})).envoy_config()
    expected = Release(render(values, chart=meshconfig_chart(tmp_path, pools))).envoy_config()
    assert chart == expected
    # Not vacuous: the pools are there, and their routes take the pool's header.
    clusters = [c["name"] for c in chart["static_resources"]["clusters"]]
    assert clusters[clusters.index("worker") :][:3] == ["worker", "worker-code", "worker-cpu"]
    internal = next(x for x in chart["static_resources"]["listeners"] if x["name"] == "worker")
    routes = internal["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"
    ][0]["routes"]
    # After the workers' admin interface, which no listener routes (decision 0034).
    assert "direct_response" in routes[0]
    assert [(r["match"].get("headers"), r["route"]["cluster"]) for r in routes[1:]] == [
        ([{"name": POOL_HEADER, "string_match": {"exact": "code"}}], "worker-code"),
        ([{"name": POOL_HEADER, "string_match": {"exact": "cpu"}}], "worker-cpu"),
        (None, "worker"),
    ]


def test_envoy_accepts_the_pools_config(tmp_path: Path) -> None:
    data = Release(render({"worker": {"pools": POOLS}})).get("ConfigMap", f"{PREFIX}-envoy")["data"]
    assert "${" not in data["envoy.yaml"]
    path = tmp_path / "envoy.yaml"
    path.write_text(data["envoy.yaml"])
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_discovery_and_gateways_name_each_pool(
    releases: dict[str, Release], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = releases["pools"]
    env = release.env("controlplane")
    targets = json.loads(env["TOKENMESH_CONTROLPLANE_DNS_TARGETS"])
    clusters = {c["name"] for c in release.envoy_config()["static_resources"]["clusters"]}
    for pool in ("code", "cpu"):
        host, _, port = targets[f"worker-{pool}"].rpartition(":")
        assert f"worker-{pool}" in clusters
        service = release.get("Service", host.split(".")[0])
        assert selects(service["spec"]["selector"], pod_labels(release, f"worker-{pool}"))
        (container,) = pool_deployment(release, pool)["spec"]["template"]["spec"]["containers"]
        assert int(port) == port_number(container, "grpc")
    monkeypatch.setenv("TOKENMESH_CONTROLPLANE_SOURCE", "dns")
    monkeypatch.setenv(
        "TOKENMESH_CONTROLPLANE_DNS_TARGETS", env["TOKENMESH_CONTROLPLANE_DNS_TARGETS"]
    )
    assert set(ControlPlaneSettings().dns_targets) == set(targets)
    pools = release.env("gateway")["TOKENMESH_GATEWAY_WORKER_POOLS"]
    monkeypatch.setenv("TOKENMESH_GATEWAY_WORKER_POOLS", pools)
    assert GatewaySettings().worker_pools == ("code", "cpu")


def test_envoy_and_the_control_plane_reach_every_pool_and_pools_hand_over(
    releases: dict[str, Release],
) -> None:
    release = releases["pools"]
    worker_port = release.env("worker")["TOKENMESH_WORKER_PORT"]

    def egress_peers(component: str, port: int) -> list[dict[str, Any]]:
        policy = release.get("NetworkPolicy", f"{PREFIX}-{component}-egress")
        return [
            peer
            for rule in policy["spec"]["egress"]
            if {"protocol": "TCP", "port": port} in rule["ports"]
            for peer in rule["to"]
        ]

    handover = int(
        pool_env(release, "code")["TOKENMESH_WORKER_HANDOVER_ADDRESS"].rpartition(":")[2]
    )
    envoy_ingress = release.get("NetworkPolicy", f"{PREFIX}-envoy")["spec"]["ingress"]
    for pool in ("code", "cpu"):
        labels = pod_labels(release, f"worker-{pool}")
        for caller in ("envoy", "controlplane"):
            peers = egress_peers(caller, int(worker_port))
            assert any(selects(p["podSelector"]["matchLabels"], labels) for p in peers), caller
        ingress = release.get("NetworkPolicy", f"{PREFIX}-worker-{pool}")["spec"]["ingress"]
        for caller in ("envoy", "controlplane"):
            caller_labels = pod_labels(release, caller)
            assert any(
                {"port": "grpc"} in rule["ports"]
                and any(
                    selects(p["podSelector"]["matchLabels"], caller_labels) for p in rule["from"]
                )
                for rule in ingress
            ), caller
        # A pool's worker hands its streams over through Envoy's internal worker listener.
        pool_egress = egress_peers(f"worker-{pool}", handover)
        assert any(
            selects(p["podSelector"]["matchLabels"], pod_labels(release, "envoy"))
            for p in pool_egress
        )
        assert any(
            {"port": "worker"} in rule["ports"]
            and any(selects(p["podSelector"]["matchLabels"], labels) for p in rule["from"])
            for rule in envoy_ingress
        )


# ---- what is refused


@pytest.mark.parametrize("name", ["Code", "-code", "code-", "c_de", "x" * 33, ""])
def test_a_bad_pool_name_is_refused_at_render_naming_it(name: str, tmp_path: Path) -> None:
    values = {"worker": {"pools": [{"name": name, "model": {"name": "m"}}]}}
    with pytest.raises(helm_python.HelmValuesError, match=f"/worker/pools/0/name': '{name}'"):
        render(values)
    # The templates refuse it too, where the schema is skipped.
    chart = tmp_path / "tokenmesh"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()
    with pytest.raises(helm_python.HelmError, match=f'pool name "{name}" must be a DNS label'):
        render(values, chart=chart)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"worker": {"pools": [{"name": "a", "model": {"name": "m"}}] * 2}},
            'pool name "a" is given twice',
        ),
        (
            {"worker": {"pools": [{"name": "big", "model": {"name": "m"}, "gpu": {"count": 9}}]}},
            r"worker.pools\[big\].gpu.count \(9\) is more GPUs than one node offers",
        ),
        (
            {"worker": {"pools": [{"name": "shm", "model": {"name": "m"}, "shmSize": "100Gi"}]}},
            r"worker.pools\[shm\].shmSize \(100Gi\) must be below",
        ),
        (
            {
                "worker": {
                    "pools": [{"name": "dp", "model": {"name": "m"}, "engineArgs": {"nnodes": 2}}]
                }
            },
            r"worker.pools\[dp\].engineArgs.nnodes",
        ),
        (
            {
                "worker": {
                    "pools": [{"name": "a", "model": {"name": "m"}}],
                    "model": {"storage": {"type": "pvc"}},
                }
            },
            "worker.pools share the workers' claim",
        ),
        (
            {
                "worker": {
                    "pools": [
                        {
                            "name": "a",
                            "model": {"name": "m"},
                            "autoscaling": {"enabled": True, "minReplicas": 5},
                        }
                    ]
                }
            },
            r"worker.pools\[a\].autoscaling.minReplicas \(5\) is above maxReplicas \(4\)",
        ),
        (
            {
                "worker": {
                    "pools": [
                        {"name": "a", "model": {"name": "m"}, "autoscaling": {"enabled": True}}
                    ],
                    "keda": {"enabled": True},
                },
                "monitoring": {"serviceMonitor": {"enabled": True}},
            },
            r"worker.pools\[a\].autoscaling.enabled and worker.keda.enabled cannot both be on",
        ),
    ],
    ids=["twice", "gpus", "shm", "nnodes", "rwo-claim", "hpa-range", "two-scalers"],
)
def test_pools_that_cannot_work_are_refused_naming_the_pool(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def test_the_schema_refuses_a_pool_without_a_model_or_with_an_unknown_value() -> None:
    with helm_python.Chart.load(CHART) as chart:
        for values, _ in VALUE_SETS.values():
            chart.validate_schema(values)
        for pool, where in (
            ({"name": "a"}, "/worker/pools/0"),
            ({"name": "a", "model": {"servedName": "x"}}, "/worker/pools/0/model"),
            ({"name": "a", "model": {"name": "m"}, "port": 1}, "/worker/pools/0"),
            ({"name": "a", "model": {"name": "m", "storage": {}}}, "/worker/pools/0/model"),
            ({"name": "a", "model": {"name": "m"}, "replicas": "2"}, "/worker/pools/0/replicas"),
        ):
            with pytest.raises(helm_python.HelmValuesError, match=where):
                chart.validate_schema({"worker": {"pools": [pool]}})


def test_the_pools_file_is_meshconfigs() -> None:
    """files/worker-pools.yaml names the header meshconfig routes pools by."""
    spec = yaml.safe_load((CHART / "files" / "worker-pools.yaml").read_text())
    assert spec["header"] == POOL_HEADER
    assert spec["listeners"]["envoy.yaml"] == ["edge", "worker"]
    assert spec["listeners"]["envoy-relay.yaml"] == ["worker"]


def test_the_documented_example_renders_three_pools() -> None:
    """docs/kubernetes.md's "Several models" values render, valid, with the pools it names."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    section = text.split("### Several models", 1)[1]
    example = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    release = Release(render(example))
    assert_valid(release.objects)
    assert json.loads(release.env("gateway")["TOKENMESH_GATEWAY_WORKER_POOLS"]) == [
        "code",
        "small",
    ]
    (small,) = pool_deployment(release, "small")["spec"]["template"]["spec"]["containers"]
    assert small["image"].endswith("-cpu") and "nvidia.com/gpu" not in small["resources"]["limits"]


def test_a_pool_reaches_the_model_hub_by_its_own_model() -> None:
    """A pool whose model comes from the hub may download it, beside workers whose model is in
    their image (a path), which may not."""
    values = {
        "worker": {
            "model": {"name": "/opt/models/tiny"},
            "pools": [{"name": "hub", "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"}}],
        }
    }
    release = Release(render(values))
    hub = DEFAULTS["networkPolicy"]["egress"]["modelHubTo"]
    assert hub

    def peers(name: str) -> list[Any]:
        policy = release.get("NetworkPolicy", f"{PREFIX}-{name}-egress")
        return [rule["to"] for rule in policy["spec"]["egress"]]

    assert hub in peers("worker-hub")
    assert hub not in peers("worker")


def test_a_pool_name_too_long_for_the_release_is_refused_saying_how_long_it_may_be() -> None:
    """Under the longest release name (a 40-character prefix) <prefix>-worker-<pool>-headless
    fits 63 characters with a pool name of at most 6."""
    pool = {"name": "x" * 8, "model": {"name": "m"}}
    with pytest.raises(helm_python.HelmError, match="use a pool name of at most 6 characters"):
        render({"worker": {"pools": [pool]}}, release=LONG_RELEASE)
    release = Release(
        render({"worker": {"pools": [{**pool, "name": "x" * 6}]}}, release=LONG_RELEASE)
    )
    names = [item["metadata"]["name"] for item in release.all("Service")]
    assert max(len(name) for name in names) == 63


def test_with_consul_each_pools_workers_register_as_its_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = Release(render({"worker": {"pools": POOLS}, "discovery": {"mode": "consul"}}))
    env = release.env("controlplane")
    assert env["TOKENMESH_CONTROLPLANE_SOURCE"] == "consul"
    monkeypatch.setenv("TOKENMESH_CONTROLPLANE_SOURCE", "consul")
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "127.0.0.1:8500")
    monkeypatch.setenv(
        "TOKENMESH_CONTROLPLANE_CONSUL_SERVICES", env["TOKENMESH_CONTROLPLANE_CONSUL_SERVICES"]
    )
    assert ControlPlaneSettings().consul_services == [
        "gateway", "worker", "reranker", "worker-code", "worker-cpu"
    ]  # fmt: skip
    for pool in ("code", "cpu"):
        (container,) = pool_deployment(release, pool)["spec"]["template"]["spec"]["containers"]
        pool_env = {e["name"]: e.get("value") for e in container["env"]}
        monkeypatch.setenv("TOKENMESH_WORKER_POOL", pool_env["TOKENMESH_WORKER_POOL"])
        assert WorkerSettings().pool == pool
    # The default pool's workers name none: they register as `worker`.
    assert "TOKENMESH_WORKER_POOL" not in release.env("worker")
    # Without pools, the control plane watches its default services.
    plain = Release(render({"discovery": {"mode": "consul"}}))
    assert "TOKENMESH_CONTROLPLANE_CONSUL_SERVICES" not in plain.env("controlplane")
