"""The mesh description Envoy's configuration is rendered from (TOKENMESH_MESH_* variables)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenmesh.common.pools import pool_names

KIB = 1024
MIB = 1024 * KIB


class MeshSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENMESH_MESH_", frozen=True, extra="ignore")

    edge_host: str = Field(
        default="127.0.0.1",
        description=(
            "The public listener: gRPC (h2c), gRPC-Web and REST/JSON on one port; its address."
        ),
    )
    edge_port: int = Field(default=8080, ge=1, le=65535, description="The public listener's port.")
    edge_tls_cert_file: str | None = Field(
        default=None,
        description=(
            "TLS on the edge listener: PEM certificate chain file (with edge_tls_key_file: "
            "both or neither). Delivered over SDS (see sds_dir), they are read again when "
            "their directory is swapped (a renewed Kubernetes Secret)."
        ),
    )
    edge_tls_key_file: str | None = Field(
        default=None, description="TLS on the edge listener: the private key of edge_tls_cert_file."
    )
    upstream_tls_cert_file: str | None = Field(
        default=None,
        description=(
            "mTLS from Envoy to the services (the gateway, openai, worker and reranker clusters, "
            "their health checks included): Envoy's client certificate. Each service's "
            "certificate must carry its cluster's name (gateway, worker, reranker) as a DNS "
            "SAN, which Envoy also sends as SNI. With upstream_tls_key_file and "
            "upstream_tls_ca_file: all three or none; unset: plaintext between Envoy and the "
            "services."
        ),
    )
    upstream_tls_key_file: str | None = Field(
        default=None,
        description="mTLS from Envoy to the services: the key of upstream_tls_cert_file.",
    )
    upstream_tls_ca_file: str | None = Field(
        default=None,
        description=(
            "mTLS from Envoy to the services: the CA the services' certificates must chain to."
        ),
    )
    internal_tls_cert_file: str | None = Field(
        default=None,
        description=(
            "TLS on the internal listeners (the gateways' calls to workers and the reranker):"
            " Envoy's PEM server certificate chain (with internal_tls_key_file: both or "
            "neither), HTTP/2 only; the gateways trust the CA that signed it "
            "(TOKENMESH_GATEWAY_DEPENDENCY_TLS_CA_FILE)."
        ),
    )
    internal_tls_key_file: str | None = Field(
        default=None,
        description="TLS on the internal listeners: the key of internal_tls_cert_file.",
    )
    sds_dir: str | None = Field(
        default=None,
        description=(
            "Where Envoy reads the SDS files that deliver its certificates and CA, one per "
            "secret (bootstrap.secret_files(): `python -m tokenmesh.meshconfig --out` and the "
            "local mesh write them, the chart's ConfigMap carries them); required with any "
            "TLS file. Envoy re-reads a certificate only when SDS delivers it."
        ),
    )
    admin_host: str = Field(
        default="127.0.0.1",
        description="Envoy's admin interface (stats, clusters, health): its address.",
    )
    admin_port: int = Field(
        default=9901, ge=1, le=65535, description="Envoy's admin interface: its port."
    )
    stats_host: str = Field(
        default="127.0.0.1",
        description="The stats listener (see stats_port): its address.",
    )
    stats_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description=(
            "A listener that serves only GET /stats/prometheus and /ready from the admin "
            "interface (any other path: 404), so admin, which can also stop or drain Envoy, "
            "stays on 127.0.0.1 while probes and Prometheus reach the pod. Unset: no such "
            "listener (the local mesh reads admin itself)."
        ),
    )
    internal_host: str = Field(
        default="127.0.0.1",
        description=(
            "Listeners the gateways use to reach workers and the reranker, so every hop is "
            "balanced and observed by Envoy: their address. 0.0.0.0 when gateways run on "
            "other hosts (Kubernetes)."
        ),
    )
    worker_listener_port: int = Field(
        default=50060, ge=1, le=65535, description="The internal listener towards the workers."
    )
    reranker_listener_port: int = Field(
        default=50070, ge=1, le=65535, description="The internal listener towards the reranker."
    )
    controlplane_host: str = Field(
        default="127.0.0.1",
        description="Where the xDS control plane serves the clusters' endpoints (ADS): its host.",
    )
    controlplane_port: int = Field(
        default=18000, ge=1, le=65535, description="The xDS control plane's port."
    )
    ops_page_port: int = Field(
        default=9481,
        ge=1,
        le=65535,
        description=(
            "The control plane also serves the ops feed (tokenmesh.v1.OpsService, on "
            "controlplane_port) and the ops page's files over HTTP on this port; the edge "
            "routes both."
        ),
    )
    controlplane_discovery: Literal["STATIC", "STRICT_DNS"] = Field(
        default="STATIC",
        description=(
            "How Envoy finds the control plane: STATIC when controlplane_host is an IP (local"
            " runs), STRICT_DNS when it is a DNS name (a Kubernetes Service), re-resolved as "
            "it changes."
        ),
    )
    node_id: str = Field(
        default="tokenmesh-envoy", description="Envoy's node identity towards the control plane."
    )

    stream_window_bytes: int = Field(
        default=64 * KIB,
        ge=65535,
        description=(
            "HTTP/2 flow-control window per stream on listeners and clusters (Envoy's edge "
            "best practice: 64 KiB per stream, 1 MiB per connection). A client that stops "
            "reading stops its senders after about a window per hop instead of Envoy "
            "buffering the stream (with Envoy's default 256 MiB windows it holds everything);"
            " token streams need far less than a window per round trip."
        ),
    )
    connection_window_bytes: int = Field(
        default=1 * MIB,
        ge=65535,
        description=(
            "HTTP/2 flow-control window per connection on listeners and clusters (see "
            "stream_window_bytes)."
        ),
    )
    upstream_connection_window_bytes: int = Field(
        default=64 * MIB,
        ge=65535,
        description=(
            "HTTP/2 connection window, in bytes, that Envoy grants a gateway or worker: their "
            "streams share a few connections, so it holds a stream window for each of 1,024 "
            "stalled streams (docs/decisions/0004-small-http2-windows-for-backpressure.md). "
            "What a stream buffers is still its own window."
        ),
    )
    buffer_limit_bytes: int = Field(
        default=1 * MIB,
        ge=16 * 1024,
        description=(
            "What Envoy buffers per connection (and per stream) before it stops reading from "
            "the other side. It must hold the largest REST/JSON request body, which the "
            "transcoder buffers whole."
        ),
    )
    max_outbound_frames: int = Field(
        default=128 * 1024,
        ge=10_000,
        description=(
            "HTTP/2 frames Envoy may queue towards one client before it cuts the connection "
            "as a flood. Above what flow control lets Envoy queue (buffer_limit_bytes, each "
            "stream's window), so flow control acts first for ~64 stalled streams of "
            "one-token frames (docs/decisions/0013-envoy-outbound-frames-limit.md)."
        ),
    )
    max_concurrent_streams: int = Field(
        default=2048,
        ge=1,
        description=(
            "Streams one downstream connection may carry (one client channel multiplexes many)."
        ),
    )
    worker_streams_per_connection: int = Field(
        default=64,
        ge=1,
        description=(
            "Streams Envoy puts on one connection to a worker before it opens another. A "
            "worker with several front ends serves one port with all of them (SO_REUSEPORT) "
            "and the kernel spreads connections, not streams, over them; Envoy's own bound "
            "(never a lower one the worker announces, which would refuse the streams Envoy "
            "sends before it hears of it) keeps the spread following the load."
        ),
    )
    stream_idle_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A stream with no bytes in either direction for this long is cut (a stalled "
            "client). Generation streams send a token every few ms, so only dead streams go "
            "this long."
        ),
    )
    retry_attempts: int = Field(
        default=2,
        ge=0,
        description=(
            "Retries happen only before response headers, i.e. before the first token: safe."
        ),
    )
    retry_budget_percent: float = Field(
        default=100.0,
        gt=0,
        le=100,
        description=(
            "Percent of active requests that retries may add (a retry budget, not a count), "
            "and always at least retry_min_concurrency. Envoy counts the requests still active "
            "when it decides, without the dead host's: losing half the workers at once, whose "
            "unanswered streams all need a retry, takes as many retries as the other half's "
            "requests (docs/decisions/0018-retry-budget-covers-half-the-fleet.md)."
        ),
    )
    retry_min_concurrency: int = Field(
        default=64,
        ge=1,
        description=(
            "Retries always allowed at once, whatever retry_budget_percent allows: the streams "
            "a dead worker leaves unanswered (its queue, its prefills) may outnumber the "
            "requests the others still carry, and each needs a retry at once "
            "(docs/decisions/0027-retry-budget-of-the-requests-left.md)."
        ),
    )
    health_check_interval_seconds: float = Field(
        default=0.5,
        gt=0,
        description=(
            "Active gRPC health checks: how often, and how fast an idle cluster is still "
            "checked (Envoy's default no_traffic_interval of 60 s leaves idle clusters "
            "unchecked)."
        ),
    )
    health_check_timeout_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "A check unanswered this long fails. The services answer from their gRPC "
            "server's own loop (a worker's engine runs on another), so a busy worker still "
            "answers in well under a second (docs/failure-behaviour.md)."
        ),
    )
    health_check_unhealthy_threshold: int = Field(
        default=2,
        ge=1,
        description=(
            "Checks unanswered (or refused) in a row that take a host out: with the "
            "defaults a host that hangs is out after about 2.5 s, and one late answer never "
            "takes it out. A host that answers NOT_SERVING is out at once, whatever this says."
        ),
    )
    health_check_healthy_threshold: int = Field(
        default=1,
        ge=1,
        description=(
            "Passing checks in a row that bring a host back (a new host is in at its first)."
        ),
    )
    healthy_panic_threshold_percent: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description=(
            "Below this share of healthy hosts Envoy sends to every host, unhealthy ones "
            "included (its default, 50, would send streams to loading or dead workers). 0: "
            "never; with no healthy host a request fails UNAVAILABLE at once."
        ),
    )
    max_request_headers_kib: int = Field(
        default=60,
        ge=1,
        le=8192,
        description=(
            "Edge protections (docs/security.md). Request headers, all of them together, "
            "larger than this are refused (HTTP/2: the stream is reset; HTTP/1.1: 431). gRPC "
            "clients send a few hundred bytes; Envoy's own default is the same 60 KiB."
        ),
    )
    max_headers_count: int = Field(
        default=100,
        ge=1,
        description=(
            "Request headers (name/value pairs) per request; more are refused like oversized ones."
        ),
    )
    request_headers_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "A client must send its whole request headers within this long of opening the "
            "stream (slowloris); streaming bodies are not affected."
        ),
    )
    max_edge_connections: int = Field(
        default=10_000,
        ge=1,
        description=(
            "Client connections open at once on the edge (Envoy's overload manager); more are"
            " closed as soon as they are accepted. The internal listeners and admin are not "
            "counted, so the gateways' calls and health checks still get through when the "
            "edge is full."
        ),
    )
    edge_rate_limit_per_second: int = Field(
        default=1000,
        ge=0,
        description=(
            "The edge's last line of defence against floods: a token bucket shared by every "
            "client, refilled with this many requests each second (0: off), holding at most "
            "edge_rate_burst. Far above what the gateways can serve; per-tenant limits are "
            "the gateways' job. A refused request gets RESOURCE_EXHAUSTED (HTTP 429 for REST)"
            " before reaching a gateway."
        ),
    )
    edge_rate_burst: int = Field(
        default=2000,
        ge=1,
        description="Requests the edge's token bucket holds (see edge_rate_limit_per_second).",
    )
    openai_api: bool = Field(
        default=True,
        description=(
            "OpenAI's HTTP API at the edge: /v1/... to the gateways' openai_port (the Envoy "
            "cluster `openai`, whose endpoints the control plane sends like the others')."
        ),
    )
    worker_routing: Literal["least_request", "prefix", "picker"] = Field(
        default="prefix",
        description=(
            "How Envoy picks a worker for a stream. least_request: the one with the fewest "
            "streams in flight (of two drawn at random). prefix: by the gateway's prefix-"
            "affinity key (x-tokenmesh-affinity), consistently hashed (Maglev) under bounded "
            "load, so requests whose prompts start alike reach the worker that holds that "
            "prefix's KV cache. picker: the worker the gateway's endpoint picker names "
            "(x-tokenmesh-worker: the first in the key's rendezvous ranking whose queue is "
            "within the gateway's picker slack of the least-loaded worker's, from the "
            "workers' own figures the control plane feeds it), least_request without one "
            "(docs/architecture.md, prefix-aware routing)."
        ),
    )
    prefix_balance_factor_percent: int = Field(
        default=125,
        ge=100,
        description=(
            "With worker_routing prefix: no worker takes more than this percentage of the mean "
            "streams in flight per worker (as this Envoy counts them); a key whose worker is "
            "over it goes to the next on the hash ring (Envoy's hash_balance_factor)."
        ),
    )
    direct_token_path: bool = Field(
        default=True,
        description=(
            "Generate's tokens go from a worker through Envoy straight to the caller: the "
            "edge asks a gateway (Envoy's external processor) to validate and prepare each "
            "request, then routes it to the workers, so no gateway reads and writes every "
            "token (docs/architecture.md, the direct token path). Off: every token passes "
            "through a gateway, as every other method's messages do (a worker that dies "
            "mid-stream then ends its streams UNAVAILABLE with a message, not a reset)."
        ),
    )
    stream_relay: bool = Field(
        default=True,
        description=(
            "Each worker stream the edge takes goes through the edge's stream relay "
            "(envoy/relay, an Envoy dynamic module, behind an Envoy internal listener) instead "
            "of the router, so a stream whose worker goes away mid-stream (killed, its "
            "connection cut, its engine dead) goes on at another worker from the token where "
            "it stopped; its worker streams are placed as worker_routing says, as the "
            "router's are. Envoy loads the module from ENVOY_DYNAMIC_MODULES_SEARCH_PATH "
            "(localmesh builds it with gcc; the chart's Envoy image carries it). On the "
            "gateways' path (direct_token_path off) the gateway moves a stream itself and the "
            "edge has no worker stream to relay."
        ),
    )
    max_resumptions: int = Field(
        default=2,
        ge=0,
        le=16,
        description=(
            "With stream_relay: how many times a stream may move to another worker; past "
            "it the caller gets UNAVAILABLE saying how far the stream got."
        ),
    )
    relay_max_delivered_bytes: int = Field(
        default=16 * MIB,
        ge=0,
        description=(
            "With stream_relay: the bytes of a stream's delivered messages the relay keeps "
            "for a move; a stream past it is relayed on but can no longer move."
        ),
    )
    prepare_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "How long the edge waits for a gateway to prepare a request (its reranker call "
            "included); past it the caller gets an error."
        ),
    )
    worker_pools: tuple[str, ...] = Field(
        default=(),
        description=(
            "Further pools of workers, each serving a base model of its own beside the "
            "default pool's (the cluster worker): a pool `name` is the cluster worker-name, "
            "with the workers' balancing, checks and ejection, and a request the gateway "
            "names it for (x-tokenmesh-pool) goes to it, on the direct path, through the "
            "stream relay and from the gateways alike. The gateways' worker_pools name the "
            "same pools. JSON in TOKENMESH_MESH_WORKER_POOLS."
        ),
    )
    cors_allowed_origins: list[str] = Field(
        default=[r"https?://(localhost|127\.0\.0\.1)(:[0-9]+)?"],
        description="CORS origins allowed to call the edge with gRPC-Web (regular expressions).",
    )

    @field_validator("worker_pools")
    @classmethod
    def _pool_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return pool_names(names)

    @model_validator(mode="after")
    def _tls_files_come_in_pairs(self) -> Self:
        if (self.edge_tls_cert_file is None) != (self.edge_tls_key_file is None):
            raise ValueError("edge_tls_cert_file and edge_tls_key_file go together")
        if (self.internal_tls_cert_file is None) != (self.internal_tls_key_file is None):
            raise ValueError("internal_tls_cert_file and internal_tls_key_file go together")
        upstream = (
            self.upstream_tls_cert_file,
            self.upstream_tls_key_file,
            self.upstream_tls_ca_file,
        )
        if any(path is None for path in upstream) and any(path is not None for path in upstream):
            raise ValueError(
                "upstream_tls_cert_file, upstream_tls_key_file and upstream_tls_ca_file go together"
            )
        tls = (self.edge_tls_cert_file, self.internal_tls_cert_file, self.upstream_tls_cert_file)
        if self.sds_dir is None and any(path is not None for path in tls):
            raise ValueError("TLS files need sds_dir, where Envoy reads their SDS files")
        return self

    @property
    def relays(self) -> bool:
        """The edge's routes to the workers go through the stream relay: stream_relay, on the
        direct token path."""
        return self.stream_relay and self.direct_token_path

    @property
    def upstream_mtls(self) -> bool:
        """Envoy talks to the services over mTLS."""
        return self.upstream_tls_cert_file is not None


# In the Kubernetes profile the control plane's Service name depends on the Helm release, so
# the rendered file carries this placeholder and the chart's ConfigMap template replaces it.
CONTROLPLANE_HOST_PLACEHOLDER = "${TOKENMESH_CONTROLPLANE_HOST}"


# Where the chart mounts the edge certificate (a kubernetes.io/tls Secret) in the Envoy pods.
KUBERNETES_TLS_DIR = "/etc/envoy/tls"


# Where the chart mounts Envoy's client certificate for mTLS to the services (tls.crt, tls.key
# and the CA, ca.crt: a cert-manager Secret's layout), and its internal listeners' certificate.
KUBERNETES_MTLS_DIR = "/etc/envoy/mtls"
KUBERNETES_INTERNAL_TLS_DIR = "/etc/envoy/internal-tls"
# Where the chart mounts Envoy's ConfigMap: the bootstrap and the SDS files it names.
KUBERNETES_CONFIG_DIR = "/etc/envoy/config"


# The stats listener's port in the Kubernetes profile (probes, Prometheus); the chart reads it
# from the rendered file.
KUBERNETES_STATS_PORT = 9902


def kubernetes_profile(tls: bool = False, mtls: bool = False, relay: bool = False) -> MeshSettings:
    """The mesh as the Helm chart runs it: Envoy in its own pods, listening on every interface
    (the edge for clients, the internal listeners for gateways, the stats listener for probes
    and metrics; admin on 127.0.0.1 only: any pod could otherwise stop or drain Envoy), and
    the control plane reached through its Service's DNS name; with tls, the edge speaks
    TLS with the certificate mounted at KUBERNETES_TLS_DIR; with mtls, Envoy reaches the
    services over mTLS with the client certificate mounted at KUBERNETES_MTLS_DIR, and its
    internal listeners speak TLS with the one at KUBERNETES_INTERNAL_TLS_DIR; the SDS files
    that deliver them are in the ConfigMap, at KUBERNETES_CONFIG_DIR; with relay, the workers'
    streams go through the edge's stream relay."""
    return MeshSettings(
        stream_relay=relay,
        edge_tls_cert_file=f"{KUBERNETES_TLS_DIR}/tls.crt" if tls else None,
        edge_tls_key_file=f"{KUBERNETES_TLS_DIR}/tls.key" if tls else None,
        upstream_tls_cert_file=f"{KUBERNETES_MTLS_DIR}/tls.crt" if mtls else None,
        upstream_tls_key_file=f"{KUBERNETES_MTLS_DIR}/tls.key" if mtls else None,
        upstream_tls_ca_file=f"{KUBERNETES_MTLS_DIR}/ca.crt" if mtls else None,
        internal_tls_cert_file=f"{KUBERNETES_INTERNAL_TLS_DIR}/tls.crt" if mtls else None,
        internal_tls_key_file=f"{KUBERNETES_INTERNAL_TLS_DIR}/tls.key" if mtls else None,
        sds_dir=KUBERNETES_CONFIG_DIR,
        edge_host="0.0.0.0",
        admin_host="127.0.0.1",
        stats_host="0.0.0.0",
        stats_port=KUBERNETES_STATS_PORT,
        internal_host="0.0.0.0",
        controlplane_host=CONTROLPLANE_HOST_PLACEHOLDER,
        controlplane_discovery="STRICT_DNS",
    )
