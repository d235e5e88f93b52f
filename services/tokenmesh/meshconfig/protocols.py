"""HTTP/2 as the listeners and the gRPC clusters speak it: flow-control windows and bounds."""

from __future__ import annotations

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


def grpc_upstream(mesh: MeshSettings, streams: int | None = None) -> Config:
    """A gRPC cluster's protocol options: HTTP/2 with the upstream windows; streams: its bound
    on one connection's streams, if it has one."""
    options = http2_options(mesh, upstream=True, streams=streams)
    return {
        HTTP_OPTIONS: {
            "@type": TYPE + HTTP_OPTIONS,
            "explicit_http_config": {"http2_protocol_options": options},
        }
    }
