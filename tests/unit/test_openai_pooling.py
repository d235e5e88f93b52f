"""/v1/embeddings and /v1/rerank on the gateway's HTTP API, against a real gRPC reranker server
whose model is a fake encoder: OpenAI's and vLLM's answer shapes, base64 as the SDK decodes it,
the gRPC reranker's order, every bad request a 400 naming the field (unknown fields, token ids,
wrong types, the reranker's limits), an unknown model 404, no reranker 503, no key 401, and
/v1/models listing the embedding model. tests/integration/test_openai_embeddings.py runs the
same paths through the real mesh and MiniLM."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest
from grpc import aio
from numpy.typing import NDArray
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.gateway.app import Tenancy
from tokenmesh.gateway.client_interceptors import TraceContextClientInterceptor, for_every_arity
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.catalog import ModelCard
from tokenmesh.gateway.core.tenancy.auth import hash_key
from tokenmesh.gateway.core.tenancy.http import HttpTenancy
from tokenmesh.gateway.frontends.openai.api import OpenAIApi
from tokenmesh.gateway.frontends.openai.http import HttpMetrics
from tokenmesh.gateway.frontends.openai.pooling import (
    EmbeddingClient,
    EmbeddingRequest,
    PoolingApi,
    RerankRequest,
    parse,
)
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.metrics import RerankMetrics
from tokenmesh.reranker.model import BiEncoderScorer, RerankerSlot
from tokenmesh.reranker.requests import ModelInfo
from tokenmesh.reranker.servicer import EmbeddingServicer, RerankServicer
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

MODEL = "fake-minilm"
LLM = "tiny-llama"
INFO = ModelInfo(MODEL, dimensions=8, max_input_tokens=16)
LIMITS = RerankerSettings(
    max_embedding_inputs=4, max_input_bytes=200, max_documents=4, max_document_bytes=200
)
KEY = "tm_pooling-test-key-0123456789"


def vector(text: str) -> NDArray[np.float32]:
    """A unit vector of its own for each text, the same every time."""
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    values = np.random.default_rng(seed).standard_normal(INFO.dimensions)
    return (values / np.linalg.norm(values)).astype(np.float32)


def encode(texts: list[str], lengths: list[int]) -> NDArray[np.float32]:
    return np.stack([vector(text) for text in texts])


def count_words(texts: list[str]) -> list[int]:
    return [len(text.split()) + 2 for text in texts]


class FakeCatalog:
    """The workers' served model, as the LLM's catalog answers it."""

    async def cards(self, allowed: object) -> list[ModelCard]:
        return [ModelCard(LLM, None, 2048)]


@dataclass
class Gateway:
    http: httpx.AsyncClient
    registry: CollectorRegistry


def gateway_app(
    reranker: Dependency,
    tenancy: HttpTenancy,
    registry: CollectorRegistry,
    tracer: trace.Tracer | None = None,
) -> Any:
    pooling = PoolingApi(EmbeddingClient(reranker, 30.0, 0.5), tenancy)
    api = OpenAIApi(
        cast(Any, None),
        cast(Any, None),
        GatewaySettings(),
        cast(Any, None),
        cast(Any, FakeCatalog()),
        tenancy,
        tracer or trace.get_tracer("test"),
        HttpMetrics(registry),
        lambda: True,
        pooling,
    )
    return api.app()


@pytest.fixture(scope="module")
async def reranker() -> AsyncIterator[str]:
    async for address in reranker_server(trace.NoOpTracer()):
        yield address


async def reranker_server(tracer: trace.Tracer) -> AsyncIterator[str]:
    """A reranker server with both services over the fake model; its address."""
    scorer = BiEncoderScorer(encode, count_words, INFO)
    batcher = MicroBatcher(scorer.run, max_wait_seconds=0.001, max_size=256)
    batcher.start()
    slot = RerankerSlot()
    slot.set(batcher, INFO)
    metrics = RerankMetrics(CollectorRegistry())
    server = aio.server(interceptors=standard_interceptors(CollectorRegistry(), tracer))
    rerank_pb2_grpc.add_RerankServiceServicer_to_server(
        RerankServicer(slot, LIMITS, metrics), server
    )
    rerank_pb2_grpc.add_EmbeddingServiceServicer_to_server(
        EmbeddingServicer(slot, LIMITS, metrics), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)
    await batcher.close()


@pytest.fixture(scope="module")
async def gateway(reranker: str) -> AsyncIterator[Gateway]:
    registry = CollectorRegistry()
    dependency = Dependency("reranker", reranker, 1 << 20)
    app = gateway_app(dependency, HttpTenancy(), registry)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield Gateway(http, registry)
    await dependency.close()


@pytest.fixture(scope="module")
async def rerank_stub(reranker: str) -> AsyncIterator[rerank_pb2_grpc.RerankServiceStub]:
    async with aio.insecure_channel(reranker) as channel:
        yield rerank_pb2_grpc.RerankServiceStub(channel)


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
async def unreachable() -> AsyncIterator[httpx.AsyncClient]:
    """The HTTP API of a gateway whose reranker address is a closed port."""
    dependency = Dependency("reranker", closed_port(), 1 << 20)
    app = gateway_app(dependency, HttpTenancy(), CollectorRegistry())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http
    await dependency.close()


async def post(http: httpx.AsyncClient, path: str, body: Any, **headers: str) -> httpx.Response:
    return await http.post(path, content=json.dumps(body), headers=headers)


async def test_embeddings_are_openais_list_in_input_order_with_usage(gateway: Gateway) -> None:
    texts = ["the first text", "a second", "the first text"]
    answer = await post(gateway.http, "/v1/embeddings", {"model": MODEL, "input": texts})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == MODEL
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert all(item["object"] == "embedding" for item in body["data"])
    for item, text in zip(body["data"], texts, strict=True):
        assert np.array_equal(np.array(item["embedding"], dtype=np.float32), vector(text))
    tokens = sum(count_words(texts))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


async def test_base64_embeddings_decode_as_the_sdk_decodes_them_to_the_same_floats(
    gateway: Gateway,
) -> None:
    request = {"model": MODEL, "input": ["one", "two"], "user": "someone"}
    floats = (await post(gateway.http, "/v1/embeddings", request)).json()
    encoded = await post(gateway.http, "/v1/embeddings", {**request, "encoding_format": "base64"})
    assert encoded.status_code == 200, encoded.text
    for packed, plain in zip(encoded.json()["data"], floats["data"], strict=True):
        assert isinstance(packed["embedding"], str)
        # What openai-python does with a base64 embedding.
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="float32")
        assert decoded.tolist() == plain["embedding"]


async def test_a_string_input_is_one_text_and_the_models_own_dimensions_are_taken(
    gateway: Gateway,
) -> None:
    answer = await post(
        gateway.http,
        "/v1/embeddings",
        {"model": MODEL, "input": "just one", "dimensions": INFO.dimensions},
    )
    assert answer.status_code == 200, answer.text
    (item,) = answer.json()["data"]
    assert len(item["embedding"]) == INFO.dimensions


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": [1, 2, 3]}, "input", "token ids are not supported"),
        ({"input": [[1, 2], [3]]}, "input", "token ids are not supported"),
        ({"input": 5}, "input", "must be a string or a list of strings"),
        ({"input": ["a", None]}, "input[1]", "valid string"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a"] * 5}, "input", "has 5 texts, over the limit of 4"),
        ({"input": ["a", "x" * 201]}, "input[1]", "is 201 bytes, over the limit of 200"),
        ({"input": ["a", ""]}, "input[1]", "must not be empty"),
        ({"input": ["w " * 15]}, "input[0]", "is 17 tokens, over the model's limit of 16"),
        ({"encoding_format": "binary"}, "encoding_format", "'float' or 'base64'"),
        ({"dimensions": 4}, "dimensions", "8 dimensions only, got 4"),
        ({"dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"dimensions": 2**40}, "dimensions", "less than or equal to"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "not supported"),
        ({"foo": 1, "bar": 2}, "foo, bar", "not supported (this endpoint takes model, input"),
        ({"model": None}, "model", "valid string"),
    ],
)
async def test_bad_embedding_requests_are_400_naming_the_field(
    gateway: Gateway, fields: dict[str, Any], param: str, says: str
) -> None:
    answer = await post(gateway.http, "/v1/embeddings", {"model": MODEL, "input": "x", **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and says in error["message"]


@pytest.mark.parametrize(
    ("body", "says"), [(b"{not json", "not valid JSON"), (b"[1, 2]", "a JSON object")]
)
async def test_a_body_that_is_no_json_object_is_400_naming_the_body(
    gateway: Gateway, body: bytes, says: str
) -> None:
    for path in ("/v1/embeddings", "/v1/rerank"):
        answer = await gateway.http.post(path, content=body)
        assert answer.status_code == 400
        assert (
            answer.json()["error"]["param"] == "body" and says in answer.json()["error"]["message"]
        )


async def test_an_unknown_model_is_404_naming_the_served_one(gateway: Gateway) -> None:
    for path, body in (
        ("/v1/embeddings", {"input": "x"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ):
        answer = await post(gateway.http, path, {"model": LLM, **body})
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert error["param"] == "model" and MODEL in error["message"]


async def test_rerank_answers_vllms_shape_in_the_grpc_rerankers_order(
    gateway: Gateway, rerank_stub: rerank_pb2_grpc.RerankServiceStub
) -> None:
    query, documents = "which one", ["alpha text", "beta", "gamma words here", "delta"]
    answer = await post(
        gateway.http, "/v1/rerank", {"model": MODEL, "query": query, "documents": documents}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"id", "model", "usage", "results"}
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    tokens = sum(count_words([query, *documents]))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    grpc_ranked = await rerank_stub.Rerank(
        rerank_pb2.RerankRequest(query=query, documents=documents)
    )
    assert [(r["index"], r["relevance_score"]) for r in body["results"]] == [
        (r.index, r.score) for r in grpc_ranked.results
    ]
    assert [r["document"] for r in body["results"]] == [
        {"text": documents[r.index]} for r in grpc_ranked.results
    ]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(("top_n", "returned"), [(2, 2), (0, 3), (9, 3)])
async def test_top_n_returns_the_best_n_or_all(gateway: Gateway, top_n: int, returned: int) -> None:
    request = {"model": MODEL, "query": "q", "documents": ["a", "b", "c"], "top_n": top_n}
    answer = await post(gateway.http, "/v1/rerank", request)
    assert len(answer.json()["results"]) == returned


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"documents": ["a", 2]}, "documents[1]", "valid string"),
        ({"documents": "a"}, "documents", "valid array"),
        ({"documents": []}, "documents", "must not be empty"),
        ({"documents": ["a"] * 5}, "documents", "has 5 documents, over the limit of 4"),
        ({"documents": ["a", "x" * 201]}, "documents[1]", "over the limit of 200"),
        ({"query": ""}, "query", "must not be empty"),
        ({"query": ["q"]}, "query", "valid string"),
        ({"top_n": -1}, "top_n", "greater than or equal to 0"),
        ({"top_n": "many"}, "top_n", "valid integer"),
        ({"return_documents": True}, "return_documents", "not supported"),
    ],
)
async def test_bad_rerank_requests_are_400_naming_the_field(
    gateway: Gateway, fields: dict[str, Any], param: str, says: str
) -> None:
    request = {"model": MODEL, "query": "q", "documents": ["a", "b"], **fields}
    answer = await post(gateway.http, "/v1/rerank", request)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ") and says in error["message"]


async def test_models_lists_the_embedding_model_after_the_served_one(gateway: Gateway) -> None:
    cards = (await gateway.http.get("/v1/models")).json()["data"]
    assert [card["id"] for card in cards] == [LLM, MODEL]
    assert cards[1]["max_model_len"] == INFO.max_input_tokens


async def test_with_no_reranker_models_lists_the_llm_and_embeddings_are_503(
    unreachable: httpx.AsyncClient,
) -> None:
    cards = (await unreachable.get("/v1/models")).json()["data"]
    assert [card["id"] for card in cards] == [LLM]
    for path, body in (
        ("/v1/embeddings", {"input": "x"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ):
        answer = await post(unreachable, path, {"model": MODEL, **body})
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "service_unavailable"
        assert "reranker" in answer.json()["error"]["message"]


async def test_requests_are_counted_by_route_and_status(gateway: Gateway) -> None:
    def counted(route: str, status: str) -> float:
        value = gateway.registry.get_sample_value(
            "tokenmesh_gateway_http_requests_total",
            {"route": route, "status": status, "path": "gateway"},
        )
        return value or 0.0

    before = {
        (route, status): counted(route, status)
        for route in ("/v1/embeddings", "/v1/rerank")
        for status in ("200", "400")
    }
    await post(gateway.http, "/v1/embeddings", {"model": MODEL, "input": "x"})
    await post(gateway.http, "/v1/embeddings", {"model": MODEL, "input": []})
    await post(gateway.http, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]})
    assert counted("/v1/embeddings", "200") == before[("/v1/embeddings", "200")] + 1
    assert counted("/v1/embeddings", "400") == before[("/v1/embeddings", "400")] + 1
    assert counted("/v1/rerank", "200") == before[("/v1/rerank", "200")] + 1
    assert counted("/v1/rerank", "400") == before[("/v1/rerank", "400")]


@pytest.fixture(scope="module")
def keyed_tenancy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpTenancy]:
    keys = tmp_path_factory.mktemp("pooling-keys") / "keys.json"
    keys.write_text(json.dumps({"tenants": {"acme": {"key_sha256": [hash_key(KEY)]}}}))
    yield Tenancy.build(GatewaySettings(keys_file=Path(keys)), CollectorRegistry()).http


@pytest.mark.parametrize("key", [None, "tm_not-a-key-0123456789"])
async def test_no_or_a_bad_key_is_401_and_a_good_one_is_served(
    reranker: str, keyed_tenancy: HttpTenancy, key: str | None
) -> None:
    dependency = Dependency("reranker", reranker, 1 << 20)
    app = gateway_app(dependency, keyed_tenancy, CollectorRegistry())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway"
    ) as http:
        for path, body in (
            ("/v1/embeddings", {"model": MODEL, "input": "x"}),
            ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}),
        ):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            refused = await post(http, path, body, **headers)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["type"] == "authentication_error"
            served = await post(http, path, body, authorization=f"Bearer {KEY}")
            assert served.status_code == 200, served.text
    await dependency.close()


async def test_the_reranker_call_continues_the_callers_trace_under_the_routes_span() -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("test")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    servers = reranker_server(tracer)
    address = await anext(servers)
    dependency = Dependency(
        "reranker", address, 1 << 20, for_every_arity(TraceContextClientInterceptor())
    )
    app = gateway_app(dependency, HttpTenancy(), CollectorRegistry(), tracer)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        ) as http:
            answer = await post(
                http,
                "/v1/embeddings",
                {"model": MODEL, "input": "x"},
                traceparent=f"00-{trace_id}-00f067aa0ba902b7-01",
            )
        assert answer.status_code == 200, answer.text
    finally:
        await dependency.close()
        await anext(servers, None)
    finished = {span.name: span for span in spans.get_finished_spans()}
    route = finished["POST /v1/embeddings"]
    embed = finished["tokenmesh.v1.EmbeddingService/Embed"]
    assert route.context is not None and embed.context is not None and embed.parent is not None
    assert format(route.context.trace_id, "032x") == trace_id
    assert embed.context.trace_id == route.context.trace_id
    assert embed.parent.span_id == route.context.span_id
    assert route.attributes is not None
    assert route.attributes["http.response.status_code"] == 200


def test_parse_names_every_unknown_field_at_once() -> None:
    with pytest.raises(InvalidArgument) as error:
        parse(RerankRequest, b'{"model": "m", "query": "q", "documents": [], "a": 1, "b": 2}')
    assert error.value.field == "a, b"
    with pytest.raises(InvalidArgument) as missing:
        parse(EmbeddingRequest, b'{"model": "m"}')
    assert str(missing.value) == "input: Field required"
