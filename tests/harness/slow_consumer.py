"""A client that stops reading N token streams through a mesh's edge, then reads them all:
how much Envoy (its allocator's own count) and the gateways (RSS) grew meanwhile, what share of
the tokens the gateways and the workers sent before HTTP/2 flow control stopped them, and
whether every stream still arrived whole. Run by tests/integration/test_backpressure.py and, against
several windows, by `python -m loadtests.slow_consumer_bench`.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from contextlib import AbstractContextManager
from dataclasses import dataclass

import grpc
import psutil
from grpc import aio
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.meshes import environment
from tokenmesh.common.tokens import token_count
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, llm_pb2, llm_pb2_grpc

# A reader that never reads: a fixed 64 KiB window per stream (gRPC's BDP probing off).
SLOW_CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]


@dataclass(frozen=True)
class SlowConsumerResult:
    streams: int
    tokens_per_stream: int
    # What the streams carried in all, measured once the client finally read them.
    output_bytes: int
    # Share of all tokens each service (its replicas together) had sent while the client read
    # nothing.
    gateway_sent_fraction: float
    worker_sent_fraction: float
    envoy_growth_bytes: int
    gateway_rss_growth_bytes: int
    # Every stream arrived whole, in order, once read.
    complete: bool
    # Tokens another client streamed meanwhile (on its own connection, through the same mesh):
    # the slow reader must not stall anyone else.
    bystander_tokens: int
    seconds_to_stall: float


def slow_consumer_env(
    stream_window: int | None = None, connection_window: int | None = None
) -> AbstractContextManager[None]:
    """The settings of a mesh rendered inside this block (TOKENMESH_MESH_*): Envoy's windows,
    when given."""
    windows = {
        "TOKENMESH_MESH_STREAM_WINDOW_BYTES": stream_window,
        "TOKENMESH_MESH_CONNECTION_WINDOW_BYTES": connection_window,
    }
    return environment({name: str(value) for name, value in windows.items() if value is not None})


def tokens_sent(metrics_port: int) -> float:
    """tokenmesh_tokens_generated_total of one process: the tokens it has sent (a message may
    hold several)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenmesh_tokens_generated_total":
                return float(sample.value)
    return 0.0


class SlowConsumerProbe:
    """Opens streams through the mesh's edge, reads nothing until the mesh stops sending, then
    reads everything; samples Envoy, gateway and worker along the way."""

    def __init__(self, local_mesh: LocalMesh) -> None:
        self._local_mesh = local_mesh
        self._gateways = local_mesh.replicas("gateway")
        self._workers = local_mesh.replicas("worker")

    def envoy_allocated(self) -> int:
        """Bytes Envoy's allocator holds (admin /memory), steadier than RSS."""
        url = f"http://127.0.0.1:{self._local_mesh.settings.envoy_admin_port}/memory"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return int(json.loads(reply.read())["allocated"])

    async def engine_done(self) -> bool:
        """vLLM has made every token asked of it, in every worker (it does not wait for slow
        readers)."""
        for worker in self._workers:
            async with aio.insecure_channel(worker.address) as channel:
                try:
                    stats = await inference_pb2_grpc.InferenceServiceStub(channel).GetEngineStats(
                        inference_pb2.EngineStatsRequest(), timeout=5
                    )
                except aio.AioRpcError as error:
                    # A worker busy making 20 logprobs a token can be slow to answer on a
                    # loaded machine: busy is not done, and the caller's loop asks again
                    # within its bound.
                    if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                        return False
                    raise
            if stats.running_requests + stats.waiting_requests:
                return False
        return True

    @staticmethod
    async def bystander(edge: str, tokens: int, limit: float) -> int:
        async with aio.insecure_channel(edge) as channel:
            request = llm_pb2.GenerateRequest(
                prompt="bystander", max_tokens=tokens, ignore_eos=True
            )
            stream = llm_pb2_grpc.LLMServiceStub(channel).Generate(request, timeout=limit)
            return sum([token_count(token) async for token in stream])

    def sent(self) -> tuple[float, float]:
        """Tokens the gateways, and the workers, have sent in all. On the direct token path no
        gateway sends a token: its tokenmesh_tokens_generated counts the direct streams Envoy
        logs to it as each ends (a second or less later, so also an earlier test's), and is
        not read."""
        gateways = () if self._local_mesh.settings.direct_token_path else self._gateways
        return (
            sum(tokens_sent(gateway.metrics_port or 0) for gateway in gateways),
            sum(tokens_sent(worker.metrics_port or 0) for worker in self._workers),
        )

    def gateways_rss(self, processes: list[psutil.Process]) -> int:
        return sum(process.memory_info().rss for process in processes)

    async def run(
        self, streams: int, max_tokens: int, settle_seconds: float = 3.0, limit: float = 120.0
    ) -> SlowConsumerResult:
        gateways = [psutil.Process(self._local_mesh.pid(g.name)) for g in self._gateways]
        envoy_before, rss_before = self.envoy_allocated(), self.gateways_rss(gateways)
        gateway_before, worker_before = self.sent()
        edge = f"127.0.0.1:{self._local_mesh.settings.edge_port}"
        async with aio.insecure_channel(edge, options=SLOW_CLIENT_OPTIONS) as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            calls = [
                stub.Generate(
                    llm_pb2.GenerateRequest(
                        prompt=f"slow reader {i}",
                        max_tokens=max_tokens,
                        ignore_eos=True,
                        logprobs=True,
                        top_logprobs=20,
                    ),
                    timeout=limit * 2,
                )
                for i in range(streams)
            ]
            started = time.monotonic()
            # Every stream has begun (its response headers came) before the watch starts.
            await asyncio.wait_for(
                asyncio.gather(*(call.initial_metadata() for call in calls)), limit
            )
            stalled_at, last = time.monotonic(), (-1.0, -1.0)
            envoy_peak, rss_peak = envoy_before, rss_before
            # Until the engine has made every token and, after that, neither service has sent
            # anything for settle_seconds: what is unsent then is held back by flow control,
            # not by a busy machine.
            done = False
            while not done or time.monotonic() - stalled_at < settle_seconds:
                assert time.monotonic() - started < limit, "the mesh never stopped sending"
                await asyncio.sleep(0.25)
                envoy_peak = max(envoy_peak, self.envoy_allocated())
                rss_peak = max(rss_peak, self.gateways_rss(gateways))
                now = self.sent()
                if now != last:
                    last, stalled_at = now, time.monotonic()
                done = done or await self.engine_done()
            total = streams * max_tokens
            bystander = await self.bystander(edge, tokens=64, limit=limit / 2)

            async def read_all(call: aio.UnaryStreamCall) -> tuple[list[int], int]:
                tokens = [token async for token in call]
                indexes = [t.index + n for t in tokens for n in range(token_count(t))]
                return indexes, sum(t.ByteSize() for t in tokens)

            read = await asyncio.gather(*(read_all(call) for call in calls))
        return SlowConsumerResult(
            streams=streams,
            tokens_per_stream=max_tokens,
            output_bytes=sum(size for _, size in read),
            gateway_sent_fraction=round((last[0] - gateway_before) / total, 3),
            worker_sent_fraction=round((last[1] - worker_before) / total, 3),
            envoy_growth_bytes=envoy_peak - envoy_before,
            gateway_rss_growth_bytes=rss_peak - rss_before,
            complete=all(indexes == list(range(max_tokens)) for indexes, _ in read),
            bystander_tokens=bystander,
            seconds_to_stall=round(stalled_at - started, 2),
        )
