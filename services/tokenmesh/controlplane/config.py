"""Control plane settings, from TOKENMESH_CONTROLPLANE_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from tokenmesh.common.settings import ServiceSettings


class ControlPlaneSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOKENMESH_CONTROLPLANE_", frozen=True, extra="ignore"
    )

    port: int = Field(
        default=18000,
        ge=0,
        le=65535,
        description="Envoy's bootstrap points its xds_cluster here.",
    )
    metrics_port: int = Field(default=9480, ge=-1, le=65535)
    grace_seconds: float = Field(
        default=2.0,
        ge=0,
        description=(
            "xDS streams never end on their own: shutdown closes them at once (Envoy keeps "
            "its endpoints and reconnects), so only other RPCs ever use this."
        ),
    )

    source: Literal["static", "consul", "dns"] = Field(
        default="static",
        description=(
            'Where endpoints come from: "static" (static_file), "consul" (consul_http_addr) '
            'or "dns" (dns_targets).'
        ),
    )

    static_file: Path | None = Field(
        default=None,
        description=(
            'JSON or YAML (by suffix .yaml/.yml): {"clusters": {"worker": ["127.0.0.1:50061",'
            ' {"address": "127.0.0.1:50062", "healthy": false}], ...}}. Addresses must be IPs'
            " (EDS does no DNS). Re-read when it changes; a malformed edit is logged and the "
            "last good one kept."
        ),
    )
    static_poll_seconds: float = Field(
        default=0.25,
        gt=0,
        description=(
            "How often the file's mtime/size/inode is checked; an edit reaches Envoy within "
            "about this."
        ),
    )

    consul_services: list[str] = Field(
        default=["gateway", "worker", "reranker"],
        min_length=1,
        description="Consul service names watched; each is the Envoy cluster of the same name.",
    )
    consul_passing_only: bool = Field(
        default=False,
        description=(
            "True: only instances whose checks all pass are sent. False: every instance is "
            "sent, with health_status UNHEALTHY when a check is not passing, so Envoy's "
            "/clusters shows why it is skipped. (Envoy's panic threshold may route to "
            "UNHEALTHY hosts when most are unhealthy; choose True to rule that out.)"
        ),
    )
    consul_wait_seconds: float = Field(
        default=15.0,
        gt=0,
        le=600,
        description=(
            "Longest a Consul blocking query is held when nothing changes; changes return at once."
        ),
    )
    consul_backoff_initial_seconds: float = Field(
        default=0.2,
        gt=0,
        description=(
            "Retry delays after Consul errors: doubling from this up to "
            "consul_backoff_max_seconds, jittered. Until Consul answers again the last known "
            "endpoints keep being served."
        ),
    )
    consul_backoff_max_seconds: float = Field(
        default=10.0, gt=0, description="The longest retry delay after Consul errors."
    )
    dns_targets: dict[str, str] = Field(
        default={},
        description=(
            'Cluster name -> "host:port" whose A/AAAA records are the cluster\'s endpoints, '
            'e.g. {"worker": "tokenmesh-worker-headless.default.svc.cluster.local.:50061"} (a'
            " Kubernetes headless Service resolves to its ready pods). JSON in "
            "TOKENMESH_CONTROLPLANE_DNS_TARGETS."
        ),
    )
    dns_poll_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "How often every name is resolved again; a pod turning ready reaches Envoy within"
            " about this plus the cluster DNS cache (CoreDNS: 5 s for headless Services by "
            "default)."
        ),
    )
    register_self: bool = Field(
        default=True,
        description="Register the control plane itself in Consul (when consul_http_addr is set).",
    )

    prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description=(
            "The ops feed (tokenmesh.v1.OpsService on the gRPC port). Fleet figures (rates, "
            "TTFT, circuits, errors) come from this Prometheus, e.g. http://127.0.0.1:9090; "
            "unset, the feed carries worker figures only and says so in each snapshot's "
            "warnings."
        ),
    )
    prometheus_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        le=30,
        description="Longest a Prometheus query may take before the snapshot goes out without it.",
    )
    ops_rate_window: str = Field(
        default="30s",
        pattern=r"^[0-9]+[smh]$",
        description=(
            "Window of requests/s, tokens/s and the workers' prefix-cache hit ratios: at least "
            "two scrape intervals (the mesh scrapes every 2 s); shorter follows changes faster, "
            "longer is smoother. A PromQL duration."
        ),
    )
    worker_probe_timeout_seconds: float = Field(
        default=1.0,
        gt=0,
        le=30,
        description=(
            "Longest a worker's health check and GetEngineStats may take; a slower worker is "
            "shown with an error instead of holding up the snapshot."
        ),
    )
    worker_tls_ca_file: Path | None = Field(
        default=None,
        description=(
            "The ops feed's calls to the workers' gRPC ports over TLS (needed when the "
            "workers speak mTLS): the PEM CA that signed their certificates. Unset: "
            "plaintext. The TLS files are read again when they change (renewal)."
        ),
    )
    worker_tls_cert_file: Path | None = Field(
        default=None,
        description=(
            "The client certificate (PEM chain) the ops feed presents to the workers, from the"
            " CA their tls_client_ca_file names; with worker_tls_key_file and "
            "worker_tls_ca_file."
        ),
    )
    worker_tls_key_file: Path | None = Field(
        default=None, description="The PEM key of worker_tls_cert_file."
    )
    worker_tls_server_name: str = Field(
        default="worker",
        min_length=1,
        description=(
            "The DNS name the workers' certificates must carry: the feed dials their IP "
            "addresses, which the certificates need not name (Envoy checks the same name)."
        ),
    )
    ops_page_port: int = Field(
        default=9481,
        ge=-1,
        le=65535,
        description=(
            "The ops page's static files over HTTP (Envoy's edge routes /ops/ here); 0 picks "
            "a free port, -1 turns it off."
        ),
    )
    ops_page_dir: Path | None = Field(
        default=None,
        description=(
            "The built page (ops/dist after `make ops-page`); unset or unbuilt, /ops/ answers"
            " 404 saying how to build it."
        ),
    )

    admin_keys_file: Path | None = Field(
        default=None,
        description=(
            "The adapter admin API (tokenmesh.v1.AdapterAdmin on the gRPC port, which the edge "
            "routes here; decision 0034): a file of admin keys, one a line (# comments), read "
            "again when it changes; a call must carry `authorization: Bearer <key>` "
            "(UNAUTHENTICATED otherwise). Unset: the API is off, every call PERMISSION_DENIED "
            "saying so."
        ),
    )
    admin_worker_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description=(
            "Longest one worker's part of an admin call may take (loading an adapter reads its "
            "weights: seconds from network storage for a large one); a slower worker is "
            "reported DEADLINE_EXCEEDED."
        ),
    )
    admin_reconcile_seconds: float = Field(
        default=30.0,
        gt=0,
        description=(
            "How often the adapters loaded or forgotten through the admin API are applied again "
            "to workers that lack them (one that restarted at the same address); a change in "
            "discovery does it at once."
        ),
    )

    @model_validator(mode="after")
    def _source_is_configured(self) -> Self:
        if self.source == "static" and self.static_file is None:
            raise ValueError("source=static needs static_file")
        if self.source == "dns" and not self.dns_targets:
            raise ValueError("source=dns needs dns_targets")
        if self.source == "consul" and not self.consul_http_addr:
            raise ValueError("source=consul needs consul_http_addr (or CONSUL_HTTP_ADDR)")
        if self.consul_backoff_initial_seconds > self.consul_backoff_max_seconds:
            raise ValueError("consul_backoff_initial_seconds exceeds consul_backoff_max_seconds")
        if (self.worker_tls_cert_file is None) != (self.worker_tls_key_file is None):
            raise ValueError("worker_tls_cert_file and worker_tls_key_file go together")
        if self.worker_tls_cert_file is not None and self.worker_tls_ca_file is None:
            raise ValueError("worker_tls_cert_file needs worker_tls_ca_file")
        if self.admin_keys_file is not None and not self.admin_keys_file.is_file():
            raise ValueError(f"admin_keys_file: {self.admin_keys_file} is not a file")
        return self
