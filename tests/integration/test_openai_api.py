"""OpenAI's HTTP API through the real mesh's edge, called with the official `openai` SDK (sync
and async): models, chat and text completions streamed and whole, usage counted on the model's
own chat template, stop strings, logprobs, errors as the SDK's exception classes, a stream
closed mid-way freeing the engine; at a gateway with a keys file, straight and through an edge,
keys and tenant limits; and a gateway with no worker answering 503."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from grpc import aio
from transformers import AutoTokenizer

from tests.conftest import LOG_DIR
from tests.support import (
    ENVOY,
    TINY_MODEL,
    ServiceProcess,
    controlplane_process,
    direct_logs_delivered,
    envoy_env,
    free_port,
    gateway_process,
    metric_value,
    scrape_metrics,
    seconds_until_emptied,
)
from tests.timing import within_budget
from tokenmesh.common.processes import stop_process
from tokenmesh.gateway.core.tenancy.auth import UNAUTHENTICATED_MESSAGE, hash_key
from tokenmesh.localmesh.mesh import LocalMesh, envoy_hosts
from tokenmesh.meshconfig.__main__ import render_yaml
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration

MODEL = TINY_MODEL.name  # the mesh's workers serve the model under its directory's name
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
GREEDY = {"temperature": 0.0, "seed": 7}


@pytest.fixture(scope="module")
def base_url(mesh: LocalMesh) -> str:
    return f"http://127.0.0.1:{mesh.settings.mesh().edge_port}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
async def async_client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    # The SDK's own retries (its default), unlike `client`'s: this client's test is about
    # closing streams, and once CI saw a connection to the edge time out on a loaded machine
    # (the SDK's 5 s connect timeout) before any request was sent.
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=2) as sdk:
        yield sdk


def test_the_served_model_is_listed(client: openai.OpenAI) -> None:
    models = client.models.list()
    # Then the reranker's embedding model (/v1/embeddings, test_openai_embeddings.py).
    assert [model.id for model in models.data] == [MODEL, "all-MiniLM-L6-v2"]


def test_a_chat_is_prompted_with_the_models_own_template(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY
    )
    rendered = AutoTokenizer.from_pretrained(TINY_MODEL).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    templated = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    assert answer.object == "chat.completion"
    assert answer.model == MODEL
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(templated)
    assert answer.usage.completion_tokens == 8
    assert answer.usage.total_tokens == len(templated) + 8


def test_a_chat_naming_no_max_tokens_generates_to_the_end_of_the_context(
    client: openai.OpenAI,
) -> None:
    """As vLLM's server: no max_tokens means what the model context leaves after the prompt,
    not the cap (which, with the prompt, would not fit the context and be refused)."""
    half = " ".join(["word"] * 950)  # each message within max_chat_message_bytes
    long = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    answer = client.chat.completions.create(
        model=MODEL, messages=long, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert answer.usage is not None
    context = 2048  # the mesh's workers' max_model_len (their default)
    assert 0 < answer.usage.completion_tokens == context - answer.usage.prompt_tokens
    assert answer.choices[0].finish_reason == "length"


def test_a_streamed_chat_is_the_same_answer_in_chunks_with_usage_last(
    client: openai.OpenAI,
) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_completion_stops_at_a_stop_string(client: openai.OpenAI) -> None:
    free = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=24,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    text = free.choices[0].text
    assert free.object == "text_completion" and free.choices[0].finish_reason == "length"
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"no stop string to take from {text!r}"
    stopped = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=24,
        stop=[stop],
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_a_streamed_completion_streams_the_text(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=10,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    whole = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_come_per_token_with_their_alternatives(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    # Greedy: each sampled token is its position's most likely.
    assert all(
        entry.logprob >= max(alt.logprob for alt in entry.top_logprobs) - 1e-4 for entry in content
    )
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content


def test_completion_logprobs_whole_and_streamed_agree_with_their_offsets(
    client: openai.OpenAI,
) -> None:
    ask = dict(
        model=MODEL,
        prompt="the same prompt",
        max_tokens=8,
        logprobs=2,
        top_p=0.9,
        user="someone",
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    whole = client.completions.create(**ask)  # type: ignore[call-overload]
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and len(logprobs.tokens) == 8
    text = whole.choices[0].text
    assert "".join(logprobs.tokens) == text
    # Each token's offset is where its text starts in the answer.
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    assert all(len(alternatives) <= 2 for alternatives in logprobs.top_logprobs or [])
    streamed = [
        chunk.choices[0]
        for chunk in client.completions.create(stream=True, **ask)  # type: ignore[call-overload]
        if chunk.choices
    ]
    assert "".join(choice.text for choice in streamed) == text
    # Every token has its entry and offset; which token a piece of text is credited to can
    # differ between two runs when the engine merged outputs (vLLM gives their text whole).
    tokens = [t for choice in streamed for t in (choice.logprobs.tokens or [])]  # type: ignore[union-attr]
    assert len(tokens) == 8 and "".join(tokens) == text
    offsets = [o for c in streamed for o in (c.logprobs.text_offset or [])]  # type: ignore[union-attr]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def http_requests(mesh: LocalMesh, route: str, status: str) -> float:
    """The OpenAI requests the mesh's gateways have counted on route with status."""
    return sum(
        metric_value(
            scrape_metrics(g.metrics_port),
            "tokenmesh_gateway_http_requests_total",
            0.0,
            route=route,
            status=status,
        )
        for g in mesh.replicas("gateway")
    )


def counted_within(seconds: float, counted: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    while not counted():
        assert time.monotonic() < deadline, "not counted"
        time.sleep(0.05)


def test_each_request_is_counted_by_route_and_status(
    client: openai.OpenAI, mesh: LocalMesh
) -> None:
    route = "/v1/chat/completions"
    direct_logs_delivered(mesh)
    served, refused = http_requests(mesh, route, "200"), http_requests(mesh, route, "400")
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    # An answer a worker streamed straight to the caller (the direct token path) is counted
    # when the edge's access log reaches the gateways (every 0.5 s).
    counted_within(10, lambda: http_requests(mesh, route, "200") == served + 1)
    assert http_requests(mesh, route, "400") == refused + 1
    gone = http_requests(mesh, route, "499")
    # Long enough (seconds) that the client's close reaches Envoy before the worker's end even
    # when the machine stalls the client between its first chunk and the close.
    with client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        next(iter(stream))
    # Counted as the client going away: by the gateway that streamed it, from its connection,
    # or on the direct path from the edge's access log.
    counted_within(10, lambda: http_requests(mesh, route, "499") == gone + 1)
    assert http_requests(mesh, route, "200") == served + 1


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0, "max_tokens": 5}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"temperature": 9.0}, "temperature"),
        ({"messages": [{"role": "user", "content": "x" * 10**5}]}, "messages[0].content"),
    ],
)
def test_bad_requests_raise_bad_request_error_naming_the_field(
    client: openai.OpenAI, fields: dict[str, object], named: str
) -> None:
    request = {"model": MODEL, "messages": MESSAGES, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert error.value.status_code == 400
    assert named in error.value.message
    assert isinstance(error.value.body, dict) and error.value.body.get("param") == named


def test_an_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-unknown", prompt="hi", max_tokens=2)
    assert MODEL in error.value.message


async def test_closing_a_stream_frees_the_engine_at_once(
    mesh: LocalMesh, async_client: openai.AsyncOpenAI
) -> None:
    async with worker_stubs(mesh) as engines:

        async def close_round() -> float:
            streams = [
                await async_client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"story {i}"}],
                    max_tokens=2000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for i in range(4)
            ]
            for stream in streams:
                await anext(aiter(stream))
            reports = await asyncio.gather(
                *(engine.GetEngineStats(inference_pb2.EngineStatsRequest()) for engine in engines)
            )
            closed_at = time.time_ns()
            for stream in streams:
                await stream.close()
            return await seconds_until_emptied(engines, reports, closed_at)

        await within_budget("every engine empty after the streams closed", close_round)


@contextlib.asynccontextmanager
async def worker_stubs(
    mesh: LocalMesh,
) -> AsyncIterator[list[inference_pb2_grpc.InferenceServiceStub]]:
    """InferenceService stubs straight to each of the mesh's workers."""
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(aio.insecure_channel(w.address))
            for w in mesh.replicas("worker")
        ]
        yield [inference_pb2_grpc.InferenceServiceStub(channel) for channel in channels]


# --- a gateway whose OpenAI requests may take 1 s ----------------------------------------


@dataclass(frozen=True)
class OpenAIGateway:
    process: ServiceProcess
    openai_port: int

    @property
    def openai_address(self) -> str:
        return f"127.0.0.1:{self.openai_port}"

    @property
    def url(self) -> str:
        """The base URL of its OpenAI API."""
        return f"http://{self.openai_address}/v1"


@contextlib.contextmanager
def openai_gateway(
    worker_address: str, reranker_address: str, name: str, **settings: str
) -> Iterator[OpenAIGateway]:
    """A gateway of its own with these settings, its OpenAI API on a port of its own."""
    port = free_port()
    process = gateway_process(
        LOG_DIR, worker_address, reranker_address, name=name, openai_port=str(port), **settings
    )
    process.start()
    try:
        process.wait_serving(60)
        yield OpenAIGateway(process, port)
    finally:
        process.stop()


@pytest.fixture(scope="module", params=("gateway", "edge"))
def hurried(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    worker: ServiceProcess,
    reranker: ServiceProcess,
) -> Iterator[str]:
    """A gateway whose OpenAI requests may take 1 s: at its own HTTP port, or behind an edge
    of its own (the direct token path: the worker keeps the time)."""
    with openai_gateway(
        worker.address, reranker.address, "gateway-openai-hurried", http_request_timeout_seconds="1"
    ) as gateway:
        if request.param == "gateway":
            yield gateway.url
        else:
            directory = tmp_path_factory.mktemp("hurried-edge")
            with edge_in_front_of(gateway, worker, reranker, directory, "hurried-edge") as edge:
                yield edge.url


def test_a_request_past_its_time_is_a_504_or_ends_its_stream_with_the_error(
    hurried: str,
) -> None:
    """http_request_timeout_seconds is the worker call's deadline: a whole answer that cannot
    finish in time is 504; a stream already answering ends with the error as its last event."""
    long = dict(max_tokens=2000, extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=hurried, api_key="unused", max_retries=0) as sdk:
        model = sdk.models.list().data[0].id
        with pytest.raises(openai.APIStatusError) as late:
            sdk.completions.create(model=model, prompt="hi", **long)  # type: ignore[call-overload]
        assert late.value.status_code == 504
        assert "deadline" in late.value.message
        with pytest.raises(openai.APIError) as cut:
            for _ in sdk.completions.create(  # type: ignore[call-overload]
                model=model, prompt="hi", stream=True, **long
            ):
                pass
        assert "deadline" in str(cut.value.message)


# --- keys on: a gateway with a keys file, its OpenAI port called straight and through an edge --

QUOTA = 5
# The ways to the keyed gateway's OpenAI API: its own port, and an edge of its own in front of
# it (which hands OpenAI requests back to the gateway's HTTP API: keys on, tokens are metered).
WAYS = ("gateway", "edge")
# Each way has its own tenants (and keys), so that one way's spent limits do not meet the
# other's: one open, one limited to one stream at once, one to QUOTA generated tokens a day.
LIMITS: dict[str, dict[str, int]] = {
    "open": {},
    "narrow": {"max_concurrent_streams": 1},
    "metered": {"tokens_per_window": QUOTA, "window_seconds": 86400},
}


def tenant_key(tenant: str, way: str) -> str:
    return f"tm_openai-{tenant}-{way}-key-0123456789"


@dataclass(frozen=True)
class Keyed:
    """The keyed gateway's OpenAI API as reached one way, and that way's tenants' keys."""

    url: str
    way: str

    def key(self, tenant: str) -> str:
        return tenant_key(tenant, self.way)


@pytest.fixture(scope="module")
def keyed_gateway(
    tmp_path_factory: pytest.TempPathFactory, worker: ServiceProcess, reranker: ServiceProcess
) -> Iterator[OpenAIGateway]:
    """A gateway with API keys: every tenant of LIMITS, once for each way."""
    keys = tmp_path_factory.mktemp("openai-keys") / "keys.json"
    tenants = {
        f"{tenant}-{way}": {"key_sha256": [hash_key(tenant_key(tenant, way))], "limits": limits}
        for tenant, limits in LIMITS.items()
        for way in WAYS
    }
    keys.write_text(json.dumps({"tenants": tenants}))
    with openai_gateway(
        worker.address, reranker.address, "gateway-openai-keys", keys_file=str(keys)
    ) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def keyed_edge(
    tmp_path_factory: pytest.TempPathFactory,
    keyed_gateway: OpenAIGateway,
    worker: ServiceProcess,
    reranker: ServiceProcess,
) -> Iterator[Edge]:
    """An edge of its own in front of the keyed gateway (and the session's worker and
    reranker), every host healthy."""
    directory = tmp_path_factory.mktemp("keyed-edge")
    with edge_in_front_of(keyed_gateway, worker, reranker, directory, "keyed-edge") as edge:
        yield edge


@contextlib.contextmanager
def edge_in_front_of(
    gateway: OpenAIGateway,
    worker: ServiceProcess,
    reranker: ServiceProcess,
    directory: Path,
    name: str,
) -> Iterator[Edge]:
    """An edge of its own in front of this gateway (and the session's worker and reranker),
    every host healthy."""
    clusters = {
        "gateway": [gateway.process.address],
        "openai": [gateway.openai_address],
        "worker": [worker.address],
        "reranker": [reranker.address],
    }
    with edge_of_its_own(directory, name, clusters) as edge:
        edge.wait_for_hosts({name: [(a, True) for a in hosts] for name, hosts in clusters.items()})
        yield edge


@pytest.fixture(scope="module", params=WAYS)
def keyed(request: pytest.FixtureRequest) -> Keyed:
    """The keyed gateway's OpenAI API: at its own port, or at the edge's (Envoy's) port."""
    way = request.param
    if way == "edge":
        return Keyed(request.getfixturevalue("keyed_edge").url, way)
    return Keyed(request.getfixturevalue("keyed_gateway").url, way)


def served_model(url: str, key: str) -> str:
    with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as sdk:
        return sdk.models.list().data[0].id


@pytest.mark.parametrize("key", ["", "tm_not-a-key-0123456789"])
def test_no_or_a_bad_key_raises_authentication_error(keyed: Keyed, key: str) -> None:
    with openai.OpenAI(base_url=keyed.url, api_key=key or "x", max_retries=0) as sdk:
        headers = {"Authorization": ""} if not key else None
        with pytest.raises(openai.AuthenticationError) as error:
            sdk.completions.create(model="any", prompt="hi", max_tokens=2, extra_headers=headers)
    assert error.value.status_code == 401
    assert error.value.response.headers["content-type"] == "application/json"
    assert error.value.body == {
        "message": UNAUTHENTICATED_MESSAGE,
        "type": "authentication_error",
        "param": None,
        "code": None,
    }


def test_a_valid_key_is_served(keyed: Keyed) -> None:
    model = served_model(keyed.url, keyed.key("open"))
    with openai.OpenAI(base_url=keyed.url, api_key=keyed.key("open"), max_retries=0) as sdk:
        answer = sdk.completions.create(
            model=model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
        )
    assert answer.usage is not None and answer.usage.completion_tokens == 3


def test_a_token_quota_cuts_the_answer_then_refuses_with_rate_limit_error(keyed: Keyed) -> None:
    model = served_model(keyed.url, keyed.key("metered"))
    with openai.OpenAI(base_url=keyed.url, api_key=keyed.key("metered"), max_retries=0) as sdk:
        cut = sdk.completions.create(
            model=model, prompt="hi", max_tokens=QUOTA + 3, extra_body={"ignore_eos": True}
        )
        assert cut.usage is not None and cut.usage.completion_tokens == QUOTA
        assert cut.choices[0].finish_reason == "length"
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.completions.create(model=model, prompt="hi", max_tokens=2)
    assert refused.value.status_code == 429
    assert "quota" in refused.value.message
    assert isinstance(refused.value.body, dict) and refused.value.body["type"] == "rate_limit_error"
    assert int(refused.value.response.headers["retry-after"]) >= 1


async def test_a_tenant_over_its_stream_limit_gets_rate_limit_error_with_retry_after(
    keyed: Keyed,
) -> None:
    model = served_model(keyed.url, keyed.key("narrow"))
    key = keyed.key("narrow")
    async with openai.AsyncOpenAI(base_url=keyed.url, api_key=key, max_retries=0) as sdk:
        first = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "long"}],
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            with pytest.raises(openai.RateLimitError) as error:
                await sdk.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "second"}], max_tokens=2
                )
        finally:
            await first.close()
    assert error.value.status_code == 429
    assert "concurrent stream limit 1" in error.value.message
    assert isinstance(error.value.body, dict) and error.value.body["type"] == "rate_limit_error"
    assert int(error.value.response.headers["retry-after"]) >= 1


# --- no worker: a gateway of its own whose worker address is a closed port ----------------


@pytest.fixture(scope="module")
def workerless(reranker: ServiceProcess) -> Iterator[str]:
    closed = f"127.0.0.1:{free_port()}"
    with openai_gateway(closed, reranker.address, "gateway-openai-workerless") as gateway:
        yield gateway.url


@pytest.mark.parametrize("ask", ["models", "chat"])
def test_with_no_worker_to_answer_the_gateway_says_503_at_once(workerless: str, ask: str) -> None:
    """The model catalog asks a worker: with none, listing models and answering a chat both
    fail 503 in OpenAI's error object, saying no worker answered, well within the timeout."""
    with openai.OpenAI(base_url=workerless, api_key="unused", max_retries=0, timeout=30) as sdk:
        begun = time.monotonic()
        with pytest.raises(openai.InternalServerError) as error:
            if ask == "models":
                sdk.models.list()
            else:
                sdk.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
        took = time.monotonic() - begun
    assert error.value.status_code == 503
    assert error.value.response.headers["content-type"] == "application/json"
    assert isinstance(error.value.body, dict)
    assert error.value.body["type"] == "service_unavailable"
    assert "no worker answered" in error.value.body["message"]
    assert took < 15, f"took {took:.1f} s"


def test_the_curl_examples_in_the_docs_run(mesh: LocalMesh) -> None:
    """docs/openai.md's `curl -N` examples, against this mesh's edge."""
    import re
    import subprocess

    doc = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    examples = re.findall(r"```sh\n(curl -N .*?)\n```", doc, re.S)
    assert len(examples) >= 2
    edge = f"127.0.0.1:{mesh.settings.mesh().edge_port}"
    for example in examples:
        command = example.replace("127.0.0.1:8080", edge).replace(
            '"model": "tiny-llama"', f'"model": "{MODEL}"'
        )
        run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        events = [line[6:] for line in run.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", run.stdout
        assert all("choices" in json.loads(event) for event in events[:-1])


# --- Envoy's own answers on /v1/: an edge of its own, its openai cluster from a control plane --

# What a gateway of the stand-in answers: a 503 of its own that Envoy's mappers would rewrite.
GATEWAY_ERROR = {
    "error": {"message": "from the gateway", "type": "gateway_own", "param": "p", "code": "c"}
}


class GatewayStandIn(http.server.BaseHTTPRequestHandler):
    """A gateway's HTTP port that is healthy and answers every other request with
    GATEWAY_ERROR."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(200, {"status": "SERVING"})
        else:
            self.reply(503, GATEWAY_ERROR)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.reply(503, GATEWAY_ERROR)

    def reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass(frozen=True)
class Edge:
    """A real Envoy rendered from settings, its endpoints from a control plane of its own
    reading the file `endpoints`."""

    settings: MeshSettings
    endpoints: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.edge_port}/v1"

    def route_openai_to(self, address: str) -> None:
        write_openai_endpoint(self.endpoints, address)

    def wait_for_openai_host(self, address: str, healthy: bool, within: float = 60.0) -> None:
        self.wait_for_hosts({"openai": [(address, healthy)]}, within)

    def wait_for_hosts(
        self, clusters: Mapping[str, list[tuple[str, bool]]], within: float = 60.0
    ) -> None:
        """Until Envoy has these hosts in these clusters, healthy or not as given."""
        deadline = time.monotonic() + within
        while True:
            hosts = envoy_hosts(self.settings.admin_port)
            if all(sorted(hosts.get(name, [])) == sorted(want) for name, want in clusters.items()):
                return
            assert time.monotonic() < deadline, hosts
            time.sleep(0.1)


def write_endpoints(path: Path, clusters: Mapping[str, list[str]]) -> None:
    """Replace the file atomically: the control plane follows it."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"clusters": clusters}))
    os.replace(temporary, path)


def write_openai_endpoint(path: Path, address: str) -> None:
    write_endpoints(path, {"openai": [address]})


@contextlib.contextmanager
def edge_of_its_own(
    directory: Path, name: str, clusters: Mapping[str, list[str]], **settings: Any
) -> Iterator[Edge]:
    """A control plane serving these clusters' hosts and an Envoy rendered from MeshSettings
    (these settings, on free ports) that it feeds; its hosts' health not waited for."""
    endpoints = directory / "endpoints.json"
    write_endpoints(endpoints, clusters)
    controlplane = controlplane_process(LOG_DIR, endpoints, name=f"controlplane-{name}")
    controlplane.start()
    try:
        controlplane.wait_serving(60)
        ports = [free_port() for _ in range(5)]
        edge = Edge(
            MeshSettings(
                edge_port=ports[0],
                admin_port=ports[1],
                worker_listener_port=ports[2],
                reranker_listener_port=ports[3],
                ops_page_port=ports[4],
                controlplane_port=controlplane.port,
                node_id=f"tokenmesh-envoy-{name}",
                **settings,
            ),
            endpoints,
        )
        config = directory / "envoy.yaml"
        config.write_text(render_yaml(edge.settings))
        with (LOG_DIR / f"envoy-{name}.log").open("wb") as log:
            envoy = subprocess.Popen(
                [ENVOY or "envoy", "-c", str(config),
                 "--base-id", str(random.randint(60_001, 65_000)), "--log-level", "warn"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=envoy_env(),
            )  # fmt: skip
        try:
            yield edge
        finally:
            stop_process(envoy, 30)
    finally:
        controlplane.stop(timeout=10)


@pytest.fixture(scope="module")
def lone_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """An edge with a small bucket (1/s, burst 5) whose openai cluster's one host is a closed
    port: no gateway is healthy."""
    closed = f"127.0.0.1:{free_port()}"
    with edge_of_its_own(
        tmp_path_factory.mktemp("lone-edge"),
        "lone-edge",
        {"openai": [closed]},
        edge_rate_limit_per_second=1,
        edge_rate_burst=5,
    ) as edge:
        edge.wait_for_openai_host(closed, healthy=False)
        yield edge


def test_no_healthy_gateway_is_a_503_openai_error_from_the_edge(lone_edge: Edge) -> None:
    """Envoy's own answers on /v1/ when no gateway is there are OpenAI's error object in JSON,
    so the SDK raises InternalServerError with Envoy's reason as the message: "no healthy
    upstream" for the models list, and for a completion (which a gateway must first prepare)
    that no gateway prepared it, and why."""
    with openai.OpenAI(base_url=lone_edge.url, api_key="unused", max_retries=0) as sdk:
        with pytest.raises(openai.InternalServerError) as listed:
            sdk.models.list()
        with pytest.raises(openai.InternalServerError) as chat:
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    for error in (listed, chat):
        assert error.value.status_code == 503
        assert error.value.response.headers["content-type"] == "application/json"
    assert listed.value.body == {
        "message": "no healthy upstream",
        "type": "service_unavailable",
        "param": None,
        "code": None,
    }
    assert isinstance(chat.value.body, dict)
    message = chat.value.body["message"]
    assert message.startswith("no gateway prepared the request (ext_proc_error"), message
    assert message.endswith("; retry") and chat.value.body["type"] == "service_unavailable"


def test_a_gateways_own_error_passes_the_edge_untouched(lone_edge: Edge) -> None:
    """Only Envoy's own replies are rewritten: a gateway's 503 reaches the caller as it sent
    it, though the same status from Envoy would have been mapped."""
    stand_in = http.server.ThreadingHTTPServer(("127.0.0.1", 0), GatewayStandIn)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{stand_in.server_address[1]}"
    try:
        lone_edge.route_openai_to(address)
        lone_edge.wait_for_openai_host(address, healthy=True)
        with (
            openai.OpenAI(base_url=lone_edge.url, api_key="unused", max_retries=0) as sdk,
            pytest.raises(openai.InternalServerError) as error,
        ):
            # Straight to the gateways' HTTP API (completions first meet a gateway's external
            # processor, which this edge has none of).
            sdk.models.list()
    finally:
        stand_in.shutdown()
        stand_in.server_close()
    assert error.value.status_code == 503
    assert error.value.body == GATEWAY_ERROR["error"]


def test_the_edges_rate_limit_is_a_429_openai_error(lone_edge: Edge) -> None:
    """Past the edge's bucket, Envoy's 429 on /v1/ is a rate_limit_error the SDK raises as
    RateLimitError, with retry-after-ms for its back-off."""
    with openai.OpenAI(base_url=lone_edge.url, api_key="unused", max_retries=0) as sdk:
        for _ in range(30):
            try:
                sdk.models.list()
            except openai.RateLimitError as limited:
                error = limited
                break
            except openai.APIStatusError:
                continue  # through the bucket: no gateway answered
        else:
            pytest.fail("30 requests at once and none refused by a bucket of 5 at 1/s")
    assert error.status_code == 429
    assert error.response.headers["retry-after-ms"] == "1000"
    assert isinstance(error.body, dict)
    assert error.body["type"] == "rate_limit_error" and error.body["message"]
    assert error.body["param"] is None and error.body["code"] is None
