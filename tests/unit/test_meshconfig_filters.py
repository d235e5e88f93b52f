"""The edge's HTTP filters: the transcoder's descriptors and the edge rate limit."""

from __future__ import annotations

from tests.unit.test_meshconfig import listeners
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.filters import descriptor_set


def test_transcoder_descriptor_holds_the_public_api() -> None:
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set()).file
    names = [file.name for file in files]
    assert names.index("tokenmesh/v1/token.proto") < names.index("tokenmesh/v1/llm.proto")
    services = {service.name for file in files for service in file.service}
    assert "LLMService" in services


def test_edge_rate_limit_is_a_shared_bucket_refusing_grpc_with_resource_exhausted() -> None:
    found = listeners(render(MeshSettings(edge_rate_limit_per_second=50, edge_rate_burst=80)))
    (limit,) = [
        f["typed_config"]
        for f in found["edge"]["http_filters"]
        if f["name"] == "envoy.filters.http.local_ratelimit"
    ]
    assert limit["token_bucket"] == {"max_tokens": 80, "tokens_per_fill": 50, "fill_interval": "1s"}
    # Unset, both fractions are 0 %: the filter would count nothing and refuse nothing.
    for key in ("filter_enabled", "filter_enforced"):
        assert limit[key]["default_value"] == {"numerator": 100, "denominator": "HUNDRED"}
    assert limit["rate_limited_as_resource_exhausted"] is True
    for name in ("worker", "reranker"):
        assert all("ratelimit" not in f["name"] for f in found[name]["http_filters"])
    off = listeners(render(MeshSettings(edge_rate_limit_per_second=0)))["edge"]
    assert all("ratelimit" not in f["name"] for f in off["http_filters"])
