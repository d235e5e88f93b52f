"""The Helm chart, rendered offline (Helm v4 as a library, PyPI helm-python-sdk) for every value
set below and every manifest validated strictly against Kubernetes 1.33's schemas (PyPI
kubernetes-validate), the custom resources against their CRDs' schemas (tests/crds: the npm
models of the Prometheus Operator's, cert-manager's and KEDA's CRDs); then the facts that
matter asserted on the rendered objects: GPUs on workers only, native gRPC probes on the right
ports, NetworkPolicies that select the right pods, an Envoy config the real Envoy accepts,
discovery wiring, TLS, API keys, autoscaling, mTLS, monitoring, names that fit for any release
name, shutdown timing, model storage, the pods' extension points, and the value combinations
refused at render time.
No cluster is involved."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from helm_python import _native
from prometheus_client import CollectorRegistry

from tests.support import ROOT
from tests.unit.test_meshconfig import envoy_validate
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.tenants import Limits
from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.tenancy.auth import KeysFile
from tokenmesh.localmesh.certs import ENVOY_CLIENT, CertMaker, CertPaths, CertSettings
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.worker.config import WorkerSettings

CHART = ROOT / "helm" / "tokenmesh"
# libyaml's safe loader: the rendered objects, and the Envoy config in a ConfigMap (80 KB),
# parse ten times faster than with PyYAML's own.
LOADER = yaml.CSafeLoader
KUBE_VERSION = "1.33.0"
RELEASE = "tm"
NAMESPACE = "llm"
PREFIX = f"{RELEASE}-tokenmesh"
PYTHON_COMPONENTS = ("gateway", "worker", "reranker", "controlplane")
HEALTH_SERVICES = {
    "gateway": "tokenmesh.v1.LLMService",
    "worker": "tokenmesh.v1.InferenceService",
    "reranker": "tokenmesh.v1.RerankService",
    "controlplane": "envoy.service.discovery.v3.AggregatedDiscoveryService",
}
# Custom resources: no Kubernetes schema; validated against their CRDs' schemas instead, by
# tests/crds/validate.mjs (Node.js; `make setup` installs its npm packages).
CRD_VALIDATOR = ROOT / "tests" / "crds"
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "Certificate", "ScaledObject"}
CUSTOM_APIS = {"monitoring.coreos.com/v1", "cert-manager.io/v1", "keda.sh/v1alpha1"}
OPERATOR_APIS = (
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
    "cert-manager.io/v1/Certificate",
)
CONSUL_ADDRESS = "http://consul-server.consul.svc:8500"
# The longest release name Helm accepts (53 characters).
LONG_RELEASE = "production-llm-inference-us-east-1-canary-blue-000001"
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def extension_values(component: str) -> dict[str, Any]:
    """Every pod extension point of a component set to something recognisable."""
    return {
        "podAnnotations": {"example.com/team": "llm"},
        "podLabels": {"example.com/tier": component},
        "priorityClassName": "inference-high",
        "runtimeClassName": "nvidia" if component == "worker" else "",
        "nodeSelector": {"example.com/pool": component},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": component, "effect": "NoSchedule"}
        ],
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 10,
                        "preference": {
                            "matchExpressions": [
                                {"key": "example.com/pool", "operator": "In", "values": ["a"]}
                            ]
                        },
                    }
                ]
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 2,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule",
            }
        ],
        "extraEnv": [
            {
                "name": "EXAMPLE_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "example", "key": "token"}},
            },
            {"name": "EXAMPLE_MODE", "value": "on"},
        ],
        "extraVolumes": [{"name": "extra", "configMap": {"name": "example"}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/etc/example", "readOnly": True}],
        "serviceAccount": {
            "name": f"{component}-account",
            "annotations": {"iam.example.com/role": component},
        },
        "resources": {"requests": {"cpu": "1", "memory": "3Gi"}, "limits": {"memory": "4Gi"}},
    }


def python_extension_values(component: str, scale: int) -> dict[str, Any]:
    """extension_values plus probe timings and shutdown times that differ per component."""
    return {
        **extension_values(component),
        "probes": {
            "startup": {"periodSeconds": 3 + scale, "timeoutSeconds": 2, "failureThreshold": 11},
            "readiness": {"periodSeconds": 4 + scale, "timeoutSeconds": 3, "failureThreshold": 4},
            "liveness": {"periodSeconds": 9 + scale, "timeoutSeconds": 7, "failureThreshold": 5},
        },
        "shutdown": {
            "graceSeconds": 12 + scale,
            "drainSeconds": 2,
            "preStopSleepSeconds": 3,
            "marginSeconds": 4,
            "terminationGracePeriodSeconds": 40 + scale,
        },
    }


# envoy.workerRouting.picker, none of them the default.
PICKER_VALUES = {
    "slackStreams": 4,
    "slackPercent": 50,
    "workBoundPercent": 150,
    "workWindowSeconds": 20.5,
    "candidates": 2,
    "staleSeconds": 1.5,
    "feedIntervalMs": 250,
}
# name -> (values, extra API versions the simulated cluster serves)
VALUE_SETS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "defaults": ({}, ()),
    "cpu": (yaml.safe_load((CHART / "values-cpu.yaml").read_text()), ()),
    "multi-gpu": (
        {
            "worker": {
                "replicas": 2,
                "gpu": {"count": 4},
                "engineArgs": {"kv_cache_dtype": "fp8", "enable_prefix_caching": True},
                "model": {
                    "name": "Llama-3.1-70B-Instruct",
                    "loraModules": {"sql": "adapters/sql"},
                    "storage": {"type": "existingClaim", "existingClaim": {"claimName": "models"}},
                    "hfToken": {"secretName": "hf", "secretKey": "token"},
                },
            }
        },
        (),
    ),
    "consul": ({"discovery": {"mode": "consul"}, "consul": {"address": CONSUL_ADDRESS}}, ()),
    "tls": (
        {"envoy": {"tls": {"enabled": True, "certManager": {"issuerRef": {"name": "ca"}}}}},
        OPERATOR_APIS,
    ),
    "mtls": (
        {
            "envoy": {"tls": {"enabled": True, "certManager": {"issuerRef": {"name": "ca"}}}},
            "mtls": {"enabled": True, "certManager": {"issuerRef": {"name": "mesh-ca"}}},
        },
        OPERATOR_APIS,
    ),
    "mtls-secret": ({"mtls": {"enabled": True, "existingSecret": "tokenmesh-mtls"}}, ()),
    "keys-secret": (
        {
            "gateway": {"auth": {"existingSecret": "tenant-keys", "secretKey": "keys"}},
            "controlplane": {"adminApi": {"existingSecret": "tokenmesh-admin"}},
        },
        (),
    ),
    "hpa-monitoring": (
        {
            "gateway": {"autoscaling": {"enabled": True}},
            "worker": {"autoscaling": {"enabled": True}},
            "monitoring": {
                "serviceMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True},
            },
        },
        OPERATOR_APIS,
    ),
    "extensions": (
        {
            "gateway": python_extension_values("gateway", 1),
            "worker": {
                **python_extension_values("worker", 2),
                "shmSize": "1Gi",
                "updateStrategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            },
            "reranker": python_extension_values("reranker", 3),
            "controlplane": python_extension_values("controlplane", 4),
            "envoy": extension_values("envoy"),
        },
        (),
    ),
    "pvc": (
        {
            "worker": {
                "replicas": 3,
                "model": {
                    "storage": {
                        "type": "pvc",
                        "pvc": {
                            "size": "500Gi",
                            "storageClassName": "shared-files",
                            "accessMode": "ReadWriteMany",
                        },
                    }
                },
            }
        },
        (),
    ),
    "keda": (
        {
            "gateway": {"autoscaling": {"enabled": True}},
            "worker": {
                "keda": {"enabled": True, "maxReplicaCount": 6, "ttft": {"enabled": True}},
                "model": {"storage": {"type": "pvc", "pvc": {"accessMode": "ReadWriteMany"}}},
            },
            "monitoring": {"serviceMonitor": {"enabled": True}},
        },
        OPERATOR_APIS,
    ),
    # Load-aware prefix affinity (the gateways' endpoint picker) under mTLS, tunables changed.
    "mtls-picker": (
        {
            "envoy": {"workerRouting": {"policy": "picker", "picker": PICKER_VALUES}},
            "mtls": {"enabled": True, "existingSecret": "tokenmesh-mtls"},
        },
        (),
    ),
    # Every kind of object the chart can make, under the longest release name.
    "long-release": (
        {
            "envoy": {"tls": {"enabled": True, "certManager": {"issuerRef": {"name": "ca"}}}},
            "mtls": {"enabled": True, "certManager": {"issuerRef": {"name": "mesh-ca"}}},
            "gateway": {"autoscaling": {"enabled": True}},
            "worker": {
                "keda": {"enabled": True, "ttft": {"enabled": True}},
                "model": {"storage": {"type": "pvc", "pvc": {"accessMode": "ReadWriteMany"}}},
            },
            "monitoring": {
                "serviceMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True},
            },
        },
        OPERATOR_APIS,
    ),
}
# Value sets rendered under another release name than RELEASE.
RELEASE_NAMES = {"long-release": LONG_RELEASE}


def render(
    values: dict[str, Any],
    api_versions: tuple[str, ...] = (),
    chart: Path = CHART,
    release: str = RELEASE,
) -> dict[str, str]:
    """`helm template` for Kubernetes KUBE_VERSION with api_versions served (the Prometheus
    Operator's and cert-manager's CRDs). Chart.render takes neither option; the native call
    behind it does."""
    with helm_python.Chart.load(chart) as loaded:
        options = {
            "name": release,
            "namespace": NAMESPACE,
            "kube_version": f"v{KUBE_VERSION}",
            "api_versions": list(api_versions),
        }
        rendered = _native.call_string(
            "helm_render", loaded._raw(), json.dumps(values), json.dumps(options)
        )
    manifests: dict[str, str] = json.loads(rendered)
    return manifests


class Release:
    """One value set's rendered objects, looked up by kind and name."""

    def __init__(self, manifests: dict[str, str]) -> None:
        self.manifests = manifests
        self.objects = [
            document
            for path, text in sorted(manifests.items())
            if path.endswith(".yaml")
            for document in yaml.load_all(text, Loader=LOADER)
            if document
        ]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(o["metadata"]["name"] == name for o in self.all(kind))

    def deployment(self, component: str) -> dict[str, Any]:
        return self.get("Deployment", f"{PREFIX}-{component}")

    def container(self, component: str) -> dict[str, Any]:
        containers = self.deployment(component)["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1
        return dict(containers[0])

    def env(self, component: str) -> dict[str, Any]:
        """name -> value (or the valueFrom mapping)."""
        return {
            e["name"]: e.get("value", e.get("valueFrom")) for e in self.container(component)["env"]
        }

    def envoy_config(self) -> dict[str, Any]:
        config = self.get("ConfigMap", f"{PREFIX}-envoy")["data"]["envoy.yaml"]
        return dict(yaml.load(config, Loader=LOADER))

    def envoy_secret(self, reference: dict[str, Any]) -> dict[str, Any]:
        """The secret an SDS reference of the Envoy config names, from the ConfigMap's file
        the reference names (the ConfigMap is mounted at /etc/envoy/config)."""
        path = reference["sds_config"]["path_config_source"]["path"]
        assert path.startswith("/etc/envoy/config/")
        data = self.get("ConfigMap", f"{PREFIX}-envoy")["data"]
        (secret,) = yaml.load(data[path.removeprefix("/etc/envoy/config/")], Loader=LOADER)[
            "resources"
        ]
        assert secret["name"] == reference["name"]
        return dict(secret)

    def envoy_certificate(self, context: dict[str, Any]) -> dict[str, Any]:
        """The certificate a common_tls_context gets over SDS."""
        (reference,) = context["tls_certificate_sds_secret_configs"]
        return dict(self.envoy_secret(reference)["tls_certificate"])


def validate_custom(objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """tests/crds/validate.mjs on objects: a line per object, `ok <kind>/<name>` or
    `FAIL <kind>/<name>: <what is wrong>`; exit status 1 when any fails its CRD's schema."""
    node = shutil.which("node")
    assert node, (
        "no node on PATH: install Node.js 20+, then run `make setup` (it installs tests/crds)"
    )
    stamp = CRD_VALIDATOR / "node_modules" / ".setup"
    assert stamp.exists(), "the CRD validator's packages are not installed: run `make setup`"
    assert stamp.stat().st_mtime >= (CRD_VALIDATOR / "package-lock.json").stat().st_mtime, (
        "tests/crds/package-lock.json is newer than its install: run `make setup`"
    )
    return subprocess.run(
        [node, str(CRD_VALIDATOR / "validate.mjs")],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def releases() -> dict[str, Release]:
    """Every value set rendered once."""
    return {
        name: Release(render(values, apis, release=RELEASE_NAMES.get(name, RELEASE)))
        for name, (values, apis) in VALUE_SETS.items()
    }


def pod_labels(release: Release, component: str) -> dict[str, str]:
    return dict(release.deployment(component)["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def port_number(container: dict[str, Any], name: str) -> int:
    return next(int(p["containerPort"]) for p in container["ports"] if p["name"] == name)


def workloads(release: Release) -> Iterator[tuple[str, dict[str, Any]]]:
    for deployment in release.all("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment["metadata"]["name"], container


# ---- the chart as a whole


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict_finds_nothing(value_set: str) -> None:
    values, _ = VALUE_SETS[value_set]
    report = helm_python.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["messages"] == [] and report["errors"] == [], report


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_manifest_is_valid_for_the_kubernetes_version(
    value_set: str, releases: dict[str, Release]
) -> None:
    release = releases[value_set]
    kinds = {o["kind"] for o in release.objects}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert_valid(release.objects)


def assert_valid(objects: list[dict[str, Any]]) -> None:
    """Built-in objects against Kubernetes KUBE_VERSION's schemas (strict), custom resources
    against their CRDs'."""
    custom = []
    for item in objects:
        if item["kind"] in CUSTOM_KINDS:
            assert item["apiVersion"] in CUSTOM_APIS
            custom.append(item)
            continue
        kubernetes_validate.validate(item, KUBE_VERSION, strict=True)
    if custom:
        result = validate_custom(custom)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.splitlines() == [
            f"ok {item['kind']}/{item['metadata']['name']}" for item in custom
        ]


def test_strict_validation_rejects_an_unknown_field(releases: dict[str, Release]) -> None:
    """The validation above can fail: a misspelt container field is refused."""
    deployment = json.loads(json.dumps(releases["defaults"].deployment("gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_crd_validation_refuses_a_wrong_type_and_names_the_object(
    releases: dict[str, Release],
) -> None:
    """The custom resources' validation can fail: a field of the wrong type is refused in each
    of the Prometheus Operator's, cert-manager's and KEDA's schemas, naming the object and the
    field; a kind without a schema is refused too; a valid object beside them passes."""
    monitor = json.loads(
        json.dumps(releases["hpa-monitoring"].get("ServiceMonitor", f"{PREFIX}-worker"))
    )
    monitor["spec"]["endpoints"] = "metrics"
    certificate = json.loads(json.dumps(releases["tls"].get("Certificate", f"{PREFIX}-envoy")))
    certificate["spec"]["duration"] = 2160
    scaled = json.loads(json.dumps(releases["keda"].get("ScaledObject", f"{PREFIX}-worker")))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    valid = releases["hpa-monitoring"].get("PrometheusRule", f"{PREFIX}-alerts")
    unknown = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "pods"},
        "spec": {},
    }
    result = validate_custom([monitor, certificate, scaled, valid, unknown])
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"FAIL ServiceMonitor/{PREFIX}-worker: /spec/endpoints must be array",
        f"FAIL Certificate/{PREFIX}-envoy: /spec/duration must be string",
        f"FAIL ScaledObject/{PREFIX}-worker: /spec/triggers/0/metadata/threshold must be string",
        f"ok PrometheusRule/{PREFIX}-alerts",
        "FAIL PodMonitor/pods: no schema for monitoring.coreos.com/v1/PodMonitor (known: "
        "monitoring.coreos.com/v1/ServiceMonitor, monitoring.coreos.com/v1/PrometheusRule, "
        "cert-manager.io/v1/Certificate, keda.sh/v1alpha1/ScaledObject)",
        "4 of 5 objects fail their schema",
    ]


def test_schema_accepts_the_value_sets_and_rejects_bad_values() -> None:
    with helm_python.Chart.load(CHART) as chart:
        for values, _ in VALUE_SETS.values():
            chart.validate_schema(values)
        bad = [
            ({"worker": {"gpu": {"count": "two"}}}, "/worker/gpu/count"),
            ({"replicaCount": 3}, "replicaCount"),
            ({"discovery": {"mode": "etcd"}}, "/discovery/mode"),
            ({"gateway": {"replicas": "3"}}, "/gateway/replicas"),
            ({"envoy": {"tls": {"enabled": "yes"}}}, "/envoy/tls/enabled"),
            ({"mtls": {"healthPort": 0}}, "/mtls/healthPort"),
            ({"mtls": {"certManager": {"duration": "90 days"}}}, "/mtls/certManager/duration"),
            ({"mtls": {"secret": "x"}}, "/mtls"),
            (
                {"gateway": {"auth": {"keys": {"tenants": {"a": {"key_sha256": ["k3y"]}}}}}},
                "/gateway/auth/keys/tenants/a/key_sha256/0",
            ),
            ({"gateway": {"auth": {"keys": {"defaults": {"rps": 1}}}}}, "/gateway/auth/keys"),
            ({"worker": {"podAnnotations": {"a": 1}}}, "/worker/podAnnotations/a"),
            ({"gateway": {"extraEnv": [{"value": "x"}]}}, "/gateway/extraEnv/0"),
            ({"envoy": {"extraEnv": {"A": "b"}}}, "/envoy/extraEnv"),
            ({"reranker": {"tolerations": {"key": "x"}}}, "/reranker/tolerations"),
            ({"controlplane": {"priorityClassName": 5}}, "/controlplane/priorityClassName"),
            ({"envoy": {"runtimeClassName": ["gvisor"]}}, "/envoy/runtimeClassName"),
            ({"worker": {"topologySpreadConstraints": [{"maxSkew": 1}]}}, "/worker/topology"),
            ({"gateway": {"serviceAccount": {"automount": True}}}, "/gateway/serviceAccount"),
            ({"worker": {"extraVolumeMounts": [{"name": "x"}]}}, "/worker/extraVolumeMounts/0"),
            ({"reranker": {"extraVolumes": [{"emptyDir": {}}]}}, "/reranker/extraVolumes/0"),
            ({"worker": {"probes": {"liveness": {"timeoutSeconds": "5s"}}}}, "/worker/probes"),
            ({"gateway": {"shutdown": {"graceSeconds": -1}}}, "/gateway/shutdown/graceSeconds"),
            ({"worker": {"model": {"storage": {"type": "hostPath"}}}}, "/worker/model/storage"),
            ({"worker": {"shmSize": "8 GB"}}, "/worker/shmSize"),
            ({"worker": {"updateStrategy": {"type": "OnDelete"}}}, "/worker/updateStrategy"),
            ({"worker": {"keda": {"queue": {"threshold": 4}}}}, "/worker/keda/queue/threshold"),
            ({"worker": {"startupProbe": {"periodSeconds": 5}}}, "/worker"),
        ]
        for values, where in bad:
            with pytest.raises(helm_python.HelmValuesError, match=where):
                chart.validate_schema(values)
    # helm install/template refuse them too, before rendering anything.
    with pytest.raises(helm_python.HelmValuesError):
        render({"gateway": {"replicas": "3"}})


def undocumented_values(text: str) -> list[str]:
    """Values (leaf keys) of a values.yaml with no `# --` comment above them or above one of
    their enclosing keys."""
    lines = text.splitlines()
    missing = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        comments = []
        above = number - 1
        while above >= 0 and lines[above].strip().startswith("#"):
            comments.append(lines[above].strip())
            above -= 1
        documented = any(comment.startswith("# --") for comment in comments)
        key, _, rest = stripped.partition(":")
        is_leaf = bool(rest.strip())
        if is_leaf and not documented and not any(flag for _, flag in stack):
            missing.append(f"line {number + 1}: {key}")
        stack.append((indent, documented))
    return missing


def test_every_value_is_documented() -> None:
    assert undocumented_values((CHART / "values.yaml").read_text()) == []
    # The check can fail: a value without a comment is found.
    assert undocumented_values("gateway:\n  # -- Replicas.\n  replicas: 2\n  port: 1\n") == [
        "line 4: port"
    ]


def test_app_version_is_the_project_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == project["version"]


def test_the_chart_files_are_the_generated_ones() -> None:
    """files/: meshconfig's kubernetes profiles, dashboards/ and prometheus/alerts.yml."""
    result = subprocess.run(
        [sys.executable, "scripts/gen_chart_files.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# ---- GPUs


def test_gpus_are_requested_by_the_worker_only(releases: dict[str, Release]) -> None:
    for value_set, count in (("defaults", 1), ("multi-gpu", 4)):
        release = releases[value_set]
        for name, container in workloads(release):
            resources = container.get("resources", {})
            gpus = [
                section.get("nvidia.com/gpu")
                for section in (resources.get("limits", {}), resources.get("requests", {}))
            ]
            expected = [count, count] if name == f"{PREFIX}-worker" else [None, None]
            assert gpus == expected, (value_set, name)
        tolerations = release.deployment("worker")["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            tolerations
        )
    assert "nvidia.com/gpu" not in json.dumps(releases["cpu"].objects)


def test_multi_gpu_workers_shard_the_model_from_a_volume(releases: dict[str, Release]) -> None:
    release = releases["multi-gpu"]
    env = release.env("worker")
    assert env["TOKENMESH_WORKER_TENSOR_PARALLEL_SIZE"] == "4"
    # vLLM's engine arguments as the worker's settings read them.
    assert json.loads(env["TOKENMESH_WORKER_ENGINE_ARGS"]) == {
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": True,
    }
    assert env["TOKENMESH_WORKER_MODEL"] == "/models/Llama-3.1-70B-Instruct"
    # Adapters from the same volume, as the worker's settings read them.
    assert json.loads(env["TOKENMESH_WORKER_LORA_MODULES"]) == {"sql": "/models/adapters/sql"}
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    pod = release.deployment("worker")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"]: m for m in release.container("worker")["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm"
    assert mounts["/models"]["readOnly"] is True
    assert release.deployment("worker")["spec"]["replicas"] == 2
    # One GPU (defaults): no sharding, the model from the hub, no token.
    defaults = releases["defaults"].env("worker")
    assert "TOKENMESH_WORKER_TENSOR_PARALLEL_SIZE" not in defaults
    assert "TOKENMESH_WORKER_ENGINE_ARGS" not in defaults
    assert "HF_TOKEN" not in defaults
    assert "/" in defaults["TOKENMESH_WORKER_MODEL"] and not defaults[
        "TOKENMESH_WORKER_MODEL"
    ].startswith("/")


def test_cpu_profile_runs_the_tiny_model_from_the_cpu_image(releases: dict[str, Release]) -> None:
    release = releases["cpu"]
    worker = release.container("worker")
    assert worker["image"].endswith(":0.1.0-cpu")
    assert release.env("worker")["TOKENMESH_WORKER_MODEL"] == "/opt/tokenmesh/models/tiny-llama"
    assert "TOKENMESH_WORKER_LORA_MODULES" not in release.env("worker")
    assert "tolerations" not in release.deployment("worker")["spec"]["template"]["spec"]
    assert releases["defaults"].container("worker")["image"].endswith(":0.1.0")


def test_worker_startup_probe_allows_a_long_model_load(releases: dict[str, Release]) -> None:
    probe = releases["defaults"].container("worker")["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60
    cpu = releases["cpu"].container("worker")["startupProbe"]
    assert cpu["periodSeconds"] * cpu["failureThreshold"] < 20 * 60


# ---- probes, ports, discovery


@pytest.mark.parametrize("value_set", ["defaults", "consul"])
def test_python_services_have_grpc_probes_on_their_grpc_port(
    value_set: str, releases: dict[str, Release]
) -> None:
    release = releases[value_set]
    for component in PYTHON_COMPONENTS:
        container = release.container(component)
        port = port_number(container, "grpc")
        env = release.env(component)
        assert env[f"TOKENMESH_{component.upper()}_PORT"] == str(port)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
            assert probe["grpc"]["port"] == port, (component, kind)
        assert container["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICES[component]
        assert container["startupProbe"]["grpc"]["service"] == HEALTH_SERVICES[component]
        assert container["livenessProbe"]["grpc"]["service"] == ""
        service = release.get("Service", f"{PREFIX}-{component}-headless")
        assert service["spec"]["clusterIP"] == "None"
        assert selects(service["spec"]["selector"], pod_labels(release, component))
        grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc["port"] == port


def test_envoy_reaches_the_control_plane_and_gateways_reach_envoy(
    releases: dict[str, Release],
) -> None:
    release = releases["defaults"]
    config = release.envoy_config()
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    xds = clusters["xds_cluster"]
    assert xds["type"] == "STRICT_DNS"
    address = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    socket_address = address["socket_address"]
    assert socket_address["address"] == (
        f"{PREFIX}-controlplane-headless.{NAMESPACE}.svc.cluster.local"
    )
    assert socket_address["port_value"] == port_number(release.container("controlplane"), "grpc")
    listeners = {
        item["name"]: item["address"]["socket_address"]
        for item in config["static_resources"]["listeners"]
        if "address" in item  # not the stream relay's internal listener
    }
    assert {listener["address"] for listener in listeners.values()} == {"0.0.0.0"}
    internal = release.get("Service", f"{PREFIX}-envoy-internal")
    ports = {p["name"]: p["port"] for p in internal["spec"]["ports"]}
    env = release.env("gateway")
    assert env["TOKENMESH_GATEWAY_WORKER_ADDRESS"] == (
        f"{PREFIX}-envoy-internal:{listeners['worker']['port_value']}"
    )
    assert ports["worker"] == listeners["worker"]["port_value"]
    assert env["TOKENMESH_GATEWAY_RERANKER_ADDRESS"] == (
        f"{PREFIX}-envoy-internal:{listeners['reranker']['port_value']}"
    )
    edge = release.get("Service", f"{PREFIX}-envoy")
    assert [p["targetPort"] for p in edge["spec"]["ports"]] == ["edge"]
    envoy = release.container("envoy")
    assert port_number(envoy, "edge") == listeners["edge"]["port_value"]
    # Probes, preStop and admin in detail: tests/unit/test_helm_envoy.py.
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "stats"}
    assert port_number(envoy, "stats") == listeners["stats"]["port_value"]


def test_kubernetes_discovery_resolves_every_headless_service(
    releases: dict[str, Release],
) -> None:
    release = releases["defaults"]
    env = release.env("controlplane")
    assert env["TOKENMESH_CONTROLPLANE_SOURCE"] == "dns"
    targets = json.loads(env["TOKENMESH_CONTROLPLANE_DNS_TARGETS"])
    assert set(targets) == {"gateway", "worker", "reranker", "openai"}
    # The OpenAI API: the gateways' pods, at their openai port.
    ports = {cluster: ("gateway", "openai") for cluster in ("openai",)}
    for cluster, target in targets.items():
        host, _, port = target.rpartition(":")
        assert host.endswith(".svc.cluster.local."), "fully qualified: no search domains"
        service_name, namespace, *_ = host.split(".")
        assert namespace == NAMESPACE
        service = release.get("Service", service_name)
        assert service["spec"]["clusterIP"] == "None"
        component, port_name = ports.get(cluster, (cluster, "grpc"))
        assert selects(service["spec"]["selector"], pod_labels(release, component))
        assert int(port) == port_number(release.container(component), port_name)
    for component in PYTHON_COMPONENTS:
        assert not any("CONSUL_HTTP_ADDR" in name for name in release.env(component))


def test_consul_discovery_registers_every_service_and_watches_consul(
    releases: dict[str, Release],
) -> None:
    release = releases["consul"]
    env = release.env("controlplane")
    assert env["TOKENMESH_CONTROLPLANE_SOURCE"] == "consul"
    assert "TOKENMESH_CONTROLPLANE_DNS_TARGETS" not in env
    for component in PYTHON_COMPONENTS:
        env = release.env(component)
        prefix = f"TOKENMESH_{component.upper()}_"
        assert env[prefix + "CONSUL_HTTP_ADDR"] == CONSUL_ADDRESS
        # Registered under the pod IP, where Envoy reaches it.
        assert env[prefix + "ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Without an address: the node's Consul agent.
    node_agent = Release(render({"discovery": {"mode": "consul"}}))
    assert node_agent.env("worker")["TOKENMESH_WORKER_CONSUL_HTTP_ADDR"] == "$(HOST_IP):8500"
    assert node_agent.env("worker")["HOST_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}


# ---- NetworkPolicies


def ingress_peers_by_port(policy: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """port name -> the peers allowed to it (an empty list: everyone)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            found.setdefault(port["port"], []).extend(rule.get("from", []))
    return found


def peer_of(release: Release, component: str) -> dict[str, Any]:
    """The NetworkPolicyPeer of a component's pods, as the chart writes it."""
    labels = pod_labels(release, component)
    keys = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")
    return {"podSelector": {"matchLabels": {key: labels[key] for key in keys}}}


@pytest.mark.parametrize("value_set", ["defaults", "consul"])
def test_only_envoy_reaches_the_services(value_set: str, releases: dict[str, Release]) -> None:
    release = releases[value_set]
    envoy_pods = pod_labels(release, "envoy")
    gateway_pods = pod_labels(release, "gateway")
    for component in PYTHON_COMPONENTS:
        policy = release.get("NetworkPolicy", f"{PREFIX}-{component}")
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selects(selector, pod_labels(release, component))
        others = [c for c in (*PYTHON_COMPONENTS, "envoy") if c != component]
        assert not any(selects(selector, pod_labels(release, c)) for c in others)
        peers = ingress_peers_by_port(policy)
        # A gateway's OpenAI port has the same peers as its gRPC port.
        if component == "gateway":
            assert peers.pop("openai") == peers["grpc"]
        # Besides Envoy: the ops feed (control plane -> workers) and Envoy's edge -> the ops
        # page; test_helm_envoy.py checks them.
        if component == "worker":
            peers["grpc"] = [p for p in peers["grpc"] if p != peer_of(release, "controlplane")]
        if component == "controlplane":
            assert peers.pop("ops-page") == [peer_of(release, "envoy")]
        assert set(peers) == {"grpc", "metrics"}
        pod_peers = [p["podSelector"]["matchLabels"] for p in peers["grpc"] if "podSelector" in p]
        in_namespace = [p for p in peers["grpc"] if "namespaceSelector" not in p]
        # In this namespace, only Envoy's pods (and not the gateways directly).
        assert [p["podSelector"]["matchLabels"] for p in in_namespace] == [
            pod_peers[0]
        ] and selects(pod_peers[0], envoy_pods)
        assert not selects(pod_peers[0], gateway_pods)
        consul_peers = [p for p in peers["grpc"] if "namespaceSelector" in p]
        if value_set == "consul":
            assert consul_peers == [
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "consul"}}}
            ]
        else:
            assert consul_peers == []


def test_only_gateways_and_workers_handing_over_reach_envoys_internal_listeners(
    releases: dict[str, Release],
) -> None:
    release = releases["defaults"]
    policy = release.get("NetworkPolicy", f"{PREFIX}-envoy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(release, "envoy"))
    peers = ingress_peers_by_port(policy)
    assert peers["edge"] == []  # the edge is public
    # The worker listener also from the workers: one whose engine died hands its streams over.
    for listener, allowed in (("worker", {"gateway", "worker"}), ("reranker", {"gateway"})):
        selectors = [peer["podSelector"]["matchLabels"] for peer in peers[listener]]
        assert len(selectors) == len(allowed)
        for component in ("gateway", "worker", "reranker", "controlplane", "envoy"):
            reached = any(
                selects(selector, pod_labels(release, component)) for selector in selectors
            )
            assert reached == (component in allowed), (listener, component)
    handover = release.env("worker")["TOKENMESH_WORKER_HANDOVER_ADDRESS"]
    assert handover == release.env("gateway")["TOKENMESH_GATEWAY_WORKER_ADDRESS"]
    assert releases["defaults"].all("NetworkPolicy")
    assert Release(render({"networkPolicy": {"enabled": False}})).all("NetworkPolicy") == []


# ---- security


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_run_as_non_root_without_capabilities(
    value_set: str, releases: dict[str, Release]
) -> None:
    release = releases[value_set]
    for deployment in release.all("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        # High uids (checkov's CKV_K8S_40): none that a node's own users may have.
        assert pod["securityContext"]["runAsUser"] >= 10000
        assert pod["securityContext"]["runAsGroup"] >= 10000
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["allowPrivilegeEscalation"] is False
            read_only = deployment["metadata"]["labels"]["app.kubernetes.io/component"] != "worker"
            assert context["readOnlyRootFilesystem"] is read_only


def test_every_component_has_a_disruption_budget(releases: dict[str, Release]) -> None:
    release = releases["defaults"]
    for component in (*PYTHON_COMPONENTS, "envoy"):
        budget = release.get("PodDisruptionBudget", f"{PREFIX}-{component}")
        assert selects(budget["spec"]["selector"]["matchLabels"], pod_labels(release, component))
        assert budget["spec"]["maxUnavailable"] == 1


# ---- Envoy's config


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a self-signed tls.crt and tls.key, as a kubernetes.io/tls Secret."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl binary to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=tokenmesh", "-keyout", str(directory / "tls.key")),
            *("-out", str(directory / "tls.crt")),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return directory


@pytest.fixture(scope="module")
def mesh_certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Envoy's mTLS client certificate, key and CA as tls.crt, tls.key and ca.crt (the layout
    of the mounted Secret), made by `make certs`' code."""
    made = CertPaths(tmp_path_factory.mktemp("certs"))
    CertMaker(CertSettings(dir=made.dir), made).make()
    directory = tmp_path_factory.mktemp("mtls")
    shutil.copy(made.cert(ENVOY_CLIENT), directory / "tls.crt")
    shutil.copy(made.key(ENVOY_CLIENT), directory / "tls.key")
    shutil.copy(made.ca_cert, directory / "ca.crt")
    return directory


@pytest.mark.parametrize("value_set", ["defaults", "tls", "mtls", "mtls-secret", "mtls-picker"])
def test_envoy_accepts_the_configmap(
    value_set: str,
    releases: dict[str, Release],
    certificate: Path,
    mesh_certificates: Path,
    tmp_path: Path,
) -> None:
    data = releases[value_set].get("ConfigMap", f"{PREFIX}-envoy")["data"]
    text = data["envoy.yaml"]
    assert "${" not in text, "a placeholder was left in the config"
    config = yaml.safe_load(text)
    edge = next(item for item in config["static_resources"]["listeners"] if item["name"] == "edge")
    tls = edge["filter_chains"][0].get("transport_socket")
    assert (tls is not None) == (value_set in ("tls", "mtls"))
    upstream = [c for c in config["static_resources"]["clusters"] if "transport_socket" in c]
    assert [c["name"] for c in upstream] == (
        ["gateway", "worker", "reranker", "openai"] if value_set.startswith("mtls") else []
    )
    # The ConfigMap's files (the config and the SDS files it names) in one directory, as it is
    # mounted, and the mounted Secrets' files, here test certificates.
    mounts = {
        "/etc/envoy/config": tmp_path,
        "/etc/envoy/tls": certificate,
        "/etc/envoy/mtls": mesh_certificates,
        "/etc/envoy/internal-tls": mesh_certificates,
    }
    for name, content in data.items():
        for mount, directory in mounts.items():
            content = content.replace(mount, str(directory))
        (tmp_path / name).write_text(content)
    path = tmp_path / "envoy.yaml"
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_checksum_follows_the_envoy_config(tmp_path: Path) -> None:
    def checksum(manifests: dict[str, str]) -> str:
        deployment = Release(manifests).deployment("envoy")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    base = checksum(render({}))
    assert checksum(render({"gateway": {"replicas": 5}})) == base
    assert checksum(render({"envoy": {"tls": {"enabled": True, "existingSecret": "x"}}})) != base
    # A change to the generated config file alone rolls the pods.
    chart = tmp_path / "tokenmesh"
    shutil.copytree(CHART, chart)
    envoy = chart / "files" / "envoy-relay.yaml"  # the default's (the stream relay on)
    envoy.write_text(
        envoy.read_text().replace("stream_idle_timeout: 60s", "stream_idle_timeout: 61s")
    )
    assert checksum(render({}, chart=chart)) != base


# ---- TLS, autoscaling, monitoring


def test_tls_edge_uses_the_certificate_secret(releases: dict[str, Release]) -> None:
    release = releases["tls"]
    certificate = release.get("Certificate", f"{PREFIX}-envoy")
    assert certificate["spec"]["issuerRef"]["name"] == "ca"
    assert f"{PREFIX}-envoy.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    pod = release.deployment("envoy")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == certificate["spec"]["secretName"]
    mounts = {m["name"]: m["mountPath"] for m in release.container("envoy")["volumeMounts"]}
    assert mounts["tls"] == "/etc/envoy/tls"
    edge = next(
        item
        for item in release.envoy_config()["static_resources"]["listeners"]
        if item["name"] == "edge"
    )
    context = edge["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    assert release.envoy_certificate(context)["certificate_chain"]["filename"] == (
        "/etc/envoy/tls/tls.crt"
    )
    existing = Release(render({"envoy": {"tls": {"enabled": True, "existingSecret": "edge"}}}))
    assert existing.all("Certificate") == []
    volumes = {
        v["name"]: v for v in existing.deployment("envoy")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["tls"]["secret"]["secretName"] == "edge"
    assert releases["defaults"].all("Certificate") == []
    assert "transport_socket" not in json.dumps(releases["defaults"].envoy_config())


MTLS_SERVICES = ("gateway", "worker", "reranker")


def mtls_volume(release: Release, component: str, name: str = "mtls") -> dict[str, Any]:
    volumes = release.deployment(component)["spec"]["template"]["spec"]["volumes"]
    return dict(next(v for v in volumes if v["name"] == name))


def test_mtls_certificates_from_cert_manager_reach_envoy_and_every_service(
    releases: dict[str, Release],
) -> None:
    release = releases["mtls"]
    health_port = 8086
    for component in MTLS_SERVICES:
        certificate = release.get("Certificate", f"{PREFIX}-{component}-mtls")["spec"]
        assert certificate["issuerRef"] == {
            "name": "mesh-ca",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
        # The kind first: the DNS SAN Envoy checks; then the Services' names.
        assert certificate["dnsNames"][0] == component
        assert f"{PREFIX}-{component}-headless.{NAMESPACE}.svc" in certificate["dnsNames"]
        assert certificate["usages"] == ["digital signature", "server auth"]
        assert (
            mtls_volume(release, component)["secret"]["secretName"] == (certificate["secretName"])
        )
        prefix = f"TOKENMESH_{component.upper()}_"
        env = release.env(component)
        assert env[prefix + "TLS_CERT_FILE"] == "/etc/tokenmesh/mtls/tls.crt"
        assert env[prefix + "TLS_KEY_FILE"] == "/etc/tokenmesh/mtls/tls.key"
        assert env[prefix + "TLS_CLIENT_CA_FILE"] == "/etc/tokenmesh/mtls/ca.crt"
        assert env[prefix + "HEALTH_PORT"] == str(health_port)
        container = release.container(component)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["mtls"] == "/etc/tokenmesh/mtls"
        # Kubernetes' gRPC probes cannot do mTLS: they ask the plaintext health-only port.
        assert port_number(container, "health") == health_port
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[kind]["grpc"]["port"] == health_port, (component, kind)
    envoy = release.get("Certificate", f"{PREFIX}-envoy-mtls")["spec"]
    assert envoy["usages"] == ["digital signature", "client auth"]
    assert mtls_volume(release, "envoy")["secret"]["secretName"] == envoy["secretName"]
    # The internal listeners' certificate names the Service the gateways call.
    internal = release.get("Certificate", f"{PREFIX}-envoy-internal-mtls")["spec"]
    assert internal["usages"] == ["digital signature", "server auth"]
    assert f"{PREFIX}-envoy-internal" in internal["dnsNames"]
    volume = mtls_volume(release, "envoy", "internal-tls")
    assert volume["secret"]["secretName"] == internal["secretName"]
    assert release.env("gateway")["TOKENMESH_GATEWAY_DEPENDENCY_TLS_CA_FILE"] == (
        "/etc/tokenmesh/mtls/ca.crt"
    )
    assert f"{PREFIX}-envoy-internal:" in release.env("gateway")["TOKENMESH_GATEWAY_WORKER_ADDRESS"]
    mounts = {m["name"]: m["mountPath"] for m in release.container("envoy")["volumeMounts"]}
    assert mounts["mtls"] == "/etc/envoy/mtls" and mounts["tls"] == "/etc/envoy/tls"
    assert mounts["internal-tls"] == "/etc/envoy/internal-tls"
    listeners = {
        item["name"]: item["filter_chains"][0]
        for item in release.envoy_config()["static_resources"]["listeners"]
    }
    for name in ("worker", "reranker"):
        context = listeners[name]["transport_socket"]["typed_config"]["common_tls_context"]
        assert context["alpn_protocols"] == ["h2"]
        assert release.envoy_certificate(context)["certificate_chain"]["filename"] == (
            "/etc/envoy/internal-tls/tls.crt"
        )
    clusters = {c["name"]: c for c in release.envoy_config()["static_resources"]["clusters"]}
    context = clusters["worker"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert release.envoy_certificate(context)["certificate_chain"]["filename"] == (
        "/etc/envoy/mtls/tls.crt"
    )
    ca = release.envoy_secret(
        context["combined_validation_context"]["validation_context_sds_secret_config"]
    )
    assert ca["validation_context"]["trusted_ca"]["filename"] == "/etc/envoy/mtls/ca.crt"
    # The control plane's port stays plaintext (Envoy's xDS), but its ops feed calls the
    # workers, whose ports want a client certificate: one of its own, from the same issuer.
    controlplane = release.get("Certificate", f"{PREFIX}-controlplane-mtls")["spec"]
    assert controlplane["usages"] == ["digital signature", "client auth"]
    assert controlplane["issuerRef"]["name"] == "mesh-ca"
    volume = mtls_volume(release, "controlplane")
    assert volume["secret"]["secretName"] == controlplane["secretName"]
    mounts = {m["name"]: m for m in release.container("controlplane")["volumeMounts"]}
    assert mounts["mtls"] == {"name": "mtls", "mountPath": "/etc/tokenmesh/mtls", "readOnly": True}
    env = release.env("controlplane")
    assert {name: value for name, value in env.items() if "TLS" in name} == {
        "TOKENMESH_CONTROLPLANE_WORKER_TLS_CA_FILE": "/etc/tokenmesh/mtls/ca.crt",
        "TOKENMESH_CONTROLPLANE_WORKER_TLS_CERT_FILE": "/etc/tokenmesh/mtls/tls.crt",
        "TOKENMESH_CONTROLPLANE_WORKER_TLS_KEY_FILE": "/etc/tokenmesh/mtls/tls.key",
    }
    fields = ControlPlaneSettings.model_fields
    for name in ("worker_tls_ca_file", "worker_tls_cert_file", "worker_tls_key_file"):
        assert name in fields  # the variables above are settings the service reads
    # The name the feed checks on the workers' certificates (it dials pod IPs) is theirs.
    worker = release.get("Certificate", f"{PREFIX}-worker-mtls")["spec"]
    assert fields["worker_tls_server_name"].default == worker["dnsNames"][0]
    # Without mTLS the feed dials plaintext and mounts nothing.
    defaults = releases["defaults"]
    assert not any("TLS" in name for name in defaults.env("controlplane"))
    assert "mtls" not in json.dumps(defaults.deployment("controlplane"))


def test_mtls_from_an_existing_secret_mounts_each_components_files(
    releases: dict[str, Release],
) -> None:
    release = releases["mtls-secret"]
    assert release.all("Certificate") == []
    # The control plane's ops feed presents the Secret's one client certificate, Envoy's.
    volumes = (
        *((c, c, "mtls") for c in MTLS_SERVICES),
        ("envoy", "envoy-client", "mtls"),
        ("envoy", "envoy", "internal-tls"),
        ("controlplane", "envoy-client", "mtls"),
    )
    for component, file, name in volumes:
        secret = mtls_volume(release, component, name)["secret"]
        assert secret["secretName"] == "tokenmesh-mtls"
        assert secret["items"] == [
            {"key": f"{file}.crt", "path": "tls.crt"},
            {"key": f"{file}.key", "path": "tls.key"},
            {"key": "ca.crt", "path": "ca.crt"},
        ]
    # Without mTLS: no mounts, probes on the gRPC port (test_python_services_have_grpc_...).
    defaults = releases["defaults"]
    assert "mtls" not in json.dumps(defaults.deployment("worker"))
    assert "mtls" not in json.dumps(defaults.deployment("envoy"))


def keys_volume(release: Release) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The gateway pod's keys volume and its mount (None, None without them)."""
    pod = release.deployment("gateway")["spec"]["template"]["spec"]
    volume = next((v for v in pod["volumes"] if v["name"] == "keys"), None)
    mounts = release.container("gateway")["volumeMounts"]
    return volume, next((m for m in mounts if m["name"] == "keys"), None)


def test_api_keys_are_on_by_default_from_a_secret_the_gateway_can_reload(
    releases: dict[str, Release],
) -> None:
    release = releases["defaults"]
    secret = release.get("Secret", f"{PREFIX}-gateway-keys")
    keys = KeysFile.model_validate_json(secret["stringData"]["keys.json"])
    assert keys.tenants == {}  # every call refused until a tenant is added
    assert release.env("gateway")["TOKENMESH_GATEWAY_KEYS_FILE"] == "/etc/tokenmesh/keys/keys.json"
    volume, mount = keys_volume(release)
    assert volume is not None and mount is not None
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    # A directory mount (no subPath): the kubelet's Secret updates reach the running gateway.
    assert mount == {"name": "keys", "mountPath": "/etc/tokenmesh/keys", "readOnly": True}
    notes = release.manifests["tokenmesh/templates/NOTES.txt"]
    assert '-H "authorization: Bearer $TOKENMESH_KEY"' in notes and "no tenants yet" in notes
    # Tenants and limits from values: a keys file the gateway accepts, hashes only.
    digest = "ab" * 32
    tenants = {"acme": {"key_sha256": [digest], "limits": {"requests_per_second": 5}}}
    values = {"gateway": {"auth": {"keys": {"defaults": {"burst": 2}, "tenants": tenants}}}}
    configured = Release(render(values)).get("Secret", f"{PREFIX}-gateway-keys")
    keys = KeysFile.model_validate_json(configured["stringData"]["keys.json"])
    assert keys.resolved("acme").limits == Limits(requests_per_second=5, burst=2)
    # An existing Secret: none made by the chart, that one mounted.
    existing = releases["keys-secret"]
    assert not existing.has("Secret", f"{PREFIX}-gateway-keys")
    volume, _ = keys_volume(existing)
    assert volume is not None and volume["secret"]["secretName"] == "tenant-keys"
    assert volume["secret"]["items"] == [{"key": "keys", "path": "keys"}]
    assert existing.env("gateway")["TOKENMESH_GATEWAY_KEYS_FILE"] == "/etc/tokenmesh/keys/keys"
    # Turned off: no keys file, no Secret, no volume.
    off = Release(render({"gateway": {"auth": {"enabled": False}}}))
    assert "TOKENMESH_GATEWAY_KEYS_FILE" not in off.env("gateway")
    assert off.all("Secret") == [] and keys_volume(off) == (None, None)
    assert "Bearer" not in off.manifests["tokenmesh/templates/NOTES.txt"]


def test_autoscalers_target_gateway_cpu_and_worker_queue(releases: dict[str, Release]) -> None:
    release = releases["hpa-monitoring"]
    gateway = release.get("HorizontalPodAutoscaler", f"{PREFIX}-gateway")
    assert (
        gateway["spec"]["scaleTargetRef"]["name"]
        == release.deployment("gateway")["metadata"]["name"]
    )
    assert gateway["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    worker = release.get("HorizontalPodAutoscaler", f"{PREFIX}-worker")
    assert worker["spec"]["scaleTargetRef"]["name"] == f"{PREFIX}-worker"
    metric = worker["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "tokenmesh_worker_waiting_requests"
    # The autoscaler owns the replica count.
    assert "replicas" not in release.deployment("gateway")["spec"]
    assert "replicas" not in release.deployment("worker")["spec"]
    assert releases["defaults"].all("HorizontalPodAutoscaler") == []


def test_service_monitors_scrape_every_component_as_the_dashboards_expect(
    releases: dict[str, Release],
) -> None:
    release = releases["hpa-monitoring"]
    monitors = release.all("ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {
        f"{PREFIX}-{c}" for c in (*PYTHON_COMPONENTS, "envoy")
    }
    services = release.all("Service")
    for monitor in monitors:
        component = monitor["metadata"]["name"].removeprefix(f"{PREFIX}-")
        endpoint = monitor["spec"]["endpoints"][0]
        matched = [
            s
            for s in services
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
            and endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert len(matched) == 1, component
        assert {"targetLabel": "service", "replacement": component} in endpoint["relabelings"]
    worker = next(m for m in monitors if m["metadata"]["name"] == f"{PREFIX}-worker")
    assert worker["spec"]["endpoints"][0]["metricRelabelings"][0]["replacement"] == "vllm:$1"
    envoy = next(m for m in monitors if m["metadata"]["name"] == f"{PREFIX}-envoy")
    assert envoy["spec"]["endpoints"][0]["path"] == "/stats/prometheus"
    rules = release.get("PrometheusRule", f"{PREFIX}-alerts")
    alerts = yaml.safe_load((ROOT / "prometheus" / "alerts.yml").read_text())
    assert rules["spec"]["groups"] == alerts["groups"]
    # Asked for, but the cluster has no Prometheus Operator: nothing that would fail to apply.
    values, _ = VALUE_SETS["hpa-monitoring"]
    without_crds = Release(render(values))
    assert without_crds.all("ServiceMonitor") == [] and without_crds.all("PrometheusRule") == []


def test_dashboards_ship_for_the_grafana_sidecar(releases: dict[str, Release]) -> None:
    configmap = releases["defaults"].get("ConfigMap", f"{PREFIX}-dashboards")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    expected = {path.name for path in (ROOT / "dashboards").glob("*.json")}
    assert set(configmap["data"]) == expected
    for name, text in configmap["data"].items():
        assert json.loads(text) == json.loads((ROOT / "dashboards" / name).read_text())


def test_notes_say_how_to_reach_the_edge(releases: dict[str, Release]) -> None:
    notes = releases["defaults"].manifests["tokenmesh/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{PREFIX}-envoy 8080:8080" in notes
    assert "grpcurl -plaintext" in notes and "tokenmesh.v1.LLMService/Generate" in notes
    # Admin listens on the pod's loopback only: reached through the pod, not a Service.
    assert f"port-forward deploy/{PREFIX}-envoy 9901:9901" in notes
    tls_notes = releases["tls"].manifests["tokenmesh/templates/NOTES.txt"]
    assert "grpcurl -insecure" in tls_notes and "https://" in tls_notes


# ---- names


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_sets(item: dict[str, Any]) -> Iterator[dict[str, str]]:
    """An object's labels, its pod template's and its selector's."""
    yield item["metadata"].get("labels", {})
    spec = item.get("spec") or {}
    if isinstance(spec, dict):
        yield spec.get("template", {}).get("metadata", {}).get("labels", {})
        selector = spec.get("selector") or {}
        yield selector.get("matchLabels", selector if item["kind"] == "Service" else {})


def test_every_name_and_label_fits_for_the_longest_release_name(
    releases: dict[str, Release],
) -> None:
    assert len(LONG_RELEASE) == 53
    release = releases["long-release"]
    kinds = {o["kind"] for o in release.objects}
    assert {
        "Certificate",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
        "ScaledObject",
        "ServiceAccount",
        "ServiceMonitor",
    } <= kinds
    names = [(o["kind"], o["metadata"]["name"]) for o in release.objects]
    assert len(set(names)) == len(names), "two objects of a kind share a name"
    for kind, name in names:
        assert len(name) <= 63 and DNS_LABEL.match(name), (kind, name)
    for item in release.objects:
        for labels in label_sets(item):
            for key, value in labels.items():
                assert len(str(value)) <= 63 and LABEL_VALUE.match(str(value)), (key, value)
    # Names built on a component's name elsewhere: Secrets, KEDA's own HPA, DNS names.
    for certificate in release.all("Certificate"):
        assert len(certificate["spec"]["secretName"]) <= 63
    scaled = release.all("ScaledObject")[0]["metadata"]["name"]
    assert len(f"keda-hpa-{scaled}") <= 63
    # Every name one object gives another is one the chart made.
    services = {s["metadata"]["name"] for s in release.all("Service")}
    deployments = {d["metadata"]["name"]: d for d in release.all("Deployment")}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert release.has("ServiceAccount", pod["serviceAccountName"])
        for container in pod["containers"]:
            for variable in container.get("env", []):
                if variable["name"].endswith(("_WORKER_ADDRESS", "_RERANKER_ADDRESS")):
                    assert variable["value"].rpartition(":")[0] in services
                if variable["name"] == "TOKENMESH_CONTROLPLANE_DNS_TARGETS":
                    for target in json.loads(variable["value"]).values():
                        assert target.split(".")[0] in services
        for volume in pod["volumes"]:
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert release.has("PersistentVolumeClaim", claim)
    assert release.all("ScaledObject")[0]["spec"]["scaleTargetRef"]["name"] in deployments
    # The prefix is cut, not the component's part of the name, and ends in a hash of the whole.
    prefix = long_prefix(LONG_RELEASE)
    assert len(prefix) <= 41 and prefix != LONG_RELEASE[:41]
    assert f"{prefix}-controlplane-headless" in services
    assert f"{prefix}-worker" in deployments


def long_prefix(release: str) -> str:
    """The names' prefix for a release name whose <release>-tokenmesh is over 41 characters."""
    fullname = f"{release}-tokenmesh"
    return f"{fullname[:35].rstrip('-')}-{hashlib.sha256(fullname.encode()).hexdigest()[:5]}"


def test_release_names_that_differ_only_at_the_end_get_names_of_their_own(
    releases: dict[str, Release],
) -> None:
    """Blue/green releases in one namespace: names cut to fit still differ."""
    blue = releases["long-release"]
    green_name = LONG_RELEASE[:-1] + "2"
    assert green_name[:41] == LONG_RELEASE[:41]
    green = Release(render(VALUE_SETS["long-release"][0], OPERATOR_APIS, release=green_name))
    for kind in ("Deployment", "Service", "PersistentVolumeClaim", "ScaledObject", "Certificate"):
        blue_names = {o["metadata"]["name"] for o in blue.all(kind)}
        green_names = {o["metadata"]["name"] for o in green.all(kind)}
        assert blue_names and not blue_names & green_names, kind
    assert green.has("Deployment", f"{long_prefix(green_name)}-worker")
    # A short release name keeps its plain prefix.
    assert releases["defaults"].has("Deployment", f"{PREFIX}-worker")


def test_a_release_name_starting_with_a_digit_is_refused_with_the_reason() -> None:
    """Service names are DNS-1035 labels: they start with a letter."""
    with pytest.raises(helm_python.HelmRenderError, match="must start with a lowercase letter"):
        render({}, release="1prod")
    # fullnameOverride gives such a release valid names.
    named = Release(render({"fullnameOverride": "prod-tokenmesh"}, release="1prod"))
    for service in named.all("Service"):
        assert DNS_LABEL.match(service["metadata"]["name"]), service["metadata"]["name"]


# ---- probes and shutdown


PROBES = {"startupProbe": "startup", "readinessProbe": "readiness", "livenessProbe": "liveness"}


def test_probe_timings_come_from_values(releases: dict[str, Release]) -> None:
    for value_set, values in (
        ("extensions", VALUE_SETS["extensions"][0]),
        ("defaults", DEFAULTS),
    ):
        release = releases[value_set]
        for component in PYTHON_COMPONENTS:
            container = release.container(component)
            for kind, key in PROBES.items():
                expected = values[component]["probes"][key]
                assert {k: container[kind][k] for k in expected} == expected, (component, kind)
    # By default a saturated worker, whose health check answers in a few seconds, stays ready
    # and alive; a hung one is restarted within minutes; the model gets half an hour to load.
    worker = releases["defaults"].container("worker")
    for kind in PROBES:
        assert worker[kind]["timeoutSeconds"] >= 5, kind
    liveness = worker["livenessProbe"]
    assert 60 <= liveness["periodSeconds"] * liveness["failureThreshold"] <= 300
    assert liveness["timeoutSeconds"] >= 10
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


SETTINGS = {
    "gateway": GatewaySettings,
    "worker": WorkerSettings,
    "reranker": RerankerSettings,
    "controlplane": ControlPlaneSettings,
}


def test_termination_grace_covers_prestop_drain_service_grace_and_margin(
    releases: dict[str, Release],
) -> None:
    for value_set, values in (
        ("extensions", VALUE_SETS["extensions"][0]),
        ("defaults", DEFAULTS),
    ):
        release = releases[value_set]
        for component in PYTHON_COMPONENTS:
            shutdown = values[component]["shutdown"]
            settings = SETTINGS[component]
            # The settings the service really reads for its drain and grace.
            prefix = settings.model_config["env_prefix"]
            assert {"drain_seconds", "grace_seconds"} <= set(settings.model_fields)
            assert release.env(component)[f"{prefix}GRACE_SECONDS"] == str(shutdown["graceSeconds"])
            assert release.env(component)[f"{prefix}DRAIN_SECONDS"] == str(shutdown["drainSeconds"])
            needed = (
                shutdown["preStopSleepSeconds"]
                + shutdown["drainSeconds"]
                + shutdown["graceSeconds"]
                + shutdown["marginSeconds"]
            )
            pod = release.deployment(component)["spec"]["template"]["spec"]
            period = pod["terminationGracePeriodSeconds"]
            assert period == (shutdown["terminationGracePeriodSeconds"] or needed)
            assert period >= needed
            container = release.container(component)
            if shutdown["preStopSleepSeconds"]:
                assert container["lifecycle"]["preStop"]["exec"]["command"] == [
                    "sleep",
                    str(shutdown["preStopSleepSeconds"]),
                ]
            else:
                assert "lifecycle" not in container
    # Generations get a long grace by default, and vLLM time to stop after it.
    worker = DEFAULTS["worker"]["shutdown"]
    assert worker["graceSeconds"] >= 30 and worker["marginSeconds"] >= 10
    # The preStop sleep outlasts the removal path: the DNS answer's TTL (5 s), the control
    # plane's poll (discovery.pollSeconds) and the xDS push to Envoy.
    assert worker["preStopSleepSeconds"] >= 5 + DEFAULTS["discovery"]["pollSeconds"] + 2


# ---- chart upgrades


def test_a_chart_bump_restarts_no_pod(releases: dict[str, Release], tmp_path: Path) -> None:
    for release in releases.values():
        for deployment in release.all("Deployment"):
            template = deployment["spec"]["template"]["metadata"]
            keys = set(template.get("labels", {})) | set(template.get("annotations", {}))
            assert not keys & {"helm.sh/chart", "app.kubernetes.io/version"}
            assert {"helm.sh/chart", "app.kubernetes.io/version"} <= set(
                deployment["metadata"]["labels"]
            )
    chart = tmp_path / "tokenmesh"
    shutil.copytree(CHART, chart)
    meta = chart / "Chart.yaml"
    meta.write_text(re.sub(r"(?m)^version: .*$", "version: 9.9.9", meta.read_text()))
    before = releases["defaults"]
    after = Release(render({}, chart=chart))
    for deployment in before.all("Deployment"):
        bumped = after.get("Deployment", deployment["metadata"]["name"])
        assert bumped["metadata"]["labels"]["helm.sh/chart"] == "tokenmesh-9.9.9"
        assert bumped["spec"]["template"] == deployment["spec"]["template"]


# ---- model storage and rollouts


def worker_volumes(release: Release) -> dict[str, dict[str, Any]]:
    pod = release.deployment("worker")["spec"]["template"]["spec"]
    return {v["name"]: v for v in pod["volumes"]}


def test_model_storage_is_an_emptydir_a_chart_claim_or_an_existing_claim(
    releases: dict[str, Release],
) -> None:
    # emptyDir: its size limit, and a request of its own so the node has the disk; both fit
    # the boot disks of GPU node pools (EKS's 20 GiB, GKE's 100 GB) by default.
    release = releases["defaults"]
    volumes = worker_volumes(release)
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert release.container("worker")["resources"]["requests"]["ephemeral-storage"] == "10Gi"
    assert release.all("PersistentVolumeClaim") == []
    sized = Release(
        render(
            {
                "worker": {
                    "model": {"storage": {"emptyDir": {"sizeLimit": "80Gi", "request": "60Gi"}}}
                }
            }
        )
    )
    assert worker_volumes(sized)["cache"]["emptyDir"] == {"sizeLimit": "80Gi"}
    assert sized.container("worker")["resources"]["requests"]["ephemeral-storage"] == "60Gi"
    cpu = releases["cpu"]
    assert worker_volumes(cpu)["cache"]["emptyDir"] == {"sizeLimit": "2Gi"}
    # A claim the chart makes, shared by every worker: the hub's cache is on it.
    release = releases["pvc"]
    claim = release.get("PersistentVolumeClaim", f"{PREFIX}-worker-models")
    # helm uninstall keeps the claim and the weights downloaded onto it.
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "shared-files",
        "resources": {"requests": {"storage": "500Gi"}},
    }
    assert worker_volumes(release)["cache"]["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"]
    }
    mounts = {m["name"]: m["mountPath"] for m in release.container("worker")["volumeMounts"]}
    assert mounts["cache"] == "/cache"
    assert release.env("worker")["HF_HOME"] == "/cache/huggingface"
    # Only /tmp stays on the node's disk: a small request.
    assert release.container("worker")["resources"]["requests"]["ephemeral-storage"] == "2Gi"
    # The kubelet chowns the cache to fsGroup only when its root is not already owned by it.
    context = release.deployment("worker")["spec"]["template"]["spec"]["securityContext"]
    assert context["fsGroup"] == DEFAULTS["podSecurityContext"]["fsGroup"]
    assert context["fsGroupChangePolicy"] == "OnRootMismatch"
    # The cluster's default StorageClass unless one is named.
    default_class = Release(render({"worker": {"model": {"storage": {"type": "pvc"}}}}))
    spec = default_class.get("PersistentVolumeClaim", f"{PREFIX}-worker-models")["spec"]
    assert "storageClassName" not in spec and spec["accessModes"] == ["ReadWriteOnce"]
    # An existing claim (multi-gpu): read-only, the compile caches on an emptyDir, which needs
    # only a small request.
    volumes = worker_volumes(releases["multi-gpu"])
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
    assert "emptyDir" in volumes["cache"]
    requests = releases["multi-gpu"].container("worker")["resources"]["requests"]
    assert requests["ephemeral-storage"] == "2Gi"


def test_worker_memory_and_shared_memory_come_from_values(releases: dict[str, Release]) -> None:
    # The defaults: one GPU's worth (gpu.perGpu); the CPU values set their own.
    for value_set, shm, memory in (("defaults", "8Gi", "64Gi"), ("cpu", "1Gi", "6Gi")):
        release = releases[value_set]
        dshm = worker_volumes(release)["dshm"]["emptyDir"]
        assert dshm == {"medium": "Memory", "sizeLimit": shm}
        assert release.container("worker")["resources"]["limits"]["memory"] == memory
    release = releases["extensions"]
    assert worker_volumes(release)["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"
    assert release.container("worker")["resources"]["limits"]["memory"] == "4Gi"


def test_workers_roll_without_a_spare_gpu_by_default(releases: dict[str, Release]) -> None:
    strategy = releases["defaults"].deployment("worker")["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    configured = releases["extensions"].deployment("worker")["spec"]["strategy"]
    assert configured["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # Recreate: the default rollingUpdate, merged in by Helm, is left out (the API server
    # refuses a Recreate strategy that has one).
    recreate = Release(render({"worker": {"updateStrategy": {"type": "Recreate"}}}))
    assert recreate.deployment("worker")["spec"]["strategy"] == {"type": "Recreate"}


# ---- extension points


def test_every_component_takes_the_pod_extension_points(releases: dict[str, Release]) -> None:
    values, _ = VALUE_SETS["extensions"]
    release = releases["extensions"]
    for component in (*PYTHON_COMPONENTS, "envoy"):
        expected = values[component]
        template = release.deployment(component)["spec"]["template"]
        pod = template["spec"]
        container = release.container(component)
        assert template["metadata"]["annotations"]["example.com/team"] == "llm"
        assert template["metadata"]["labels"]["example.com/tier"] == component
        assert pod["priorityClassName"] == "inference-high"
        assert pod.get("runtimeClassName") == ("nvidia" if component == "worker" else None)
        for key in ("nodeSelector", "tolerations", "affinity"):
            assert pod[key] == expected[key], (component, key)
        # A constraint without a labelSelector spreads the component's own pods.
        [spread] = pod["topologySpreadConstraints"]
        selector = spread.pop("labelSelector")["matchLabels"]
        assert spread == expected["topologySpreadConstraints"][0]
        assert selects(selector, pod_labels(release, component))
        assert not selects(
            selector, pod_labels(release, "gateway" if component != "gateway" else "worker")
        )
        for variable in expected["extraEnv"]:
            assert variable in container["env"], (component, variable)
        assert expected["extraVolumes"][0] in pod["volumes"]
        assert expected["extraVolumeMounts"][0] in container["volumeMounts"]
        for section, wanted in expected["resources"].items():
            assert wanted.items() <= container["resources"][section].items(), component
        assert pod["serviceAccountName"] == f"{component}-account"
        assert pod["automountServiceAccountToken"] is False
        account = release.get("ServiceAccount", f"{component}-account")
        assert account["metadata"]["annotations"] == {"iam.example.com/role": component}
        assert account["automountServiceAccountToken"] is False
    # Envoy keeps its config checksum beside the pod annotations.
    envoy = release.deployment("envoy")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/config" in envoy
    # Defaults: a ServiceAccount per component; workers and gateways spread over nodes and
    # zones where they can.
    defaults = releases["defaults"]
    for component in (*PYTHON_COMPONENTS, "envoy"):
        pod = defaults.deployment(component)["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == f"{PREFIX}-{component}"
        account = defaults.get("ServiceAccount", f"{PREFIX}-{component}")
        assert account["automountServiceAccountToken"] is False
        spread = pod.get("topologySpreadConstraints", [])
        if component in ("worker", "gateway"):
            assert {c["topologyKey"] for c in spread} == {
                "kubernetes.io/hostname",
                "topology.kubernetes.io/zone",
            }
            for constraint in spread:
                assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"
                assert selects(
                    constraint["labelSelector"]["matchLabels"], pod_labels(defaults, component)
                )
        else:
            assert spread == []
    # An existing ServiceAccount: none made.
    existing = Release(render({"gateway": {"serviceAccount": {"create": False, "name": "gw"}}}))
    assert not existing.has("ServiceAccount", f"{PREFIX}-gateway")
    assert existing.deployment("gateway")["spec"]["template"]["spec"]["serviceAccountName"] == "gw"


# ---- autoscaling with KEDA


def test_keda_scales_workers_on_queue_depth_and_ttft(releases: dict[str, Release]) -> None:
    release = releases["keda"]
    scaled = release.get("ScaledObject", f"{PREFIX}-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": release.deployment("worker")["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 6)
    # KEDA owns the workers' replica count; the gateways keep their CPU autoscaler.
    assert "replicas" not in release.deployment("worker")["spec"]
    assert [h["metadata"]["name"] for h in release.all("HorizontalPodAutoscaler")] == [
        f"{PREFIX}-gateway"
    ]
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"queue", "ttft"}
    series = f'namespace="{NAMESPACE}",job="{PREFIX}-worker-headless"'
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert metadata["serverAddress"] == DEFAULTS["worker"]["keda"]["serverAddress"]
        assert isinstance(metadata["threshold"], str) and float(metadata["threshold"]) > 0
        assert series in metadata["query"]
        # No series (nothing scrapes the workers) is an error KEDA reports, not a quiet 0.
        assert metadata["ignoreNullValues"] == "false"
        assert "vector(" not in metadata["query"]
    queue = triggers["queue"]
    assert queue["metricType"] == "AverageValue"
    assert queue["metadata"]["query"] == f"sum(tokenmesh_worker_waiting_requests{{{series}}})"
    ttft = triggers["ttft"]
    assert ttft["metricType"] == "Value"
    query = ttft["metadata"]["query"]
    assert "histogram_quantile(0.9, sum by (le) (rate(tokenmesh_ttft_seconds_bucket{" in query
    # No traffic: 0, computed from the workers' own series (empty when there are none).
    assert query.endswith(f" or (sum(rate(tokenmesh_ttft_seconds_count{{{series}}}[2m])) * 0)")
    # The series come from the workers' ServiceMonitor, which the value set turns on.
    assert release.has("ServiceMonitor", f"{PREFIX}-worker")
    # The names the worker really exports.
    assert (
        '"tokenmesh_worker_waiting_requests"'
        in (ROOT / "services" / "tokenmesh" / "worker" / "app.py").read_text()
    )
    registry = CollectorRegistry()
    StreamMetrics(registry)
    assert "tokenmesh_ttft_seconds" in {family.name for family in registry.collect()}
    # The behaviour is a valid HPA behaviour: add workers one at a time, remove them slowly.
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = json.loads(json.dumps(release.get("HorizontalPodAutoscaler", f"{PREFIX}-gateway")))
    hpa["spec"]["behavior"] = behavior
    kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    # The queue alone by default; a query of one's own.
    own = Release(
        render({"worker": {"keda": {"enabled": True, "queue": {"query": "sum(my_queue)"}}}})
    )
    [trigger] = own.get("ScaledObject", f"{PREFIX}-worker")["spec"]["triggers"]
    assert trigger["metadata"]["query"] == "sum(my_queue)"
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    assert releases["defaults"].all("ScaledObject") == []


# ---- combinations that can never work


IMPOSSIBLE: list[tuple[dict[str, Any], str]] = [
    (
        {"discovery": {"mode": "consul"}, "mtls": {"enabled": True, "existingSecret": "m"}},
        "discovery.mode=consul cannot be combined with mtls.enabled",
    ),
    (
        {"worker": {"autoscaling": {"enabled": True}, "keda": {"enabled": True}}},
        "worker.autoscaling.enabled and worker.keda.enabled cannot both be on",
    ),
    (
        {"worker": {"keda": {"enabled": True, "queue": {"enabled": False}}}},
        "worker.keda.enabled needs a trigger",
    ),
    (
        {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        r"gateway.autoscaling.minReplicas \(5\) is above maxReplicas \(2\)",
    ),
    (
        {"worker": {"keda": {"enabled": True, "minReplicaCount": 3, "maxReplicaCount": 2}}},
        r"worker.keda.minReplicaCount \(3\) is above maxReplicaCount \(2\)",
    ),
    (
        {"worker": {"updateStrategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}}},
        "maxSurge and maxUnavailable cannot both be 0",
    ),
    (
        {
            "worker": {
                "updateStrategy": {"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": "0%"}}
            }
        },
        "maxSurge and maxUnavailable cannot both be 0",
    ),
    (
        {"worker": {"updateStrategy": {"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": 0}}}},
        "maxSurge and maxUnavailable cannot both be 0",
    ),
    (
        {"worker": {"keda": {"enabled": True}}},
        "worker.keda.enabled needs monitoring.serviceMonitor.enabled",
    ),
    (
        {
            "worker": {
                "keda": {
                    "enabled": True,
                    "queue": {"query": "sum(my_queue)"},
                    "ttft": {"enabled": True},
                }
            }
        },
        "worker.keda.enabled needs monitoring.serviceMonitor.enabled",
    ),
    (
        {"worker": {"model": {"storage": {"type": "existingClaim"}}}},
        "needs worker.model.storage.existingClaim.claimName",
    ),
    (
        {
            "worker": {
                "replicas": 2,
                "model": {"storage": {"type": "pvc", "pvc": {"accessMode": "ReadWriteOncePod"}}},
            }
        },
        "accessMode=ReadWriteOncePod mounts the claim in one pod only",
    ),
    (
        {"worker": {"replicas": 2, "model": {"storage": {"type": "pvc"}}}},
        r"accessMode=ReadWriteOnce mounts the claim on one node only, but worker.replicas allows 2",
    ),
    (
        {
            "worker": {
                "autoscaling": {"enabled": True, "maxReplicas": 3},
                "model": {"storage": {"type": "pvc"}},
            }
        },
        r"ReadWriteOnce .* but worker.autoscaling.maxReplicas allows 3 workers: .*Multi-Attach",
    ),
    (
        {
            "monitoring": {"serviceMonitor": {"enabled": True}},
            "worker": {"keda": {"enabled": True}, "model": {"storage": {"type": "pvc"}}},
        },
        r"ReadWriteOnce .* but worker.keda.maxReplicaCount allows 4 workers",
    ),
    (
        {"worker": {"shmSize": "64Gi"}},
        r"worker.shmSize \(64Gi\) must be below the worker's memory limit \(64Gi\)",
    ),
    ({"gateway": {"metricsPort": 50051}}, r"gateway: metricsPort and port are the same port"),
    (
        {"mtls": {"enabled": True, "existingSecret": "m", "healthPort": 9461}},
        r"worker: metricsPort and mtls.healthPort are the same port \(9461\)",
    ),
    (
        {"worker": {"shutdown": {"terminationGracePeriodSeconds": 30}}},
        r"worker.shutdown.terminationGracePeriodSeconds \(30\) is below .* \(91\)",
    ),
    (
        {"gateway": {"env": {"TOKENMESH_GATEWAY_GRACE_SECONDS": "5"}}},
        "set TOKENMESH_GATEWAY_GRACE_SECONDS with shutdown.graceSeconds",
    ),
    (
        {"reranker": {"env": {"TOKENMESH_RERANKER_DRAIN_SECONDS": "0"}}},
        "set TOKENMESH_RERANKER_DRAIN_SECONDS with shutdown.graceSeconds or drainSeconds",
    ),
    (
        {"worker": {"extraEnv": [{"name": "TOKENMESH_WORKER_GRACE_SECONDS", "value": "5"}]}},
        "set TOKENMESH_WORKER_GRACE_SECONDS with shutdown.graceSeconds or drainSeconds, not "
        "extraEnv",
    ),
    (
        {"envoy": {"workerRouting": {"policy": "picker"}}, "controlplane": {"enabled": False}},
        "envoy.workerRouting.policy=picker needs controlplane.enabled",
    ),
    (
        {
            "envoy": {
                "workerRouting": {
                    "policy": "picker",
                    "picker": {"staleSeconds": 0.2, "feedIntervalMs": 200},
                }
            }
        },
        r"picker.staleSeconds \(0.2\) must exceed feedIntervalMs \(200 ms\)",
    ),
    (
        {"gateway": {"env": {"TOKENMESH_GATEWAY_PICKER__SLACK_STREAMS": "0"}}},
        "set TOKENMESH_GATEWAY_PICKER__SLACK_STREAMS with envoy.workerRouting .*, not gateway.env",
    ),
    (
        {
            "envoy": {"workerRouting": {"policy": "picker"}},
            "gateway": {
                "extraEnv": [{"name": "TOKENMESH_GATEWAY_PICKER__FEED_ADDRESS", "value": "cp:1"}]
            },
        },
        "set TOKENMESH_GATEWAY_PICKER__FEED_ADDRESS with envoy.workerRouting .*, not "
        "gateway.extraEnv",
    ),
    (
        {"reranker": {"podLabels": {"app.kubernetes.io/component": "x"}}},
        "reranker.podLabels may not set app.kubernetes.io/component",
    ),
    (
        {"envoy": {"healthChecks": {"timeoutSeconds": 0.0004}}},
        r"envoy.healthChecks.timeoutSeconds \(0.0004\) must be a whole number of milliseconds",
    ),
    (
        {"envoy": {"healthChecks": {"intervalSeconds": 0.2505}}},
        r"envoy.healthChecks.intervalSeconds \(0.2505\) must be a whole number of milliseconds",
    ),
]


@pytest.mark.parametrize(("values", "message"), IMPOSSIBLE)
def test_combinations_that_cannot_work_fail_with_the_reason(
    values: dict[str, Any], message: str
) -> None:
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(values)  # refused by the templates, not the schema
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


def test_the_adapter_admin_api_takes_its_keys_from_an_existing_secret(
    releases: dict[str, Release],
) -> None:
    assert "TOKENMESH_CONTROLPLANE_ADMIN_KEYS_FILE" not in releases["defaults"].env("controlplane")
    release = releases["keys-secret"]
    env = release.env("controlplane")
    assert env["TOKENMESH_CONTROLPLANE_ADMIN_KEYS_FILE"] == "/etc/tokenmesh/admin/admin-keys"
    pod = release.deployment("controlplane")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "admin-keys")
    assert volume["secret"] == {
        "secretName": "tokenmesh-admin",
        "items": [{"key": "admin-keys", "path": "admin-keys"}],
    }
    # A directory mount (no subPath): a rotated key reaches the running control plane.
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "admin-keys", "mountPath": "/etc/tokenmesh/admin", "readOnly": True} in mounts
