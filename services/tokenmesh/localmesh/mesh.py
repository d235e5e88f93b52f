"""What the local mesh runs, the supervisord config for it, and the up/down/status commands."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import grpc
import psutil
import yaml
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenmesh.localmesh.certs import (
    EDGE,
    ENVOY_CLIENT,
    ENVOY_INTERNAL,
    CertMaker,
    CertPaths,
    CertSettings,
)
from tokenmesh.localmesh.probes import health, port_is_free
from tokenmesh.meshconfig.bootstrap import render, secret_files
from tokenmesh.meshconfig.config import MeshSettings

GIB = 1024**3
# A tiny-model worker (vLLM, torch, 1 GiB KV cache) takes about 3 GiB; a second one is only
# started when there is room for it with margin.
MEMORY_PER_WORKER = 4 * GIB
# The alert rules Prometheus evaluates, relative to the repository (the Helm chart ships the
# same file).
ALERT_RULES = Path("prometheus") / "alerts.yml"
# The built ops page (`make ops-page`), relative to the repository; the control plane serves it.
OPS_PAGE_DIR = Path("ops") / "dist"
# prometheus_client (0.26) writes vLLM's `vllm:*` sample names as `vllm_*` when Prometheus asks
# for OpenMetrics (as 2.x does); this puts back the names vLLM documents and the dashboards use.
VLLM_METRIC_NAMES = {
    "source_labels": ["__name__"],
    "regex": "vllm_(.+)",
    "target_label": "__name__",
    "replacement": "vllm:$1",
}


# Replica i of these listens on base + i, so each gets a block of MAX_REPLICAS ports.
REPLICATED_PORTS = frozenset(
    {
        "gateway_port",
        "gateway_metrics_port",
        "gateway_openai_port",
        "worker_port",
        "worker_metrics_port",
    }
)
MAX_REPLICAS = 16
# Below Linux's ephemeral range (32768 and up), so outgoing connections do not take a port of
# the block between choosing it and the services binding it.
PORT_BLOCK_RANGE = (20_000, 32_000)


def free_port_block(size: int, attempts: int = 200) -> int:
    """The first of `size` consecutive ports on 127.0.0.1 that are all free now."""
    low, high = PORT_BLOCK_RANGE
    for _ in range(attempts):
        base = random.randint(low, high - size)
        if all(port_is_free(base + offset) for offset in range(size)):
            return base
    raise RuntimeError(f"no {size} consecutive free ports in {low}..{high}")


class LocalMeshSettings(BaseSettings):
    """Ports, replicas and model of the local mesh, from TOKENMESH_LOCALMESH_* variables."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENMESH_LOCALMESH_", frozen=True, extra="ignore"
    )

    # Where supervisord keeps its socket, pid file, generated configs and the services' logs.
    run_dir: Path = Path(".run")
    model: str = "models/tiny-llama"
    gateways: int = Field(default=2, ge=1, le=16)
    # 0 means: 2, or 1 when the machine has too little free memory for two.
    workers: int = Field(default=0, ge=0, le=16)
    # Run Envoy and the services on the cores no engine binds (engines bind 0..workers-1),
    # when there are such cores; otherwise, and when off, wherever the kernel puts them.
    pin_mesh_cores: bool = True
    # Envoy streams Generate's tokens straight from the workers; gateways only prepare each
    # request (MeshSettings.direct_token_path). False: every token passes through a gateway.
    direct_token_path: bool = True
    # How Envoy picks a worker for each stream (MeshSettings.worker_routing).
    worker_routing: Literal["least_request", "prefix", "picker"] = "prefix"
    # The gateways' endpoint picker follows the workers' load (and names workers) even when
    # this mesh's Envoy does not route by it: for a second Envoy with worker_routing picker.
    picker_feed: bool = False
    # Replica i of a service listens on base + i (gRPC) and metrics base + i.
    gateway_port: int = Field(default=50051, ge=1, le=65535)
    gateway_metrics_port: int = Field(default=9451, ge=1, le=65535)
    # The gateways' OpenAI HTTP API (the edge's /v1/ goes there).
    gateway_openai_port: int = Field(default=8091, ge=1, le=65535)
    worker_port: int = Field(default=50061, ge=1, le=65535)
    worker_metrics_port: int = Field(default=9461, ge=1, le=65535)
    reranker_port: int = Field(default=50071, ge=1, le=65535)
    reranker_metrics_port: int = Field(default=9471, ge=1, le=65535)
    controlplane_port: int = Field(default=18000, ge=1, le=65535)
    controlplane_metrics_port: int = Field(default=9480, ge=1, le=65535)
    # The ops page's files (the edge serves them at /ops/ from here).
    controlplane_ops_page_port: int = Field(default=9481, ge=1, le=65535)
    # Envoy: the edge, its admin, and the internal listeners gateways call through.
    edge_port: int = Field(default=8080, ge=1, le=65535)
    envoy_admin_port: int = Field(default=9901, ge=1, le=65535)
    worker_listener_port: int = Field(default=50060, ge=1, le=65535)
    reranker_listener_port: int = Field(default=50070, ge=1, le=65535)
    # Envoy's shared-memory id; distinct values let several meshes (tests) run side by side.
    envoy_base_id: int = Field(default=7100, ge=0)
    # Consul's HTTP port when a `consul` binary is on PATH (a dev agent is started).
    consul_http_port: int = Field(default=8500, ge=1, le=65535)
    # Prometheus, started when a `prometheus` binary is on PATH: scrapes every service replica
    # and Envoy, evaluates the alert rules; its data lives in run_dir/prometheus.
    prometheus_port: int = Field(default=9090, ge=1, le=65535)
    # Seconds between scrapes and rule evaluations. Far below Prometheus' 1 min default so that
    # dashboards on a laptop, and the tests, see traffic within seconds (rate() needs two
    # scrapes inside its window); the local mesh's handful of targets makes this cheap.
    prometheus_scrape_interval_seconds: int = Field(default=2, ge=1, le=60)
    # How long the local Prometheus keeps data.
    prometheus_retention: str = "2d"
    # CPU KV cache per worker, GiB.
    worker_kv_cache_space_gib: int = Field(default=1, ge=1)
    # The workers' weights and activations (WorkerSettings.dtype). auto turns a float32 model
    # into bfloat16, which the CPU backend computes natively only with AVX-512's bf16.
    worker_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # How long `up` waits for every service to be SERVING and every Envoy host healthy.
    ready_timeout_seconds: float = Field(default=600.0, gt=0)
    # OTLP/gRPC collector (e.g. Jaeger's 127.0.0.1:4317) every gateway, worker and reranker
    # sends its spans to; unset: tracing off.
    otlp_endpoint: str | None = None
    # API keys and tenant limits for every gateway (a JSON keys file, see docs/security.md;
    # relative to the repository root); unset: no authentication, the local default.
    keys_file: Path | None = None
    # TLS at the edge (docs/security.md, TLS): the edge speaks only TLS (gRPC over h2,
    # REST and gRPC-Web over http/1.1 too, by ALPN), with a certificate from the local CA in
    # certs_dir, made when missing or about to expire (as `make certs` does).
    tls: bool = False
    # mTLS between Envoy and the gateways, workers and reranker: each service's port speaks
    # only TLS and wants Envoy's client certificate; Envoy checks each service's certificate.
    # Envoy's internal listeners, which the gateways call, speak TLS too.
    mtls: bool = False
    # The CA, certificates and keys; unset: run_dir/certs (.run/certs, where `make certs`
    # puts them).
    certs_dir: Path | None = None
    # Extra DNS names or IP addresses on the edge certificate (JSON list), for clients that
    # reach the edge by another name than localhost or 127.0.0.1.
    tls_edge_names: tuple[str, ...] = ()

    @classmethod
    def on_free_ports(cls, run_dir: Path, **overrides: Any) -> LocalMeshSettings:
        """A mesh that can run beside `make up` and other such meshes (tests, benchmarks):
        its ports from one block free now (replicas take consecutive ports from their base,
        so replicated bases get room for MAX_REPLICAS), its own run directory and Envoy
        shared-memory id."""
        names = [name for name in cls.model_fields if name.endswith("_port")]
        sizes = [MAX_REPLICAS if name in REPLICATED_PORTS else 1 for name in names]
        next_port = free_port_block(sum(sizes))
        ports = {}
        for name, size in zip(names, sizes, strict=True):
            ports[name] = next_port
            next_port += size
        settings: dict[str, Any] = {
            "run_dir": run_dir,
            "envoy_base_id": random.randint(10_000, 60_000),
            **ports,
        }
        return cls(**{**settings, **overrides})

    def worker_count(self) -> int:
        if self.workers:
            return self.workers
        return 2 if psutil.virtual_memory().available >= 2 * MEMORY_PER_WORKER else 1

    def mesh(self, certs: CertPaths | None = None) -> MeshSettings:
        """The mesh Envoy runs; with certs, TLS at the edge and mTLS to the services as the
        tls and mtls settings ask, the SDS files that deliver them next to the certificates."""
        edge = certs if certs is not None and self.tls else None
        upstream = certs if certs is not None and self.mtls else None
        return MeshSettings(
            edge_port=self.edge_port,
            admin_port=self.envoy_admin_port,
            worker_listener_port=self.worker_listener_port,
            reranker_listener_port=self.reranker_listener_port,
            controlplane_port=self.controlplane_port,
            ops_page_port=self.controlplane_ops_page_port,
            edge_tls_cert_file=None if edge is None else str(edge.cert(EDGE)),
            edge_tls_key_file=None if edge is None else str(edge.key(EDGE)),
            upstream_tls_cert_file=None if upstream is None else str(upstream.cert(ENVOY_CLIENT)),
            upstream_tls_key_file=None if upstream is None else str(upstream.key(ENVOY_CLIENT)),
            upstream_tls_ca_file=None if upstream is None else str(upstream.ca_cert),
            internal_tls_cert_file=None if upstream is None else str(upstream.cert(ENVOY_INTERNAL)),
            internal_tls_key_file=None if upstream is None else str(upstream.key(ENVOY_INTERNAL)),
            sds_dir=None if certs is None else str(certs.dir),
            direct_token_path=self.direct_token_path,
            worker_routing=self.worker_routing,
        )


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

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def tokenmesh_service(
    service: str,
    replica: int | None,
    port: int,
    metrics_port: int,
    settings: dict[str, str] | None = None,
    certs: CertPaths | None = None,
    openai_port: int | None = None,
) -> Program:
    """`python -m tokenmesh.<service>` with its TOKENMESH_<SERVICE>_* settings; with certs,
    its port speaks only mTLS with its own certificate."""
    prefix = f"TOKENMESH_{service.upper()}_"
    values = {"PORT": str(port), "METRICS_PORT": str(metrics_port), **(settings or {})}
    if certs is not None:
        values |= {
            "TLS_CERT_FILE": str(certs.cert(service)),
            "TLS_KEY_FILE": str(certs.key(service)),
            "TLS_CLIENT_CA_FILE": str(certs.ca_cert),
        }
    return Program(
        name=service if replica is None else f"{service}-{replica}",
        command=[sys.executable, "-m", f"tokenmesh.{service}"],
        env={prefix + key: value for key, value in values.items()},
        port=port,
        metrics_port=metrics_port,
        service=service,
        mtls=certs is not None,
        openai_port=openai_port,
    )


class LocalMesh:
    """The supervisord-managed local mesh rooted at the repository."""

    def __init__(self, settings: LocalMeshSettings, root: Path) -> None:
        self.settings = settings
        self.root = root
        self.run_dir = (root / settings.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.config_path = self.run_dir / "supervisord.conf"
        self.pid_path = self.run_dir / "supervisord.pid"
        self.envoy_config_path = self.run_dir / "envoy.yaml"
        self.endpoints_path = self.run_dir / "endpoints.yaml"
        self.prometheus_config_path = self.run_dir / "prometheus.yml"
        # The settings this mesh runs with, so tools can attach to it (e.g. `make chaos`).
        self.settings_path = self.run_dir / "mesh-settings.json"
        self.certs = CertPaths(
            (root / (settings.certs_dir or settings.run_dir / "certs")).resolve()
        )
        self.alert_rules_path = (root / ALERT_RULES).resolve()
        self.consul = shutil.which("consul")
        self.prometheus = shutil.which("prometheus")
        self._bin = Path(sys.executable).parent
        self.programs = self._programs()

    @property
    def consul_address(self) -> str:
        return f"127.0.0.1:{self.settings.consul_http_port}"

    @property
    def keys_path(self) -> Path | None:
        """The gateways' keys file, absolute (None: authentication off)."""
        keys_file = self.settings.keys_file
        return None if keys_file is None else (self.root / keys_file).resolve()

    @property
    def tls(self) -> bool:
        """The mesh uses certificates (TLS at the edge, mTLS inside, or both)."""
        return self.settings.tls or self.settings.mtls

    def ensure_certs(self) -> bool:
        """Make the CA and certificates unless a valid set is there; True if one was made."""
        settings = CertSettings(dir=self.certs.dir, edge_names=self.settings.tls_edge_names)
        return CertMaker(settings, self.certs).ensure()

    def client_credentials(self) -> grpc.ChannelCredentials:
        """What Envoy presents to the services (mTLS): its client certificate, and the CA."""
        return grpc.ssl_channel_credentials(
            self.certs.ca_cert.read_bytes(),
            self.certs.key(ENVOY_CLIENT).read_bytes(),
            self.certs.cert(ENVOY_CLIENT).read_bytes(),
        )

    def serving(self, program: Program) -> bool:
        return self.health(program) == "SERVING"

    def health(self, program: Program) -> str:
        """The program's overall grpc.health.v1 status, over mTLS when its port wants it."""
        assert program.port is not None
        return health(program.address, self.client_credentials() if program.mtls else None)

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.prometheus_port}"

    def _programs(self) -> list[Program]:
        """Dependencies first: `up` waits for each in this order."""
        s = self.settings
        workers = s.worker_count()
        cores = os.cpu_count() or 1
        registration = {"CONSUL_HTTP_ADDR": self.consul_address} if self.consul else {}
        tracing = {"OTLP_ENDPOINT": s.otlp_endpoint} if s.otlp_endpoint else {}
        auth = {"KEYS_FILE": str(self.keys_path)} if self.keys_path else {}
        # The services' own certificates when Envoy reaches them over mTLS; then the gateways
        # also reach Envoy's internal listeners over TLS.
        mtls = self.certs if s.mtls else None
        internal_tls = {"DEPENDENCY_TLS_CA_FILE": str(self.certs.ca_cert)} if s.mtls else {}
        mesh_cores = self.mesh_cores(workers, cores)
        affinity = {"CPU_AFFINITY": mesh_cores} if mesh_cores else {}
        pinned = ["taskset", "-c", mesh_cores] if mesh_cores and shutil.which("taskset") else []
        programs: list[Program] = []
        if self.consul:
            programs.append(
                Program(
                    "consul",
                    [self.consul, "agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1",
                     "-http-port", str(s.consul_http_port)],
                )
            )  # fmt: skip
        source = (
            {"SOURCE": "consul", "CONSUL_HTTP_ADDR": self.consul_address}
            if self.consul
            else {"SOURCE": "static", "STATIC_FILE": str(self.endpoints_path)}
        )
        ops = {
            "OPS_PAGE_PORT": str(s.controlplane_ops_page_port),
            "OPS_PAGE_DIR": str((self.root / OPS_PAGE_DIR).resolve()),
            **({"PROMETHEUS_URL": self.prometheus_url} if self.prometheus else {}),
        }
        if s.mtls:
            # The ops feed asks the workers themselves: with Envoy's client certificate, the
            # one client certificate the local set has.
            ops.update(
                WORKER_TLS_CA_FILE=str(self.certs.ca_cert),
                WORKER_TLS_CERT_FILE=str(self.certs.cert(ENVOY_CLIENT)),
                WORKER_TLS_KEY_FILE=str(self.certs.key(ENVOY_CLIENT)),
            )
        programs.append(
            tokenmesh_service(
                "controlplane", None, s.controlplane_port, s.controlplane_metrics_port,
                {**source, **ops, **affinity},
            )
        )  # fmt: skip
        programs.append(
            Program(
                "envoy",
                [*pinned, str(self._bin / "envoy"), "-c", str(self.envoy_config_path),
                 "--base-id", str(s.envoy_base_id), "--log-level", "warn"],
            )
        )  # fmt: skip
        for i in range(workers):
            programs.append(
                tokenmesh_service(
                    "worker",
                    i,
                    s.worker_port + i,
                    s.worker_metrics_port + i,
                    {
                        "MODEL": s.model,
                        # What OpenAI clients name as `model`: the model directory's name.
                        "SERVED_MODEL_NAME": Path(s.model).name,
                        "KV_CACHE_SPACE_GIB": str(s.worker_kv_cache_space_gib),
                        "DTYPE": s.worker_dtype,
                        # vLLM pins its OpenMP threads: engines on one machine get their own
                        # cores, or they fight over the same ones.
                        "CPU_THREADS_BIND": str(i % cores) if workers <= cores else "auto",
                        **affinity,
                        **registration,
                        **tracing,
                    },
                    mtls,
                )
            )
        programs.append(
            tokenmesh_service(
                "reranker",
                None,
                s.reranker_port,
                s.reranker_metrics_port,
                {**registration, **tracing, **affinity},
                mtls,
            )
        )
        # The gateways' endpoint picker follows the workers' load on the control plane.
        picker = (
            {"PICKER__FEED_ADDRESS": f"127.0.0.1:{s.controlplane_port}"}
            if s.worker_routing == "picker" or s.picker_feed
            else {}
        )
        for i in range(s.gateways):
            programs.append(
                tokenmesh_service(
                    "gateway",
                    i,
                    s.gateway_port + i,
                    s.gateway_metrics_port + i,
                    {
                        "WORKER_ADDRESS": f"127.0.0.1:{s.worker_listener_port}",
                        "RERANKER_ADDRESS": f"127.0.0.1:{s.reranker_listener_port}",
                        "OPENAI_PORT": str(s.gateway_openai_port + i),
                        **picker,
                        **registration,
                        **tracing,
                        **auth,
                        **internal_tls,
                        **affinity,
                    },
                    mtls,
                    openai_port=s.gateway_openai_port + i,
                )
            )
        if self.prometheus:
            programs.append(
                Program(
                    "prometheus",
                    [self.prometheus, f"--config.file={self.prometheus_config_path}",
                     f"--storage.tsdb.path={self.run_dir / 'prometheus'}",
                     f"--storage.tsdb.retention.time={s.prometheus_retention}",
                     f"--web.listen-address=127.0.0.1:{s.prometheus_port}"],
                    ready_url=f"{self.prometheus_url}/-/ready",
                )
            )  # fmt: skip
        return programs

    def mesh_cores(self, workers: int, cores: int) -> str:
        """The cores the mesh's own processes get ("1", "2-7"): those no engine binds."""
        if not self.settings.pin_mesh_cores or workers >= cores:
            return ""
        return str(workers) if workers == cores - 1 else f"{workers}-{cores - 1}"

    def endpoints(self) -> dict[str, dict[str, list[str]]]:
        """The static discovery file: every service replica's address, by cluster."""
        clusters: dict[str, list[str]] = {"gateway": [], "worker": [], "reranker": []}
        openai = []
        for program in self.programs:
            if program.service in clusters:
                clusters[program.service].append(program.address)
            if program.openai_port is not None:
                openai.append(f"127.0.0.1:{program.openai_port}")
        if openai:
            clusters["openai"] = openai
        return {"clusters": clusters}

    def prometheus_config(self) -> dict[str, Any]:
        """Scrape every service replica (job and `service` label: its service; `replica`: its
        program name) and Envoy's admin stats; evaluate the alert rules."""
        interval = f"{self.settings.prometheus_scrape_interval_seconds}s"
        jobs: dict[str, list[dict[str, Any]]] = {}
        for program in self.programs:
            if program.service is not None and program.metrics_port is not None:
                jobs.setdefault(program.service, []).append(
                    {
                        "targets": [f"127.0.0.1:{program.metrics_port}"],
                        # address: the gRPC address, which the ops feed knows replicas by.
                        "labels": {
                            "service": program.service,
                            "replica": program.name,
                            "address": program.address,
                        },
                    }
                )
        scrape_configs: list[dict[str, Any]] = [
            {"job_name": service, "static_configs": targets} for service, targets in jobs.items()
        ]
        for job in scrape_configs:
            if job["job_name"] == "worker":
                job["metric_relabel_configs"] = [VLLM_METRIC_NAMES]
        scrape_configs.append(
            {
                "job_name": "envoy",
                "metrics_path": "/stats/prometheus",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{self.settings.envoy_admin_port}"],
                        "labels": {"service": "envoy", "replica": "envoy"},
                    }
                ],
            }
        )
        return {
            # The timeout may not exceed the interval (Prometheus' default timeout is 10 s).
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "rule_files": [str(self.alert_rules_path)],
            "scrape_configs": scrape_configs,
        }

    def supervisord_config(self) -> str:
        sections = [
            f"""[unix_http_server]
file={self.run_dir}/supervisor.sock

[supervisord]
logfile={self.log_dir}/supervisord.log
pidfile={self.pid_path}
directory={self.root}
childlogdir={self.log_dir}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{self.run_dir}/supervisor.sock
"""
        ]
        for program in self.programs:
            env = ",".join(f'{key}="{value}"' for key, value in program.env.items())
            sections.append(
                f"""[program:{program.name}]
command={shlex.join(program.command)}
environment={env or 'TOKENMESH_LOCALMESH="1"'}
autorestart=true
startsecs=2
stopsignal=TERM
stopwaitsecs={program.stop_wait_seconds}
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={self.log_dir}/{program.name}.log
stdout_logfile_maxbytes=50MB
stdout_logfile_backups=2
"""
            )
        return "\n".join(sections)

    def write_configs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.supervisord_config())
        mesh = self.settings.mesh(self.certs if self.tls else None)
        self.envoy_config_path.write_text(yaml.safe_dump(render(mesh), sort_keys=False))
        for path, secret in secret_files(mesh).items():
            Path(path).write_text(yaml.safe_dump(secret, sort_keys=False))
        self.endpoints_path.write_text(yaml.safe_dump(self.endpoints(), sort_keys=False))
        self.prometheus_config_path.write_text(
            yaml.safe_dump(self.prometheus_config(), sort_keys=False)
        )
        self.settings_path.write_text(self.settings.model_dump_json(indent=1))

    def supervisord_pid(self) -> int | None:
        """The pid of our running supervisord, or None."""
        try:
            pid = int(self.pid_path.read_text().strip())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        return pid

    def program(self, name: str) -> Program:
        return next(program for program in self.programs if program.name == name)

    def replicas(self, service: str) -> list[Program]:
        """The programs of one service (its Envoy cluster), in order."""
        return [program for program in self.programs if program.service == service]

    def pid(self, name: str) -> int:
        """The program's pid from supervisord; 0 when it is not running."""
        text = self.ctl("pid", name).stdout.strip()
        return int(text) if text.isdigit() else 0

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self._bin / "supervisorctl"), "-c", str(self.config_path), *args],
            capture_output=True,
            text=True,
            check=False,
        )

    def up(self) -> int:
        if self.supervisord_pid() is not None:
            print("the local mesh is already running (make status / make down)")
            return self.status()
        if self.consul:
            print(f"consul found at {self.consul}: dev agent on {self.consul_address}")
        else:
            print("no consul binary on PATH: discovery is static (.run/endpoints.yaml)")
        if not self.prometheus:
            print("no prometheus binary on PATH: no metrics storage or alerts (make setup)")
        if self.tls:
            made = self.ensure_certs()
            print(f"{'made' if made else 'using'} TLS certificates in {self.certs.dir}")
        self.write_configs()
        subprocess.run(
            [str(self._bin / "supervisord"), "-c", str(self.config_path)], check=True, cwd=self.root
        )
        print(f"started under supervisord; logs in {self.log_dir} (make logs)")
        started = time.monotonic()
        deadline = started + self.settings.ready_timeout_seconds
        for program in self.programs:
            if program.port is not None:
                ready = partial(self.serving, program)
            elif program.ready_url is not None:
                ready = partial(http_ok, program.ready_url)
            else:
                continue
            if not self._wait(program, deadline, ready):
                return 1
        envoy = next(program for program in self.programs if program.name == "envoy")
        if not self._wait(envoy, deadline, self.envoy_ready):
            return 1
        print(f"ready in {time.monotonic() - started:.0f}s\n")
        self._print_endpoints()
        return 0

    def _wait(self, program: Program, deadline: float, ready: Callable[[], bool]) -> bool:
        print(f"waiting for {program.name} ...", flush=True)
        while time.monotonic() < deadline:
            state = self.ctl("status", program.name).stdout.split()
            if len(state) > 1 and state[1] in ("FATAL", "EXITED", "BACKOFF"):
                print(f"{program.name} is {state[1]}; last log lines:\n{self._tail(program)}")
                return False
            if ready():
                print(f"{program.name} is ready")
                return True
            time.sleep(1)
        print(f"{program.name} not ready in time; last log lines:\n{self._tail(program)}")
        return False

    def envoy_hosts(self) -> dict[str, list[tuple[str, bool]]]:
        """Envoy's view: (address, healthy) of each host, by cluster."""
        return envoy_hosts(self.settings.envoy_admin_port)

    def envoy_ready(self) -> bool:
        """Every service replica is known to Envoy and passes its health checks."""
        hosts = self.envoy_hosts()
        expected = self.endpoints()["clusters"]
        return all(
            sorted(address for address, healthy in hosts.get(cluster, []) if healthy)
            == sorted(addresses)
            for cluster, addresses in expected.items()
        )

    def _tail(self, program: Program, lines: int = 30) -> str:
        log = self.log_dir / f"{program.name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _print_endpoints(self) -> None:
        s = self.settings
        scheme = "https" if s.tls else "http"
        edge_tls = f" (TLS only, CA {self.certs.ca_cert})" if s.tls else ""
        print(f"  edge (Envoy)  grpc, gRPC-Web, REST  127.0.0.1:{s.edge_port}{edge_tls}")
        print(f"  ops page      {scheme}://127.0.0.1:{s.edge_port}/ops/")
        print(f"  Envoy admin   http://127.0.0.1:{s.envoy_admin_port}/clusters")
        print(f"  Envoy stats   http://127.0.0.1:{s.envoy_admin_port}/stats/prometheus")
        if self.prometheus:
            print(f"  Prometheus    {self.prometheus_url} (alerts: {self.prometheus_url}/alerts)")
        for program in self.programs:
            if program.port is not None:
                print(
                    f"  {program.name:13} grpc {program.address}"
                    f"{' (mTLS)' if program.mtls else ''}   metrics http://127.0.0.1:{program.metrics_port}/metrics"
                )
        edge = f"127.0.0.1:{s.edge_port}"
        # With keys on, the examples send a key from $TOKENMESH_KEY (double quotes: expanded).
        header = ""
        if self.keys_path is not None:
            print(f"\nAPI keys on: {self.keys_path}")
            print("  add one: python -m tokenmesh.gateway.keys add --tenant NAME --file FILE")
            header = ' -H "authorization: Bearer $TOKENMESH_KEY"'
        # With TLS the examples trust the local CA instead of speaking plaintext.
        grpcurl_tls = f"-cacert {self.certs.ca_cert}" if s.tls else "-plaintext"
        curl_tls = f" --cacert {self.certs.ca_cert}" if s.tls else ""
        print("\nTry it:")
        print(
            f"  grpcurl {grpcurl_tls}{header} -d "
            + shlex.join(['{"prompt":"hello","max_tokens":16}', edge])
            + " tokenmesh.v1.LLMService/Generate"
        )
        print(
            f'  curl -N{curl_tls}{header} -d \'{{"prompt":"hello","max_tokens":16}}\' '
            f"{scheme}://{edge}/tokenmesh.v1.LLMService/Generate"
        )
        body = json.dumps(
            {"model": Path(s.model).name, "messages": [{"role": "user", "content": "hello"}],
             "max_tokens": 16, "stream": True}
        )  # fmt: skip
        print(
            f"  curl -N{curl_tls}{header} -H 'content-type: application/json' -d '{body}' "
            f"{scheme}://{edge}/v1/chat/completions"
        )
        print(f"  (grpcurl is in {self._bin}; `source .venv/bin/activate` puts it on PATH)")

    def down(self) -> int:
        pid = self.supervisord_pid()
        if pid is None:
            print("the local mesh is not running")
            return 0
        result = self.ctl("shutdown")
        print(result.stdout.strip() or result.stderr.strip())
        deadline = time.monotonic() + 120
        while self.supervisord_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if self.supervisord_pid() is not None:
            print(f"supervisord (pid {pid}) did not stop in time")
            return 1
        print("stopped")
        return 0

    def status(self) -> int:
        if self.supervisord_pid() is None:
            print("the local mesh is not running (make up)")
            return 0
        print(self.ctl("status").stdout.rstrip())
        for program in self.programs:
            if program.port is not None:
                print(f"  {program.name:13} health: {self.health(program)}")
            elif program.ready_url is not None:
                state = "ready" if http_ok(program.ready_url) else "NOT READY"
                print(f"  {program.name:13} {state} ({program.ready_url})")
        for cluster, hosts in sorted(self.envoy_hosts().items()):
            listed = ", ".join(f"{a} {'healthy' if ok else 'UNHEALTHY'}" for a, ok in hosts)
            print(f"  envoy cluster {cluster:10} {listed or 'no hosts'}")
        return 0

    def logs(self) -> int:
        files = sorted(str(path) for path in self.log_dir.glob("*.log"))
        if not files:
            print("no logs yet (make up)")
            return 0
        os.execvp("tail", ["tail", "-n", "50", "-F", *files])


def http_ok(url: str) -> bool:
    """url answers 200 (Prometheus' /-/ready does once its storage is open)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def envoy_host_statuses(admin_port: int) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(cluster, address, host status from /clusters?format=json) of every host the Envoy whose
    admin listens on admin_port knows; nothing when Envoy does not answer."""
    url = f"http://127.0.0.1:{admin_port}/clusters?format=json"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            statuses = json.load(reply).get("cluster_statuses", [])
    except (urllib.error.URLError, OSError, ValueError):
        return
    for cluster in statuses:
        for host in cluster.get("host_statuses", []):
            address = host["address"]["socket_address"]
            yield cluster["name"], f"{address['address']}:{address['port_value']}", host


def envoy_hosts(admin_port: int) -> dict[str, list[tuple[str, bool]]]:
    """The view of the Envoy whose admin listens on admin_port: (address, healthy) of each
    host, by cluster; empty when Envoy does not answer."""
    hosts: dict[str, list[tuple[str, bool]]] = {}
    for cluster, address, host in envoy_host_statuses(admin_port):
        flags = host.get("health_status", {})
        # Any true flag (failed_active_health_check, pending_active_hc, ...) keeps
        # Envoy from routing to the host.
        healthy = flags.get("eds_health_status") == "HEALTHY" and not any(
            value is True for value in flags.values()
        )
        hosts.setdefault(cluster, []).append((address, healthy))
    return hosts
