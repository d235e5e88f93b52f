"""HTTP/2 as the listeners and the gRPC clusters speak it: flow-control windows and bounds."""

from __future__ import annotations

from tokenmesh.common.tokens import UPSTREAM_HEADER
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import TYPE, Config

HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def http2_options(mesh: MeshSettings, upstream: bool = False, streams: int | None = None) -> Config:
    """A listener's options, or (upstream) a cluster's: an upstream connection carries every
    stream of a gateway or worker, so its connection window must hold a stream window for each
    stream that may stall at once (connection_window / stream_window stalled readers would
    stop every other stream on it); each stream's own window still bounds what it buffers."""
    connection_window = (
        mesh.upstream_connection_window_bytes if upstream else mesh.connection_window_bytes
    )
    options: Config = {
        "initial_stream_window_size": mesh.stream_window_bytes,
        "initial_connection_window_size": connection_window,
        "max_concurrent_streams": streams or mesh.max_concurrent_streams,
    }
    if not upstream:
        options["max_outbound_frames"] = mesh.max_outbound_frames
    return options


def names_host() -> list[Config]:
    """A cluster's upstream filters that name the host that answered in its answer's headers
    (UPSTREAM_HEADER: the address Envoy connected to, overwriting any the host sent)."""
    return [
        {
            "name": "tokenmesh.names_upstream_host",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {
                    "response_mutations": [
                        {
                            "append": {
                                "header": {
                                    "key": UPSTREAM_HEADER,
                                    "value": "%UPSTREAM_REMOTE_ADDRESS%",
                                },
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }
                        }
                    ]
                },
            },
        },
        {
            "name": "envoy.filters.http.upstream_codec",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
            },
        },
    ]


def grpc_upstream(
    mesh: MeshSettings, streams: int | None = None, names_upstream_host: bool = False
) -> Config:
    """A gRPC cluster's protocol options: HTTP/2 with the upstream windows; streams: its bound
    on one connection's streams, if it has one; names_upstream_host: its answers name the host
    that answered (names_host)."""
    options = http2_options(mesh, upstream=True, streams=streams)
    protocol: Config = {
        "@type": TYPE + HTTP_OPTIONS,
        "explicit_http_config": {"http2_protocol_options": options},
    }
    if names_upstream_host:
        protocol["http_filters"] = names_host()
    return {HTTP_OPTIONS: protocol}
