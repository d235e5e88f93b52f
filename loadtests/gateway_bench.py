"""Gateway benchmarks against a running local mesh (`make up`), all traffic to 127.0.0.1:

overhead     TTFT through the gateway vs straight to the worker, requests interleaved so both
             see the same machine load; reports p50/p99 and the gateway's added latency.
rerank       reranker latency for one request of 16 documents (p50/p99), straight to it.
degradation  pauses the reranker (SIGSTOP, so calls time out) and measures TTFT of degraded
             answers before the circuit opens and once it is open, then resumes it.

  python -m loadtests.gateway_bench overhead
  python -m loadtests.gateway_bench degradation --reranker-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

from grpc import aio

from loadtests.stats import Latencies
from tokenmesh.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    llm_pb2,
    llm_pb2_grpc,
    rerank_pb2,
    rerank_pb2_grpc,
)

DOCUMENTS = [f"Passage {i} about topic {i % 5}: some words for the reranker." for i in range(16)]


async def first_token_seconds(stream: AsyncIterator[object]) -> float:
    """Time until the first message, then drain the rest."""
    started = time.perf_counter()
    ttft = None
    async for _ in stream:
        if ttft is None:
            ttft = time.perf_counter() - started
    assert ttft is not None, "stream ended without a token"
    return ttft


async def overhead(args: argparse.Namespace) -> dict[str, object]:
    direct, through = Latencies(), Latencies()
    async with (
        aio.insecure_channel(args.worker) as worker_channel,
        aio.insecure_channel(args.gateway) as gateway_channel,
    ):
        worker = inference_pb2_grpc.InferenceServiceStub(worker_channel)
        gateway = llm_pb2_grpc.LLMServiceStub(gateway_channel)
        for i in range(args.requests + args.warmup):
            prompt = f"overhead probe {i}"
            worker_ttft = await first_token_seconds(
                worker.Generate(
                    inference_pb2.InferenceRequest(
                        prompt=prompt, sampling=inference_pb2.SamplingParams(max_tokens=4)
                    )
                )
            )
            gateway_ttft = await first_token_seconds(
                gateway.Generate(llm_pb2.GenerateRequest(prompt=prompt, max_tokens=4))
            )
            if i >= args.warmup:
                direct.record(worker_ttft)
                through.record(gateway_ttft)
    return {
        "ttft_direct_worker": direct.summary(),
        "ttft_through_gateway": through.summary(),
        "gateway_added_p50_ms": round(through.ms(50) - direct.ms(50), 2),
        "gateway_added_p99_ms": round(through.ms(99) - direct.ms(99), 2),
    }


async def rerank(args: argparse.Namespace) -> dict[str, object]:
    latencies = Latencies()
    async with aio.insecure_channel(args.reranker) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        request = rerank_pb2.RerankRequest(query="topic 3", documents=DOCUMENTS, top_k=3)
        for i in range(args.requests + args.warmup):
            started = time.perf_counter()
            await stub.Rerank(request)
            if i >= args.warmup:
                latencies.record(time.perf_counter() - started)
    return {"rerank_16_documents": latencies.summary()}


async def degradation(args: argparse.Namespace) -> dict[str, object]:
    if not args.reranker_pid:
        sys.exit(
            "degradation needs --reranker-pid (supervisorctl -c .run/supervisord.conf pid reranker)"
        )
    healthy, before_open, while_open = Latencies(), Latencies(), Latencies()
    request = llm_pb2.GenerateRequest(prompt="which passage?", documents=DOCUMENTS, max_tokens=4)
    async with aio.insecure_channel(args.gateway) as channel:
        gateway = llm_pb2_grpc.LLMServiceStub(channel)
        for _ in range(args.warmup + 10):
            healthy.record(await first_token_seconds(gateway.Generate(request)))
        os.kill(args.reranker_pid, signal.SIGSTOP)
        try:
            # Bounded: at most `requests` degraded calls; the circuit opens after a few.
            for _ in range(args.requests):
                call = gateway.Generate(request)
                started = time.perf_counter()
                first = await call.read()
                elapsed = time.perf_counter() - started
                while await call.read() is not aio.EOF:
                    pass
                warning = first.warnings[0] if first.warnings else ""
                (while_open if "circuit open" in warning else before_open).record(elapsed)
        finally:
            os.kill(args.reranker_pid, signal.SIGCONT)
    return {
        "ttft_healthy": healthy.summary(),
        "ttft_degraded_before_open": before_open.summary(),
        "ttft_degraded_circuit_open": while_open.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("mode", choices=("overhead", "rerank", "degradation"))
    parser.add_argument("--gateway", default="127.0.0.1:50050")
    parser.add_argument("--worker", default="127.0.0.1:50061")
    parser.add_argument("--reranker", default="127.0.0.1:50071")
    parser.add_argument("--reranker-pid", type=int, default=0)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    for address in (args.gateway, args.worker, args.reranker):
        if not address.startswith(("127.", "localhost")):
            sys.exit("benchmarks only target local services (127.0.0.1)")
    modes = {"overhead": overhead, "rerank": rerank, "degradation": degradation}
    print(json.dumps(asyncio.run(modes[args.mode](args)), indent=2))


if __name__ == "__main__":
    main()
