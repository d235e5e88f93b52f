"""Worker benchmark: tokens/s for 1 stream and for N concurrent streams (their ratio shows the
batching gain), and cancel→engine-empty latency from vLLM's own scheduler reports.

    python -m loadtests.worker_bench --target 127.0.0.1:50061 [--streams 32 --tokens 64]

Every loop is bounded in count; the target must be a local worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from grpc import aio

from loadtests.stats import Latencies
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc


def request(i: int, max_tokens: int) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt=f"benchmark stream {i}",
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def stream_tokens(stub: inference_pb2_grpc.InferenceServiceStub, i: int, tokens: int) -> int:
    return sum([1 async for _ in stub.Generate(request(i, tokens))])


async def throughput(stub, streams: int, tokens: int, rounds: int) -> float:
    """Best tokens/s over rounds of `streams` concurrent streams of `tokens` tokens each."""
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        counts = await asyncio.gather(*(stream_tokens(stub, i, tokens) for i in range(streams)))
        best = max(best, sum(counts) / (time.perf_counter() - started))
    return best


async def cancel_latency(stub, streams: int, trials: int) -> Latencies:
    """Time from cancelling `streams` running streams to vLLM reporting an empty engine."""
    latencies = Latencies()
    for trial in range(trials):
        calls = [stub.Generate(request(trial * 100 + i, 2000)) for i in range(streams)]
        # The engine is busy from the last first token on: later "empty" reports are ours.
        busy_since = max([(await call.read()).emitted_unix_nanos for call in calls])
        cancelled_at = time.time_ns()
        for call in calls:
            call.cancel()
        for _ in range(5000):
            stats = await stub.GetEngineStats(inference_pb2.EngineStatsRequest())
            if stats.reported_unix_nanos > busy_since and not (
                stats.running_requests or stats.waiting_requests
            ):
                latencies.record(max(stats.reported_unix_nanos - cancelled_at, 0) / 1e9)
                break
            await asyncio.sleep(0.001)
    return latencies


async def main(args: argparse.Namespace) -> dict[str, object]:
    async with aio.insecure_channel(args.target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        await throughput(stub, 4, 16, 1)  # warm-up
        single = await throughput(stub, 1, args.tokens, args.rounds)
        batched = await throughput(stub, args.streams, args.tokens, args.rounds)
        cancels = await cancel_latency(stub, 8, args.cancel_trials)
    return {
        "target": args.target,
        "tokens_per_stream": args.tokens,
        "tokens_per_second_1_stream": round(single, 1),
        f"tokens_per_second_{args.streams}_streams": round(batched, 1),
        "batching_gain": round(batched / single, 2),
        "cancel_to_engine_empty": cancels.summary(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50061")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cancel-trials", type=int, default=10)
    arguments = parser.parse_args()
    if not arguments.target.startswith(("127.", "localhost")):
        sys.exit("benchmarks only target local services (127.0.0.1)")
    print(json.dumps(asyncio.run(main(arguments)), indent=2))
