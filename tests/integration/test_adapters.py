"""LoRA adapters on a mesh whose worker serves the tiny model's generated adapter
(TOKENMESH_LOCALMESH_LORA_MODULES, as a user turns it on): /v1/models lists it with its
parent; a request naming it as its `model` (the OpenAI SDK at the edge, or gRPC Generate's
`model`) is answered by it, its greedy answer different from the model's and the same as
vLLM's own server's with the same adapter; an unknown name is 404 / NOT_FOUND naming what
the mesh serves; prompt logprobs, which vLLM's engine fails with LoRA on, are refused naming
the field instead of ending the engine. Routing by adapter, over two workers whose engines hold
one adapter at a time (vLLM's default max_loras and max_cpu_loras, 1): a second name for the
same adapter goes, whatever the prompt, to one worker, which loads it on first use in place of
the first; under load it spills to the other worker, which loads it too (the workers' metrics
and engine stats say so). Beside them, a further pool of one worker serving a second base model
(the tiny model's shape, other weights): requests naming it reach only its worker, on every
path (Envoy's per-cluster counts say so), and /v1/models lists both models."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import httpx
import openai
import pytest

from tests.harness.adapter_meshes import (
    ADAPTER,
    ADAPTER_DIR,
    ADMIN_KEY,
    LIVE,
    MODEL,
    OTHER,
    OTHER_DIR,
    POOL,
    SECOND,
    LoraServer,
)
from tests.integration.test_mesh_dashboards import ADAPTER_ONLY, panel_targets, series, substitute
from tests.support import metric_value, ready_mesh, scrape_metrics
from tokenmesh.localmesh.mesh import LocalMesh, Program
from tokenmesh.localmesh.probes import fetch_text, http_ok
from tokenmesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    llm_pb2,
    llm_pb2_grpc,
)

pytestmark = pytest.mark.integration

PROMPTS = ["The colour of the sky is", "def main():", "Once upon a time"]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16}
# The same weights again, under a name the admin API adds at run time.
KEYED = (("authorization", f"Bearer {ADMIN_KEY}"),)


def sdk(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def mesh(adapters_mesh_started: LocalMesh) -> LocalMesh:
    return ready_mesh(adapters_mesh_started)


@pytest.fixture(scope="module")
def edge(mesh: LocalMesh) -> openai.OpenAI:
    return sdk(mesh.settings.edge_port)


@pytest.fixture(scope="module", autouse=True)
def lora_server_loads(lora_server_started: LoraServer) -> None:
    """vLLM's own server starts with the module's first test and loads while the tests before
    the one that compares with it run (not earlier: beside the session's early starts it
    would be a seventh engine in memory at once)."""


@pytest.fixture(scope="module")
def vllm_server(lora_server_started: LoraServer) -> int:
    """vLLM's own server, serving: its port."""
    process, port, log = lora_server_started
    deadline = time.monotonic() + 600
    while not http_ok(f"http://127.0.0.1:{port}/health"):
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "vLLM's server not up in 600 s"
        time.sleep(1)
    return port


def completions(client: openai.OpenAI, model: str) -> list[str]:
    return [
        client.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text
        for prompt in PROMPTS
    ]


def test_models_lists_each_model_and_the_adapter_under_its_model(edge: openai.OpenAI) -> None:
    cards = {card.id: card for card in edge.models.list().data}
    assert {MODEL, ADAPTER, SECOND, OTHER} <= set(cards)
    parents = {name: (card.model_extra or {}).get("parent") for name, card in cards.items()}
    assert parents[ADAPTER] == parents[SECOND] == MODEL
    assert parents[MODEL] is None and parents[OTHER] is None


def cluster_requests(mesh: LocalMesh) -> dict[str, float]:
    """Envoy's requests to each worker cluster so far (upstream_rq_total)."""
    page = fetch_text(f"http://127.0.0.1:{mesh.settings.envoy_admin_port}/stats?filter=worker")
    counts = {}
    for line in page.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("cluster.worker") and name.endswith(".upstream_rq_total"):
            counts[name.removeprefix("cluster.").removesuffix(".upstream_rq_total")] = float(value)
    return counts


async def test_each_models_requests_reach_only_its_pools_workers_on_every_path(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    (other,) = mesh.replicas(f"worker-{POOL}")
    assert other.settings is not None and other.settings.model == str(OTHER_DIR)
    workers = mesh.replicas("worker")
    before = cluster_requests(mesh), [finished(worker) for worker in workers], finished(other)
    # The OpenAI API on the direct path (through the edge's stream relay), a streamed Generate
    # on it, GetAnswer through a gateway: 5 engine requests; and /tokenize, a sixth call.
    theirs = completions(edge, OTHER)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.settings.edge_port}") as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        generate = llm_pb2.GenerateRequest(
            prompt=PROMPTS[0], max_tokens=16, temperature=0.0, model=OTHER
        )
        streamed = "".join([token.text async for token in stub.Generate(generate, timeout=60)])
        answer = await stub.GetAnswer(
            llm_pb2.Query(prompt=PROMPTS[0], max_tokens=4, model=OTHER), timeout=60
        )
    assert streamed == theirs[0] and answer.text
    async with httpx.AsyncClient(timeout=30) as client:
        tokenized = await client.post(
            f"http://127.0.0.1:{mesh.settings.edge_port}/tokenize",
            json={"model": OTHER, "prompt": PROMPTS[0]},
        )
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    # The pool's worker finished the 5 (vLLM's own count), the model's workers none of them;
    # Envoy sent the 6 calls to the pool's cluster (and perhaps the catalog's asks).
    assert finished(other) - before[2] == 5
    assert [finished(worker) for worker in workers] == before[1]
    requests = cluster_requests(mesh)
    assert requests[f"worker-{POOL}"] - before[0].get(f"worker-{POOL}", 0) >= 6
    # Its own weights: the same prompts answer otherwise than the tiny model's.
    assert theirs != completions(edge, MODEL)
    # The pool's worker counted its streams under its model's name.
    page = scrape_metrics(other.metrics_port or 0)
    assert metric_value(page, "tokenmesh_tokens_generated_total", 0.0, model=OTHER) > 0
    assert metric_value(page, "tokenmesh_tokens_generated_total", 0.0, model=MODEL) == 0
    # Its workers have LoRA off: prompt logprobs, which the model's workers refuse, are served.
    echoed = edge.completions.create(
        model=OTHER, prompt=PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    assert echoed.choices[0].model_extra and echoed.choices[0].model_extra["prompt_logprobs"]


def test_the_adapter_answers_as_vllms_own_server_answers_with_it(
    edge: openai.OpenAI, vllm_server: int
) -> None:
    own = sdk(vllm_server)
    adapted = completions(edge, ADAPTER)
    assert adapted == completions(own, ADAPTER)
    # The adapter changed the answers: they are not the model's.
    base = completions(edge, MODEL)
    assert base == completions(own, MODEL)
    assert adapted != base
    # A conversation too, and the answer names the adapter as its model.
    chat = edge.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": PROMPTS[0]}], **GREEDY
    )
    theirs = own.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": PROMPTS[0]}], **GREEDY
    )
    assert chat.model == ADAPTER
    assert chat.choices[0].message.content == theirs.choices[0].message.content


async def test_grpc_generate_names_the_adapter_and_unknown_models_are_not_found(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.settings.edge_port}") as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)

        async def text(model: str) -> str:
            request = llm_pb2.GenerateRequest(
                prompt=PROMPTS[0], max_tokens=16, temperature=0.0, model=model
            )
            return "".join([token.text async for token in stub.Generate(request, timeout=60)])

        streamed = await text(ADAPTER)
        assert streamed == completions(edge, ADAPTER)[0]
        assert await text("") == await text(MODEL) != streamed
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await text("no-such-model")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert ADAPTER in (unknown.value.details() or ""), unknown.value.details()
    with pytest.raises(openai.NotFoundError) as missing:
        edge.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert ADAPTER in str(missing.value) and MODEL in str(missing.value)


def test_prompt_logprobs_are_refused_naming_the_field_and_the_engine_lives(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as asked:
        edge.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 1}
        )
    assert "prompt_logprobs" in str(asked.value) and "LoRA" in str(asked.value)
    with pytest.raises(openai.BadRequestError) as echoed:
        edge.completions.create(
            model=ADAPTER, prompt=PROMPTS[0], max_tokens=2, echo=True, logprobs=1
        )
    assert "echo" in str(echoed.value), echoed.value
    # Both choices of a stream beside it: the engine still answers.
    answer = edge.completions.create(model=ADAPTER, prompt=PROMPTS[1], n=2, max_tokens=8)
    assert len(answer.choices) == 2 and answer.choices[0].text


def adapter_counts(worker: Program, name: str, adapter: str) -> float:
    page = scrape_metrics(worker.metrics_port or 0)
    return metric_value(page, f"tokenmesh_worker_adapter_{name}_total", 0.0, adapter=adapter)


def finished(worker: Program) -> float:
    """Requests the worker's engine has finished (vLLM's count)."""
    page = scrape_metrics(worker.metrics_port or 0)
    return metric_value(page, "vllm:request_success_total", 0.0)


async def held(worker: Program) -> list[str]:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stats = await inference_pb2_grpc.InferenceServiceStub(channel).GetEngineStats(
            inference_pb2.EngineStatsRequest(), timeout=10
        )
    return list(stats.held_adapters)


async def test_an_adapters_requests_go_to_one_worker_which_loads_it_on_first_use(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    workers = mesh.replicas("worker")
    # Each engine held the first adapter from its start (its cache holds one).
    assert [await held(worker) for worker in workers] == [[ADAPTER], [ADAPTER]]
    assert [adapter_counts(w, "loads", SECOND) for w in workers] == [0, 0]
    before = [finished(worker) for worker in workers]
    # Prompts that share nothing: the adapter, not the prompt, decides the worker.
    answers = [
        edge.completions.create(model=SECOND, prompt=f"{i} {prompt}", **GREEDY).choices[0].text
        for i, prompt in enumerate(PROMPTS * 3)
    ]
    assert all(answers), answers
    served = [finished(worker) - was for worker, was in zip(workers, before, strict=True)]
    assert sorted(served) == [0, len(answers)], served
    chosen, other = (workers[0], workers[1]) if served[0] else (workers[1], workers[0])
    # It loaded the adapter for the first of them, in place of the one it held.
    assert adapter_counts(chosen, "loads", SECOND) == 1
    assert adapter_counts(chosen, "evictions", ADAPTER) == 1
    assert await held(chosen) == [SECOND] and await held(other) == [ADAPTER]
    page = scrape_metrics(chosen.metrics_port or 0)
    assert metric_value(page, "tokenmesh_worker_adapter_load_seconds_count", adapter=SECOND) == 1


async def test_a_hot_adapter_spills_to_the_other_worker_which_loads_it(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    workers = mesh.replicas("worker")
    before = [finished(worker) for worker in workers]
    loads = [adapter_counts(worker, "loads", SECOND) for worker in workers]
    holding = [SECOND in await held(worker) for worker in workers]
    streams = 16

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.settings.edge_port}/v1", api_key="-", max_retries=0
    )

    async def one(i: int) -> int:
        answer = await client.completions.create(
            model=SECOND, prompt=f"hot {i}", max_tokens=200, extra_body={"ignore_eos": True}
        )
        return answer.usage.completion_tokens if answer.usage else 0

    async with client:
        tokens = await asyncio.gather(*(one(i) for i in range(streams)))
    assert tokens == [200] * streams
    served = [finished(worker) - was for worker, was in zip(workers, before, strict=True)]
    # Over the bound (125 % of the mean streams a worker has in flight) the adapter's streams
    # go to the next worker on the ring; most stay where the adapter was.
    assert sum(served) == streams and min(served) > 0, served
    assert max(served) >= streams / 2, served
    # The worker that held it (the first test's) loaded nothing; the other loaded it once, for
    # its first.
    assert sorted(holding) == [False, True], holding
    grew = [adapter_counts(w, "loads", SECOND) - n for w, n in zip(workers, loads, strict=True)]
    assert grew == [0 if holds else 1 for holds in holding], (grew, holding)


def test_the_dashboards_adapter_panels_show_the_loads(mesh: LocalMesh) -> None:
    """Every panel query of the adapters' series has data on this mesh's Prometheus (the
    shared mesh's dashboards test leaves them out: it serves no adapter)."""
    if not mesh.tools.prometheus:
        pytest.skip("no prometheus on PATH: install Debian's prometheus to check the panels")
    targets = panel_targets(ADAPTER_ONLY)
    assert len(targets) >= 3, targets
    deadline = time.monotonic() + 120
    missing = [expr for _, _, expr in targets]
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = [expr for expr in missing if not series(mesh, substitute(expr))]
    assert not missing, missing


async def admin(mesh: LocalMesh, method: str, **fields: str) -> Any:
    """One call of the control plane's adapter admin API through the edge, with the key."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.settings.edge_port}") as channel:
        stub = admin_pb2_grpc.AdapterAdminStub(channel)
        if method == "ListAdapters":
            return await stub.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=KEYED)
        request = admin_pb2.AdapterAdminRequest(**fields)
        return await getattr(stub, method)(request, metadata=KEYED, timeout=120)


def listed(client: openai.OpenAI) -> set[str]:
    return {card.id for card in client.models.list().data}


async def test_an_adapter_loaded_at_run_time_through_the_edge_is_listed_and_answers(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    """LoadAdapter at the edge, keyed: every worker serves and holds it; the gateways' catalog
    lists it within its TTL (30 s); its greedy answer is the settings adapter's (same weights)."""
    workers = mesh.replicas("worker")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.settings.edge_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await admin_pb2_grpc.AdapterAdminStub(channel).LoadAdapter(
                admin_pb2.AdapterAdminRequest(name=LIVE, directory=str(ADAPTER_DIR)),
                metadata=(("authorization", "Bearer not-the-key"),),
            )
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = await admin(mesh, "LoadAdapter", name=LIVE, directory=str(ADAPTER_DIR))
    assert reply.cluster == "worker"
    assert sorted((w.address, w.code, w.held) for w in reply.workers) == sorted(
        (worker.address, "OK", True) for worker in workers
    )
    assert [LIVE in await held(worker) for worker in workers] == [True, True]
    deadline = time.monotonic() + 40
    while LIVE not in listed(edge):
        assert time.monotonic() < deadline, "not in /v1/models within the catalog's TTL"
        await asyncio.sleep(1)
    live = edge.completions.create(model=LIVE, prompt=PROMPTS[0], **GREEDY)
    assert live.model == LIVE
    assert live.choices[0].text == completions(edge, ADAPTER)[0]


async def test_an_unloaded_adapter_is_loaded_again_by_its_next_request(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    workers = mesh.replicas("worker")
    reply = await admin(mesh, "UnloadAdapter", name=LIVE)
    assert [w.code for w in reply.workers] == ["OK", "OK"]
    assert [LIVE in await held(worker) for worker in workers] == [False, False]
    loads = [adapter_counts(worker, "loads", LIVE) for worker in workers]
    before = [finished(worker) for worker in workers]
    assert edge.completions.create(model=LIVE, prompt=PROMPTS[1], **GREEDY).choices[0].text
    served = [finished(worker) - was for worker, was in zip(workers, before, strict=True)]
    grew = [adapter_counts(w, "loads", LIVE) - n for w, n in zip(workers, loads, strict=True)]
    assert grew == [1 if n else 0 for n in served], (grew, served)
    assert [LIVE in await held(worker) for worker in workers] == [bool(n) for n in served]


async def test_a_forgotten_adapter_is_not_found_and_remembered_as_forgotten(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    reply = await admin(mesh, "ForgetAdapter", name=LIVE)
    assert [w.code for w in reply.workers] == ["OK", "OK"]
    with pytest.raises(openai.NotFoundError):
        edge.completions.create(model=LIVE, prompt=PROMPTS[0], max_tokens=1)
    state = await admin(mesh, "ListAdapters")
    assert [(r.name, r.forgotten) for r in state.remembered] == [(LIVE, True)]
    assert [sorted(w.adapters) for w in state.workers] == [sorted([ADAPTER, SECOND])] * 2
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await admin(mesh, "UnloadAdapter", name=LIVE)
    assert again.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_workers_admin_interface_is_not_reachable_through_envoy(mesh: LocalMesh) -> None:
    """Only the control plane calls WorkerAdmin, on the workers' own ports: the gateways' worker
    listener refuses it, and the edge does not route it to the workers."""
    request = admin_pb2.WorkerAdapterRequest(name=ADAPTER)
    for port in (mesh.settings.worker_listener_port, mesh.settings.edge_port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin_pb2_grpc.WorkerAdminStub(channel).ForgetAdapter(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, (port, refused.value)
    state = await admin(mesh, "ListAdapters")
    assert all(ADAPTER in worker.adapters for worker in state.workers)
