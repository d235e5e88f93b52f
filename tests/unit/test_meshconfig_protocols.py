"""HTTP/2 flow control on the listeners and the gRPC clusters."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tests.unit.test_meshconfig import listeners
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.stream_relay import RELAY


def test_flow_control_limits_reach_every_listener_and_cluster() -> None:
    config = render(MeshSettings(stream_window_bytes=65536, buffer_limit_bytes=32768))
    resources = config["static_resources"]
    clusters = [c for c in resources["clusters"] if c["type"] != "STATIC"]
    for item in resources["listeners"] + clusters:
        # The relay's listener tells the relay of a slow caller at a stream window.
        limit = 65536 if item["name"] == RELAY else 32768
        assert item["per_connection_buffer_limit_bytes"] == limit, item["name"]
    for cluster in clusters:
        if cluster["name"] == "openai":
            continue  # HTTP/1.1: a connection per request in flight
        options = next(iter(cluster["typed_extension_protocol_options"].values()))
        http2 = options["explicit_http_config"]["http2_protocol_options"]
        assert http2["initial_stream_window_size"] == 65536, cluster["name"]


def test_listeners_queue_frames_up_to_the_flood_limit_and_clusters_keep_envoys_own() -> None:
    config = render(MeshSettings(max_outbound_frames=50_000))
    for manager in listeners(config).values():
        assert manager["http2_protocol_options"]["max_outbound_frames"] == 50_000
    for cluster in config["static_resources"]["clusters"]:
        options = cluster.get("typed_extension_protocol_options", {})
        assert "max_outbound_frames" not in json.dumps(options), cluster["name"]
    with pytest.raises(ValidationError):
        MeshSettings(max_outbound_frames=100)
