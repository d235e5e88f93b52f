"""What every part of Envoy's config shares: the config's type, type URLs, the clusters' names."""

from __future__ import annotations

from typing import Any

Config = dict[str, Any]

TYPE = "type.googleapis.com/"
HCM = TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = TYPE + "envoy.extensions.filters.http.router.v3.Router"

# The service clusters (named after their services), and the control plane's.
GATEWAY = "gateway"
WORKER = "worker"
RERANKER = "reranker"
# The gateways' OpenAI HTTP API: its cluster (the gateways' openai_port) and the edge's paths
# to it.
OPENAI_CLUSTER = "openai"
OPENAI_PREFIX = "/v1/"
# vLLM's tokenizer routes, outside /v1/ as its server has them; served by the same gateways.
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
XDS_CLUSTER = "xds_cluster"
OPS_CLUSTER = "ops"
OPS_PAGE_CLUSTER = "ops_page"


def seconds(value: float) -> str:
    """A duration as Envoy reads it."""
    return f"{value:g}s"
