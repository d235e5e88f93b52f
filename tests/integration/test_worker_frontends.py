"""A worker with two front ends over one engine (TOKENMESH_WORKER_FRONTENDS=2, as `vllm serve
--api-server-count 2`): both serve the one port, a cancel on either frees the engine, the one
left serves when the other is killed, and killing the worker leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import psutil
import pytest
from grpc import aio

from tests.support import (
    ROOT,
    ServiceProcess,
    cancel_until_empty,
    health_status,
    metric_value,
    positions,
    read_rest,
    scrape_metrics,
    worker_process,
)
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration

LOG_DIR = ROOT / ".run" / "test-logs"
# A connection of its own per channel: grpc shares one between channels to the same address,
# and the kernel spreads connections, not streams, over the front ends.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
GENERATE = {"grpc_service": "tokenmesh.v1.InferenceService", "grpc_method": "Generate"}


@pytest.fixture(scope="module")
def frontends() -> Iterator[ServiceProcess]:
    process = worker_process(
        LOG_DIR, name="worker-frontends", frontends="2", max_model_len="2048", max_num_seqs="64"
    )
    process.start()
    try:
        process.wait_serving(300)
        yield process
    finally:
        process.stop()


@pytest.fixture
async def channels(frontends: ServiceProcess) -> AsyncIterator[list[aio.Channel]]:
    opened = [aio.insecure_channel(frontends.address, options=OWN_CONNECTION) for _ in range(16)]
    yield opened
    for channel in opened:
        await channel.close()


def request(prompt: str, tokens: int) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt=prompt, sampling=inference_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)
    )


def started_by_frontend(worker: ServiceProcess) -> dict[str, float]:
    page = scrape_metrics(worker.metrics_port)
    return {
        name: metric_value(page, "grpc_server_started_total", 0.0, frontend=name, **GENERATE)
        for name in ("0", "1")
    }


def frontend_processes(worker: ServiceProcess) -> list[psutil.Process]:
    assert worker.process is not None
    return [
        child
        for child in psutil.Process(worker.process.pid).children()
        if "TokenmeshFrontend" in " ".join(child.cmdline())
    ]


async def complete(channels: list[aio.Channel], tokens: int = 40) -> list[list[int]]:
    async def one(index: int, channel: aio.Channel) -> list[int]:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        call = stub.Generate(request(f"front end {index}", tokens), timeout=60)
        return positions([message async for message in call])

    return await asyncio.gather(*(one(i, c) for i, c in enumerate(channels)))


async def test_both_front_ends_serve_streams_on_the_one_port(
    frontends: ServiceProcess, channels: list[aio.Channel]
) -> None:
    before = started_by_frontend(frontends)
    assert await complete(channels) == [list(range(40))] * len(channels)
    served = {name: count - before[name] for name, count in started_by_frontend(frontends).items()}
    # Sixteen connections, each placed by the kernel: all on one front end is a 1-in-32,768
    # chance.
    assert served["0"] > 0 and served["1"] > 0, served
    assert sum(served.values()) == len(channels)
    page = scrape_metrics(frontends.metrics_port)
    assert metric_value(page, "tokenmesh_worker_frontends") == 2
    # vLLM's series from both front ends' clients, told apart by the label.
    assert metric_value(page, "vllm:generation_tokens_total", frontend="0") > 0
    assert metric_value(page, "vllm:generation_tokens_total", frontend="1") > 0


async def test_a_cancel_on_either_front_end_frees_the_engine(
    frontends: ServiceProcess, channels: list[aio.Channel]
) -> None:
    before = started_by_frontend(frontends)
    calls = [
        inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            request(f"cancel {i}", 2000), timeout=120
        )
        for i, channel in enumerate(channels)
    ]
    # The engine's figures are shared by the front ends: either one's report covers both.
    stats = inference_pb2_grpc.InferenceServiceStub(channels[0])
    seconds = await cancel_until_empty(calls, [stats])
    served = {name: count - before[name] for name, count in started_by_frontend(frontends).items()}
    assert served["0"] > 0 and served["1"] > 0, served
    assert seconds < 5, f"engine still busy {seconds:.1f} s after the cancel"


async def test_the_other_front_end_serves_when_one_is_killed(
    frontends: ServiceProcess, channels: list[aio.Channel]
) -> None:
    processes = frontend_processes(frontends)
    assert len(processes) == 2, processes
    processes[0].kill()
    processes[0].wait(10)
    page = ""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        page = scrape_metrics(frontends.metrics_port)
        if metric_value(page, "tokenmesh_worker_frontends") == 1:
            break
        await asyncio.sleep(0.2)
    assert metric_value(page, "tokenmesh_worker_frontends") == 1
    # New connections all reach the one left; it answers health and serves every stream.
    assert health_status(frontends.address) == "SERVING"
    fresh = [aio.insecure_channel(frontends.address, options=OWN_CONNECTION) for _ in range(8)]
    try:
        assert await complete(fresh) == [list(range(40))] * len(fresh)
    finally:
        for channel in fresh:
            await channel.close()
    assert frontends.process is not None and frontends.process.poll() is None


def test_killing_the_worker_leaves_no_process_of_its_engine(frontends: ServiceProcess) -> None:
    assert frontends.process is not None
    tree = psutil.Process(frontends.process.pid).children(recursive=True)
    assert any("EngineCore" in " ".join(p.cmdline()) for p in tree), tree
    os.kill(frontends.process.pid, signal.SIGKILL)
    frontends.process.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive, [(p.pid, p.cmdline()[:2]) for p in alive]


async def test_sigterm_drains_every_front_end_and_ends_the_engine() -> None:
    """SIGTERM: each front end finishes its in-flight stream, then the engine is shut down and
    the worker exits 0 with nothing left running."""
    worker = worker_process(LOG_DIR, name="worker-frontends-sigterm", frontends="2")
    worker.start()
    try:
        worker.wait_serving(300)
        assert worker.process is not None
        tree = psutil.Process(worker.process.pid).children(recursive=True)
        opened = [aio.insecure_channel(worker.address, options=OWN_CONNECTION) for _ in range(8)]
        calls = [
            inference_pb2_grpc.InferenceServiceStub(channel).Generate(
                request(f"drain {i}", 200), timeout=60
            )
            for i, channel in enumerate(opened)
        ]
        firsts = [await call.read() for call in calls]
        worker.signal(signal.SIGTERM)
        rests = [await read_rest(call) for call in calls]
        for first, rest in zip(firsts, rests, strict=True):
            assert positions([first, *rest]) == list(range(200))
        for channel in opened:
            await channel.close()
        assert await asyncio.to_thread(worker.process.wait, 60) == 0
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive, [(p.pid, p.cmdline()[:2]) for p in alive]
    finally:
        worker.stop()
