"""The public gRPC API's calls as the gateway accounts for them, by the path their tokens took:
`gateway` (through this gateway: counted as its server ends them) or `direct` (a worker's
stream Envoy sent straight to the caller, known from Envoy's access log). Unlike grpc_server_*,
which count what this process's server handled, these count every call a gateway prepared or
served, once, whichever path it took."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmesh.common.metrics import RPC_BUCKETS
from tokenmesh.v1 import llm_pb2

LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
GATEWAY_PATH = "gateway"
DIRECT_PATH = "direct"


class CallMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "tokenmesh_gateway_calls",
            "Public API (LLMService) calls by method, the path their tokens took (gateway: "
            "through this gateway; direct: from a worker through Envoy, as Envoy logged it) "
            "and final status code.",
            ["grpc_service", "grpc_method", "path", "grpc_code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "tokenmesh_gateway_call_seconds",
            "Public API (LLMService) calls from their request to their end, by method and path.",
            ["grpc_method", "path"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )

    def record(self, method: str, path: str, code: str, seconds: float) -> None:
        self.calls.labels(LLM_SERVICE, method, path, code).inc()
        self.seconds.labels(method, path).observe(seconds)

    def ends(self, full_method: str) -> Callable[[str, float], None] | None:
        """For the server's interceptor: the gateway path's accounting of an LLMService
        method's calls (none for other services' methods)."""
        service, _, method = full_method.lstrip("/").partition("/")
        if service != LLM_SERVICE:
            return None

        def end(code: str, seconds: float) -> None:
            self.record(method, GATEWAY_PATH, code, seconds)

        return end
