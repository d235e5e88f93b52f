"""Typed settings every service shares; each service subclasses with its own env prefix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenmesh.common.cpu_pinning import known_cores, parse_cores

MIB = 1024 * 1024


class ServiceSettings(BaseSettings):
    """Server, metrics, logging and tracing settings; a subclass sets env_prefix
    (TOKENMESH_<SERVICE>_)."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore")

    host: str = Field(
        default="127.0.0.1", description="Address the gRPC server binds; 0.0.0.0 in containers."
    )
    port: int = Field(
        default=50051,
        ge=0,
        le=65535,
        description="gRPC port; 0 picks a free port (tests read the bound port back).",
    )
    metrics_host: str = Field(
        default="127.0.0.1", description="Address the Prometheus metrics endpoint (HTTP) binds."
    )
    metrics_port: int = Field(
        default=9090,
        ge=-1,
        le=65535,
        description="Prometheus metrics over HTTP; 0 picks a free port, -1 turns the endpoint off.",
    )
    drain_seconds: float = Field(
        default=1.0,
        ge=0,
        description=(
            "On SIGTERM: seconds the service answers health checks NOT_SERVING while it still "
            "accepts new RPCs, before it stops accepting them; at least the time every Envoy "
            "checking it takes to see NOT_SERVING (one health-check interval and the check "
            "itself). An RPC that reaches a server which has stopped accepting ends CANCELLED, "
            "and Envoy does not retry that."
        ),
    )
    grace_seconds: float = Field(
        default=10.0,
        ge=0,
        description="On SIGTERM: seconds in-flight RPCs get to finish before they are cancelled.",
    )
    cpu_affinity: str = Field(
        default="",
        description=(
            'Cores this service\'s threads run on, e.g. "1" or "2-7" (empty: wherever the '
            "kernel puts them): on a machine that runs an engine, the cores the engine does "
            "not use. A worker's own engine keeps the cores it binds (cpu_threads_bind)."
        ),
    )
    gil_switch_interval_ms: float = Field(
        default=5.0,
        gt=0,
        le=100,
        description=(
            "Milliseconds a thread of this process may hold Python's GIL while another waits "
            "for it (sys.setswitchinterval; 5 is Python's own default). A worker runs its "
            "engine's output handling and its gRPC server on two threads of one process, so "
            "each turn of the server's loop (accepting a call, reading a request, writing a "
            "token) can wait this long behind the engine's thread. Whether shorter helps is "
            "not settled: measure on your machine (loadtests.token_cost --worker-variant, "
            "docs/decisions/0036)."
        ),
    )
    log_level: str = Field(
        default="INFO", description="Python logging level: DEBUG, INFO, WARNING, ERROR."
    )
    log_format: Literal["json", "text"] = Field(
        default="json",
        description="json: one object per line for log shippers; text: for humans at a terminal.",
    )
    log_tokens: bool = Field(
        default=False,
        description=(
            "Log each token's send time at DEBUG (logger tokenmesh.tokens), whatever "
            "log_level says; for chasing latency, far too verbose for normal use. Decided "
            "once per stream."
        ),
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description=(
            'OTLP/gRPC collector (e.g. "127.0.0.1:4317" or "http://jaeger:4317") that spans '
            "are exported to; unset means tracing is off: no exporter, no spans. Batching "
            "follows the standard OTEL_BSP_* variables (OTEL_BSP_SCHEDULE_DELAY: 5000 ms)."
        ),
    )
    consul_http_addr: str | None = Field(
        default_factory=lambda: os.environ.get("CONSUL_HTTP_ADDR") or None,
        description=(
            'Consul agent HTTP address ("127.0.0.1:8500" or "http[s]://host:port"). When set,'
            " the service registers itself there with a gRPC health check while SERVING, and "
            "deregisters on shutdown. Defaults to the standard CONSUL_HTTP_ADDR variable; "
            "unset means no Consul."
        ),
    )
    advertise_host: str | None = Field(
        default=None,
        description=(
            "IP registered in Consul (so Envoy's endpoint); defaults to host, or to this "
            "machine's address when host is a wildcard such as 0.0.0.0."
        ),
    )

    tls_cert_file: Path | None = Field(
        default=None,
        description=(
            "mTLS on the gRPC port, and the gateway's OpenAI port (docs/security.md, TLS): "
            "this service's PEM certificate "
            "chain. With tls_key_file and tls_client_ca_file: all three or none; set, the "
            "port speaks only TLS and refuses clients without a certificate from that CA. "
            "The gRPC port reads the files again when they change (docs/security.md, "
            "Certificate renewal); the OpenAI port reads them at start-up."
        ),
    )
    tls_key_file: Path | None = Field(
        default=None, description="mTLS on the gRPC port: the PEM key of tls_cert_file."
    )
    tls_client_ca_file: Path | None = Field(
        default=None,
        description=(
            "mTLS on the gRPC port: the CA that signs the certificates clients must present "
            "(Envoy's)."
        ),
    )
    health_port: int = Field(
        default=-1,
        ge=-1,
        le=65535,
        description=(
            "A plaintext port serving only grpc.health.v1 (the same status as the service "
            "port), for probes that cannot present a client certificate, such as Kubernetes' "
            "native gRPC probes, while the service port wants mTLS. It exposes nothing but "
            "that status. -1: none; 0 picks a free port."
        ),
    )

    max_message_bytes: int = Field(
        default=4 * MIB,
        ge=1024,
        description=(
            "Largest protobuf message accepted or sent; bigger ones fail with RESOURCE_EXHAUSTED."
        ),
    )
    max_concurrent_streams: int = Field(
        default=2048,
        ge=1,
        description=(
            "HTTP/2 streams one connection may carry at once (Envoy multiplexes many on one)."
        ),
    )
    keepalive_time_ms: int = Field(
        default=5_000,
        ge=1,
        description=(
            "Server pings an idle connection this often to detect dead peers behind NATs/LBs."
        ),
    )
    keepalive_timeout_ms: int = Field(
        default=10_000,
        ge=1,
        description=(
            "Milliseconds a keepalive ping may go unanswered before the connection closes, "
            "with every stream on it; long enough for a CPU-starved peer to answer "
            "(docs/decisions/0011-keepalive-timeout-10-seconds.md)."
        ),
    )
    keepalive_permit_without_calls: bool = Field(
        default=True,
        description=(
            "Allow client pings even with no RPC in flight (clients keep idle channels warm)."
        ),
    )
    min_ping_interval_ms: int = Field(
        default=4_000,
        ge=0,
        description=(
            "Client pings closer together than this are abuse (GOAWAY too_many_pings); below "
            "clients' 5 s keepalive so well-behaved clients are never cut off."
        ),
    )
    max_connection_idle_ms: int = Field(
        default=300_000,
        ge=1,
        description="Close connections idle this long, so stale client connections do not pile up.",
    )
    max_connection_age_ms: int = Field(
        default=1_800_000,
        ge=1,
        description=(
            "Ask clients to reconnect after this long, so load re-balances across replicas."
        ),
    )
    max_connection_age_grace_ms: int = Field(
        default=300_000,
        ge=0,
        description=(
            "After max_connection_age, in-flight streams get this long to finish before the close."
        ),
    )

    @field_validator("cpu_affinity")
    @classmethod
    def _known_cores(cls, value: str) -> str:
        known_cores(value)
        return value

    @property
    def cores(self) -> frozenset[int]:
        return parse_cores(self.cpu_affinity)

    @model_validator(mode="after")
    def _tls_files_go_together(self) -> Self:
        files = (self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        if any(path is None for path in files) and any(path is not None for path in files):
            raise ValueError("tls_cert_file, tls_key_file and tls_client_ca_file go together")
        return self
