"""The reranker's MiniLM on OpenAI's API through the real mesh's edge: /v1/embeddings with the
official `openai` SDK (OpenAI's shape, unit-length vectors whose dot products are the gRPC
reranker's scores, similar sentences closer than unrelated ones, base64 and float alike) and
/v1/rerank with httpx (vLLM's shape, the gRPC reranker's order and scores); bad input a 400
naming the field; the routes counted; /v1/models listing the model; and with API keys, at a
keyed gateway straight and through an edge of its own, no key or a bad one refused as on the
completions."""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.test_openai_api import (
    counted_within,
    edge_of_its_own,
    http_requests,
    openai_gateway,
)
from tests.support import ROOT, TINY_MODEL
from tokenmesh.gateway.core.tenancy.auth import UNAUTHENTICATED_MESSAGE, hash_key
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.reranker.model import default_model_path
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

pytestmark = pytest.mark.integration

EMBEDDING_MODEL = "all-MiniLM-L6-v2"
LLM = TINY_MODEL.name
DIMENSIONS = 384
# What the reranker promises of a score whatever the batch it was computed in
# (docs/architecture.md, "The reranker").
SCORE_TOLERANCE = 1e-5
CAT = "A cat is sleeping on the sofa."
CAT_AGAIN = "A kitten naps on the couch."
STOCKS = "The central bank raised interest rates by half a point."
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Bananas are rich in potassium and grow in tropical climates.",
    "Paris is the capital and largest city of France.",
    "The violin has four strings tuned in perfect fifths.",
    "France is a country in Western Europe.",
    "Mount Everest is the highest mountain on Earth above sea level.",
]


@pytest.fixture(scope="module")
def edge_url(mesh: LocalMesh) -> str:
    return f"http://127.0.0.1:{mesh.settings.mesh().edge_port}/v1"


@pytest.fixture(scope="module")
def client(edge_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=edge_url, api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def grpc_rerank(mesh: LocalMesh) -> Iterator[rerank_pb2_grpc.RerankServiceStub]:
    """RerankService straight at the mesh's reranker, as the gateways call it."""
    (reranker,) = mesh.replicas("reranker")
    with grpc.insecure_channel(reranker.address) as channel:
        yield rerank_pb2_grpc.RerankServiceStub(channel)


def tokens(tokenizer: Any, texts: list[str]) -> int:
    return sum(len(ids) for ids in tokenizer(texts)["input_ids"])


def test_embeddings_through_the_edge_are_openais_list_of_unit_vectors(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    texts = [CAT, CAT_AGAIN, STOCKS]
    answer = client.embeddings.create(model=EMBEDDING_MODEL, input=texts)
    assert answer.object == "list" and answer.model == EMBEDDING_MODEL
    assert [item.index for item in answer.data] == [0, 1, 2]
    assert all(item.object == "embedding" for item in answer.data)
    for item in answer.data:
        assert len(item.embedding) == DIMENSIONS
        assert math.isclose(float(np.linalg.norm(item.embedding)), 1.0, abs_tol=1e-5)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens(tokenizer, texts)


def test_similar_sentences_are_closer_than_unrelated_ones(client: openai.OpenAI) -> None:
    answer = client.embeddings.create(model=EMBEDDING_MODEL, input=[CAT, CAT_AGAIN, STOCKS])
    cat, again, stocks = (np.array(item.embedding) for item in answer.data)
    assert float(cat @ again) > float(cat @ stocks) + 0.3, (cat @ again, cat @ stocks)


def test_float_and_base64_answers_hold_the_same_float32_values(client: openai.OpenAI) -> None:
    """The SDK asks for base64 unless told otherwise, and decodes it as float32."""
    packed = client.embeddings.create(model=EMBEDDING_MODEL, input=[CAT, STOCKS])
    plain = client.embeddings.create(
        model=EMBEDDING_MODEL, input=[CAT, STOCKS], encoding_format="float"
    )
    for one, other in zip(packed.data, plain.data, strict=True):
        assert np.array_equal(
            np.array(one.embedding, dtype=np.float32), np.array(other.embedding, dtype=np.float32)
        )


def test_the_embeddings_dot_products_are_the_grpc_rerankers_scores(
    client: openai.OpenAI, grpc_rerank: rerank_pb2_grpc.RerankServiceStub
) -> None:
    answer = client.embeddings.create(model=EMBEDDING_MODEL, input=[QUERY, *DOCUMENTS])
    query, *documents = (np.array(item.embedding, dtype=np.float64) for item in answer.data)
    ranked = grpc_rerank.Rerank(rerank_pb2.RerankRequest(query=QUERY, documents=DOCUMENTS))
    for result in ranked.results:
        assert abs(float(documents[result.index] @ query) - result.score) <= SCORE_TOLERANCE


def test_rerank_through_the_edge_orders_and_scores_as_the_grpc_reranker(
    edge_url: str, grpc_rerank: rerank_pb2_grpc.RerankServiceStub, tokenizer: Any
) -> None:
    request = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    answer = httpx.post(f"{edge_url}/rerank", json=request, timeout=30)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == EMBEDDING_MODEL and body["id"].startswith("rerank-")
    total = tokens(tokenizer, [QUERY, *DOCUMENTS])
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    ranked = grpc_rerank.Rerank(rerank_pb2.RerankRequest(query=QUERY, documents=DOCUMENTS, top_k=3))
    assert [r["index"] for r in body["results"]] == [r.index for r in ranked.results]
    assert body["results"][0]["index"] == 1  # Paris
    for result, grpc_result in zip(body["results"], ranked.results, strict=True):
        assert abs(result["relevance_score"] - grpc_result.score) <= SCORE_TOLERANCE
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": [101, 2023, 102]}, "input", "token ids are not supported"),
        ({"input": ["x"] * 65}, "input", "has 65 texts, over the limit of 64"),
        ({"input": ["ok", "é" * 4097]}, "input[1]", "is 8194 bytes, over the limit of 8192"),
        ({"input": ["word " * 300]}, "input[0]", "is 302 tokens, over the model's limit of 256"),
        ({"input": [CAT], "dimensions": 128}, "dimensions", "384 dimensions only, got 128"),
        ({"input": [CAT], "extra_body": {"truncate_prompt_tokens": 8}}, "truncate_prompt_tokens",
         "not supported"),
    ],
)  # fmt: skip
def test_bad_embedding_requests_raise_bad_request_error_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=EMBEDDING_MODEL, **fields)
    assert error.value.status_code == 400
    assert isinstance(error.value.body, dict) and error.value.body["param"] == param
    message = error.value.body["message"]
    assert message.startswith(f"{param}: ") and says in message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"documents": ["a", {"text": "b"}]}, "documents[1]", "valid string"),
        ({"documents": ["a"] * 65}, "documents", "has 65 documents, over the limit of 64"),
        ({"query": ""}, "query", "must not be empty"),
        ({"top_n": -2}, "top_n", "greater than or equal to 0"),
        ({"return_documents": False}, "return_documents", "not supported"),
    ],
)
def test_bad_rerank_requests_are_400_naming_the_field(
    edge_url: str, fields: dict[str, Any], param: str, says: str
) -> None:
    request = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, **fields}
    answer = httpx.post(f"{edge_url}/rerank", json=request, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and says in error["message"]


def test_another_model_is_not_found_naming_the_embedding_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.embeddings.create(model=LLM, input=[CAT])
    assert EMBEDDING_MODEL in error.value.message


def test_models_lists_the_embedding_model_after_the_served_one(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == [LLM, EMBEDDING_MODEL]


def test_each_request_is_counted_by_route_and_status(
    client: openai.OpenAI, edge_url: str, mesh: LocalMesh
) -> None:
    before = {
        (route, status): http_requests(mesh, route, status)
        for route in ("/v1/embeddings", "/v1/rerank")
        for status in ("200", "400")
    }
    client.embeddings.create(model=EMBEDDING_MODEL, input=[CAT])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=EMBEDDING_MODEL, input=[])
    rerank = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS[:2]}
    assert httpx.post(f"{edge_url}/rerank", json=rerank, timeout=30).status_code == 200

    def counted() -> bool:
        return all(
            http_requests(mesh, route, status) == before[(route, status)] + added
            for (route, status), added in {
                ("/v1/embeddings", "200"): 1,
                ("/v1/embeddings", "400"): 1,
                ("/v1/rerank", "200"): 1,
                ("/v1/rerank", "400"): 0,
            }.items()
        )

    counted_within(10, counted)


# --- keys on: a keyed gateway in front of the mesh's workers and reranker, straight and through
# --- an edge of its own

KEY = "tm_embeddings-open-key-0123456789"
WAYS = ("gateway", "edge")


@pytest.fixture(scope="module")
def keyed_urls(
    mesh: LocalMesh, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """The base URL of a keyed gateway's OpenAI API, at its own port and at an edge's; the
    gateway reaches the mesh's workers and reranker through the mesh's Envoy."""
    keys = tmp_path_factory.mktemp("embeddings-keys") / "keys.json"
    keys.write_text(json.dumps({"tenants": {"open": {"key_sha256": [hash_key(KEY)]}}}))
    worker = f"127.0.0.1:{mesh.settings.worker_listener_port}"
    reranker = f"127.0.0.1:{mesh.settings.reranker_listener_port}"
    with openai_gateway(
        worker, reranker, "gateway-embeddings-keys", keys_file=str(keys)
    ) as gateway:
        clusters = {
            "gateway": [gateway.process.address],
            "openai": [gateway.openai_address],
            "worker": [w.address for w in mesh.replicas("worker")],
            "reranker": [r.address for r in mesh.replicas("reranker")],
        }
        directory = tmp_path_factory.mktemp("embeddings-keyed-edge")
        with edge_of_its_own(directory, "embeddings-keyed-edge", clusters) as edge:
            edge.wait_for_hosts(
                {name: [(a, True) for a in hosts] for name, hosts in clusters.items()}
            )
            yield {"gateway": gateway.url, "edge": edge.url}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("key", ["", "tm_not-a-key-0123456789"])
def test_no_or_a_bad_key_is_refused_as_on_the_completions(
    keyed_urls: dict[str, str], way: str, key: str
) -> None:
    url = keyed_urls[way]
    headers = {"Authorization": ""} if not key else None
    with (
        openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0) as sdk,
        pytest.raises(openai.AuthenticationError) as error,
    ):
        sdk.embeddings.create(model=EMBEDDING_MODEL, input=[CAT], extra_headers=headers)
    assert error.value.status_code == 401
    assert error.value.body == {
        "message": UNAUTHENTICATED_MESSAGE,
        "type": "authentication_error",
        "param": None,
        "code": None,
    }
    rerank = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS}
    sent = {"authorization": f"Bearer {key}"} if key else {}
    refused = httpx.post(f"{url}/rerank", json=rerank, headers=sent, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("way", WAYS)
def test_a_valid_key_is_served(keyed_urls: dict[str, str], way: str) -> None:
    url = keyed_urls[way]
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0) as sdk:
        answer = sdk.embeddings.create(model=EMBEDDING_MODEL, input=[CAT])
    assert len(answer.data[0].embedding) == DIMENSIONS
    rerank = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 1}
    served = httpx.post(
        f"{url}/rerank", json=rerank, headers={"authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert served.status_code == 200, served.text
    assert served.json()["results"][0]["index"] == 1


def test_the_curl_examples_in_the_docs_run(mesh: LocalMesh) -> None:
    """docs/openai.md's `curl -s` examples of embeddings and rerank, against this mesh's edge."""
    doc = (ROOT / "docs" / "openai.md").read_text()
    examples = re.findall(r"```sh\n(curl -s .*?)\n```", doc, re.S)
    assert {"/v1/embeddings", "/v1/rerank"} <= {
        path for example in examples for path in re.findall(r"/v1/\w+", example)
    }
    edge = f"127.0.0.1:{mesh.settings.mesh().edge_port}"
    for example in examples:
        command = example.replace("127.0.0.1:8080", edge)
        run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        answer = json.loads(run.stdout)
        assert "error" not in answer, answer
        assert answer["model"] == EMBEDDING_MODEL
        assert answer.get("data") or answer.get("results"), answer
