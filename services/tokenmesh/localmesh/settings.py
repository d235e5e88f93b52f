"""The local mesh's own settings (TOKENMESH_LOCALMESH_*): ports, replicas, model, TLS."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenmesh.common.pools import pool_names
from tokenmesh.localmesh.certs import EDGE, ENVOY_CLIENT, ENVOY_INTERNAL, CertPaths
from tokenmesh.localmesh.environment import checked
from tokenmesh.localmesh.probes import port_is_free
from tokenmesh.meshconfig.config import MeshSettings

GIB = 1024**3
# A tiny-model worker (vLLM, torch, 1 GiB KV cache) takes about 3 GiB; a second one is only
# started when there is room for it with margin.
MEMORY_PER_WORKER = 4 * GIB
# make up's pool for the tiny model's generated adapter (adapter_pool), and that model's name.
ADAPTER_POOL = "lora"
TINY_MODEL_NAME = "tiny-llama"

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


class WorkerPool(BaseModel):
    """A further pool of workers (MeshSettings.worker_pools): a base model of its own, its
    workers and its adapters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    workers: int = Field(default=1, ge=1, le=16)
    lora_modules: dict[str, str] = {}


class LocalMeshSettings(BaseSettings):
    """Ports, replicas and model of the local mesh, from TOKENMESH_LOCALMESH_* variables."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENMESH_LOCALMESH_", frozen=True, extra="ignore"
    )

    # Where supervisord keeps its socket, pid file, generated configs and the services' logs.
    run_dir: Path = Path(".run")
    model: str = "models/tiny-llama"
    # LoRA adapters the workers serve on the model ({name: directory}, WorkerSettings'
    # lora_modules), e.g. {"tiny-llama-lora": "models/tiny-llama-lora"}, which `make setup`
    # generates. None by default: a worker with LoRA on refuses prompt logprobs (decision 0032).
    lora_modules: dict[str, str] = {}
    # Further pools of workers, each serving a base model of its own beside `model`'s
    # ({name: {"model": directory, "workers": n, "lora_modules": {...}}}): requests naming
    # a pool's model or adapters go to its workers; the served name is the directory's name.
    pools: dict[str, WorkerPool] = {}
    # `make up`'s default: the tiny model's generated adapter (`make setup`) served on a pool
    # of one worker of its own (ADAPTER_POOL), so a new user can call both while the model's
    # workers keep LoRA off and serve prompt logprobs (decisions 0032, 0035). Only with the
    # tiny model, its adapter, no adapters or pool of that name set, and memory for one worker
    # more; meshes made by on_free_ports (tests, benchmarks) leave it off unless asked.
    adapter_pool: bool = True
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
    # Worker streams go through the edge's stream relay, which moves a stream whose worker
    # went away (MeshSettings.stream_relay).
    stream_relay: bool = True
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
    # The workers' context and batch on this machine's CPU (a worker's own defaults are
    # vLLM's, sized for the hardware it finds).
    worker_max_model_len: int = Field(default=2048, ge=16)
    worker_max_num_seqs: int = Field(default=256, ge=1)
    # Front-end processes over each worker's engine (WorkerSettings.frontends).
    worker_frontends: int = Field(default=1, ge=1, le=64)
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
    # Admin keys of the control plane's adapter admin API (a file, one key a line; relative to
    # the repository root; ControlPlaneSettings.admin_keys_file, decision 0034); unset: the
    # admin API is off.
    admin_keys_file: Path | None = None
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
            "adapter_pool": False,
            "envoy_base_id": random.randint(10_000, 60_000),
            **ports,
        }
        return cls(**{**settings, **overrides})

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, pools: dict[str, WorkerPool]) -> dict[str, WorkerPool]:
        pool_names(pools)
        return pools

    def worker_count(self) -> int:
        """The default pool's workers."""
        if self.workers:
            return self.workers
        return 2 if psutil.virtual_memory().available >= 2 * MEMORY_PER_WORKER else 1

    def worker_pools(self) -> list[tuple[str, WorkerPool]]:
        """Every pool's workers, the default pool ("") first, then the further pools (the
        adapter's among them once resolved)."""
        default = WorkerPool(
            model=self.model, workers=self.worker_count(), lora_modules=self.lora_modules
        )
        return [("", default), *self.pools.items()]

    def pool_names(self) -> tuple[str, ...]:
        """The further pools' names, as Envoy and the gateways know them."""
        return tuple(self.pools)

    def resolved(self) -> tuple[LocalMeshSettings, str]:
        """These settings with what depends on the machine decided once (the default pool's
        workers, the adapter's pool), so every process of the mesh is made from the same;
        and why the adapter has no pool, if it has none."""
        adapter, why_not = self.adapter_pool_spec()
        pools = {**self.pools, **({ADAPTER_POOL: adapter} if adapter else {})}
        update = {"workers": self.worker_count(), "adapter_pool": False, "pools": pools}
        return self.model_copy(update=update), why_not

    def adapter_pool_spec(self) -> tuple[WorkerPool | None, str]:
        """With adapter_pool: the tiny model's adapter on a pool of its own, or None and why not."""
        if not self.adapter_pool:
            return None, "adapter_pool is off"
        model = Path(self.model)
        adapter = model.parent / f"{model.name}-lora"
        if model.name != TINY_MODEL_NAME or not (adapter / "adapter_config.json").exists():
            return None, f"no generated adapter for {self.model} (make setup makes {adapter})"
        if self.lora_modules or ADAPTER_POOL in self.pools:
            return None, f"lora_modules or a pool named {ADAPTER_POOL!r} are set"
        needed = (self.worker_count() + 1) * MEMORY_PER_WORKER
        if psutil.virtual_memory().available < needed:
            return None, f"less than {needed // GIB} GiB of memory free for one worker more"
        return WorkerPool(model=self.model, lora_modules={adapter.name: str(adapter)}), ""

    def mesh(self, certs: CertPaths | None = None) -> MeshSettings:
        """The mesh Envoy runs; with certs, TLS at the edge and mTLS to the services as the
        tls and mtls settings ask, the SDS files that deliver them next to the certificates."""
        edge = certs if certs is not None and self.tls else None
        upstream = certs if certs is not None and self.mtls else None
        # Checked: MeshSettings, like the services' settings, ignores a name it does not have.
        # Unlike theirs, it is built here, so TOKENMESH_MESH_* in this shell still apply.
        values: dict[str, Any] = dict(
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
            stream_relay=self.stream_relay,
            worker_pools=self.pool_names(),
        )
        return MeshSettings(**checked(MeshSettings, values))
