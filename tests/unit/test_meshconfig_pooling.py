"""The edge's way to the reranker's model on OpenAI's API: /v1/embeddings and /v1/rerank reach
the gateways' HTTP API (its keys, limits, metrics and traces), whatever the token path; the
transcoder claims neither; the gateways reach EmbeddingService through their reranker listener
(docs/decisions/0022-embeddings-and-rerank-at-the-edge.md)."""

from __future__ import annotations

import pytest
from google.api import annotations_pb2

from tests.unit.test_meshconfig import listeners
from tests.unit.test_meshconfig_admin import routed
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.filters import transcoded_services
from tokenmesh.v1 import openai_pb2, rerank_pb2

POOLING_PATHS = ("/v1/embeddings", "/v1/rerank")


def routes_of(config: dict, listener: str) -> list[dict]:
    return list(listeners(config)[listener]["route_config"]["virtual_hosts"][0]["routes"])


@pytest.mark.parametrize("direct", [True, False], ids=["direct token path", "gateway path"])
def test_the_edge_sends_embeddings_and_rerank_to_the_gateways_http_api(direct: bool) -> None:
    config = render(MeshSettings(direct_token_path=direct))
    for path in POOLING_PATHS:
        assert routed(routes_of(config, "edge"), "POST", path) == "openai"


def test_without_the_openai_api_they_reach_no_http_api() -> None:
    config = render(MeshSettings(openai_api=False))
    for path in POOLING_PATHS:
        assert routed(routes_of(config, "edge"), "POST", path) == "gateway"


def test_the_transcoder_claims_neither_path() -> None:
    """Only OpenAIService's methods are transcoded on /v1/, and none of them is bound to the
    two paths: their JSON bodies reach the gateways as the caller sent them."""
    assert transcoded_services(MeshSettings())[-1] == "tokenmesh.v1.OpenAIService"
    bound = [
        method.GetOptions().Extensions[annotations_pb2.http].post
        for method in openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].methods
    ]
    assert bound == ["/v1/completions", "/v1/chat/completions"]
    assert not set(bound) & set(POOLING_PATHS)


def test_the_gateways_reach_the_embedding_service_through_their_reranker_listener() -> None:
    config = render(MeshSettings())
    service = rerank_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
    for method in ("Describe", "Embed", "Rank"):
        assert routed(routes_of(config, "reranker"), "POST", f"/{service}/{method}") == "reranker"
