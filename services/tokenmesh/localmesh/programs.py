"""The processes of a local mesh, each tokenmesh service's from its own settings class."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenmesh.common.pools import pool_cluster
from tokenmesh.common.settings import ServiceSettings
from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.localmesh.certs import ENVOY_CLIENT
from tokenmesh.localmesh.environment import build, environment
from tokenmesh.localmesh.layout import MeshFiles, Tools
from tokenmesh.localmesh.relay_module import SEARCH_PATH
from tokenmesh.localmesh.settings import LocalMeshSettings, WorkerPool
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.worker.config import WorkerSettings


@dataclass(frozen=True)
class Program:
    """One supervised process; `service` is the Envoy cluster it belongs to, if any."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # The gRPC port whose grpc.health.v1 says when the process is ready (None: see `ready`).
    port: int | None = None
    metrics_port: int | None = None
    service: str | None = None
    # Seconds supervisord waits after SIGTERM before SIGKILL: the grace period plus shutdown.
    stop_wait_seconds: int = 30
    # For processes without gRPC health: an HTTP URL that answers 200 once ready.
    ready_url: str | None = None
    # The port speaks only mTLS: health checks present Envoy's client certificate.
    mtls: bool = False
    # A gateway's OpenAI HTTP API port (Envoy's cluster `openai`).
    openai_port: int | None = None
    # A tokenmesh service's settings, which `env` is written from.
    settings: ServiceSettings | None = None
    # A worker's pool ("": the default pool, the cluster `worker`).
    pool: str = ""

    @property
    def cluster(self) -> str | None:
        """The Envoy cluster it is an endpoint of: its service's (a worker's pool's)."""
        return pool_cluster(self.pool) if self.service == "worker" else self.service

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def service_program(
    python: str,
    service: str,
    settings: ServiceSettings,
    replica: int | None = None,
    openai_port: int | None = None,
) -> Program:
    """`python -m tokenmesh.<service>` with settings as its environment."""
    return Program(
        name=service if replica is None else f"{service}-{replica}",
        command=[python, "-m", f"tokenmesh.{service}"],
        env=environment(settings),
        port=settings.port,
        metrics_port=settings.metrics_port,
        service=service,
        mtls=settings.tls_cert_file is not None,
        openai_port=openai_port,
        settings=settings,
    )


def mesh_cores(settings: LocalMeshSettings, workers: int, cores: int) -> str:
    """The cores the mesh's own processes get ("1", "2-7"): those no engine binds."""
    if not settings.pin_mesh_cores or workers >= cores:
        return ""
    return str(workers) if workers == cores - 1 else f"{workers}-{cores - 1}"


class ProcessTable:
    """What the mesh runs, dependencies first (`up` waits for each in this order)."""

    def __init__(self, settings: LocalMeshSettings, files: MeshFiles, tools: Tools) -> None:
        self.settings = settings
        self.files = files
        self.tools = tools
        # Every pool's workers, one after the other: (pool, its settings) each.
        self.worker_pools = [
            (pool, spec) for pool, spec in settings.worker_pools() for _ in range(spec.workers)
        ]
        self.workers = len(self.worker_pools)
        self.cores = mesh_cores(settings, self.workers, tools.cores)
        self.consul_address = f"127.0.0.1:{settings.consul_http_port}"
        self.prometheus_url = f"http://127.0.0.1:{settings.prometheus_port}"

    def programs(self) -> list[Program]:
        return [
            *self._consul(),
            self._controlplane(),
            self._envoy(),
            *(self._worker(i, *pool) for i, pool in enumerate(self.worker_pools)),
            self._reranker(),
            *(self._gateway(i) for i in range(self.settings.gateways)),
            *self._prometheus(),
        ]

    def _affinity(self) -> dict[str, Any]:
        return {"cpu_affinity": self.cores} if self.cores else {}

    def _shared(self, service: str) -> dict[str, Any]:
        """What the gateways, workers and reranker get alike: their cores, Consul, tracing,
        and with mTLS their own certificate (then only TLS with Envoy's reaches their port)."""
        values = {**self._affinity(), "otlp_endpoint": self.settings.otlp_endpoint}
        if self.tools.consul:
            values["consul_http_addr"] = self.consul_address
        if self.settings.mtls:
            certs = self.files.certs
            values |= {
                "tls_cert_file": certs.cert(service),
                "tls_key_file": certs.key(service),
                "tls_client_ca_file": certs.ca_cert,
            }
        return values

    def _consul(self) -> list[Program]:
        if not self.tools.consul:
            return []
        return [
            Program(
                "consul",
                [self.tools.consul, "agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1",
                 "-http-port", str(self.settings.consul_http_port)],
            )
        ]  # fmt: skip

    def _controlplane(self) -> Program:
        s, certs = self.settings, self.files.certs
        source: dict[str, Any] = (
            {
                "source": "consul",
                "consul_http_addr": self.consul_address,
                # Every pool's workers register as their pool's cluster.
                "consul_services": [
                    *ControlPlaneSettings.model_fields["consul_services"].default,
                    *(pool_cluster(pool) for pool in s.pool_names()),
                ],
            }
            if self.tools.consul
            else {"source": "static", "static_file": self.files.endpoints}
        )
        if s.mtls:
            # The ops feed asks the workers themselves: with Envoy's client certificate, the
            # one client certificate the local set has.
            source |= {
                "worker_tls_ca_file": certs.ca_cert,
                "worker_tls_cert_file": certs.cert(ENVOY_CLIENT),
                "worker_tls_key_file": certs.key(ENVOY_CLIENT),
            }
        settings = build(
            ControlPlaneSettings,
            port=s.controlplane_port,
            metrics_port=s.controlplane_metrics_port,
            ops_page_port=s.controlplane_ops_page_port,
            ops_page_dir=self.files.ops_page,
            prometheus_url=self.prometheus_url if self.tools.prometheus else None,
            admin_keys_file=self.files.admin_keys,
            **source,
            **self._affinity(),
        )
        return service_program(self.tools.python, "controlplane", settings)

    def _envoy(self) -> Program:
        pinned = ["taskset", "-c", self.cores] if self.cores and self.tools.taskset else []
        return Program(
            "envoy",
            [*pinned, str(self.tools.bin_dir / "envoy"), "-c", str(self.files.envoy_config),
             "--base-id", str(self.settings.envoy_base_id), "--log-level", "warn"],
            # Where it finds the stream relay (stream_relay), built there by write_configs.
            env={SEARCH_PATH: str(self.files.relay_module_dir)},
        )  # fmt: skip

    def _worker(self, i: int, pool: str, spec: WorkerPool) -> Program:
        s, cores = self.settings, self.tools.cores
        settings = build(
            WorkerSettings,
            port=s.worker_port + i,
            metrics_port=s.worker_metrics_port + i,
            model=spec.model,
            # What OpenAI clients name as `model`: the model directory's name.
            served_model_name=Path(spec.model).name,
            lora_modules=spec.lora_modules,
            pool=pool,
            kv_cache_space_gib=s.worker_kv_cache_space_gib,
            max_model_len=s.worker_max_model_len,
            max_num_seqs=s.worker_max_num_seqs,
            frontends=s.worker_frontends,
            dtype=s.worker_dtype,
            # vLLM pins its OpenMP threads: engines on one machine get their own cores, or they
            # fight over the same ones. With more engines than cores, each still binds one
            # (some share it) rather than each binding them all ("auto").
            cpu_threads_bind=str(i % cores),
            # Compact JSON: the random tiny model would fill a structured answer's whitespace
            # until max_tokens.
            structured_outputs_backend="xgrammar",
            structured_outputs_disable_any_whitespace=True,
            # A worker whose engine dies hands its streams over to the others through Envoy's
            # worker listener (the gateways' way to them), over TLS with mTLS on.
            handover_address=f"127.0.0.1:{s.worker_listener_port}",
            **({"handover_tls_ca_file": self.files.certs.ca_cert} if s.mtls else {}),
            **self._tool_calling(spec.model),
            **self._shared("worker"),
        )
        return replace(service_program(self.tools.python, "worker", settings, i), pool=pool)

    def _tool_calling(self, model: str) -> dict[str, Any]:
        """The mesh's own models (scripts/make_tiny_model.py marks them) have a chat template
        that writes tool calls as Hermes' do; another model's parser is the user's to name
        (TOKENMESH_WORKER_TOOL_CALL_PARSER)."""
        if not (Path(model) / "tokenmesh-tiny.json").exists():
            return {}
        return {
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
            # Forced calls by their JSON schema, compact as structured outputs are here.
            "enforce_strict_tool_calling": False,
        }

    def _reranker(self) -> Program:
        s = self.settings
        settings = build(
            RerankerSettings,
            port=s.reranker_port,
            metrics_port=s.reranker_metrics_port,
            **self._shared("reranker"),
        )
        return service_program(self.tools.python, "reranker", settings)

    def _gateway(self, i: int) -> Program:
        s = self.settings
        # The gateways' endpoint picker follows the workers' load on the control plane.
        picker = (
            {"picker": {"feed_address": f"127.0.0.1:{s.controlplane_port}"}}
            if s.worker_routing == "picker" or s.picker_feed
            else {}
        )
        # With mTLS the gateways also reach Envoy's internal listeners over TLS.
        internal_tls = {"dependency_tls_ca_file": self.files.certs.ca_cert} if s.mtls else {}
        settings = build(
            GatewaySettings,
            port=s.gateway_port + i,
            metrics_port=s.gateway_metrics_port + i,
            worker_address=f"127.0.0.1:{s.worker_listener_port}",
            worker_pools=s.pool_names(),
            reranker_address=f"127.0.0.1:{s.reranker_listener_port}",
            openai_port=s.gateway_openai_port + i,
            keys_file=self.files.keys,
            **picker,
            **internal_tls,
            **self._shared("gateway"),
        )
        return service_program(self.tools.python, "gateway", settings, i, settings.openai_port)

    def _prometheus(self) -> list[Program]:
        if not self.tools.prometheus:
            return []
        s = self.settings
        return [
            Program(
                "prometheus",
                [self.tools.prometheus, f"--config.file={self.files.prometheus_config}",
                 f"--storage.tsdb.path={self.files.run_dir / 'prometheus'}",
                 f"--storage.tsdb.retention.time={s.prometheus_retention}",
                 f"--web.listen-address=127.0.0.1:{s.prometheus_port}"],
                ready_url=f"{self.prometheus_url}/-/ready",
            )
        ]  # fmt: skip
