"""First tokens at 1 stream, hop by hop: where a lone stream's first token waits.

A 1-gateway/1-worker mesh and a second Envoy on the other token path; one stream at a time,
128 tokens each, in interleaved rounds over four paths: the worker itself, the worker behind
Envoy's worker listener, the edge (gateway on the token path) and the direct-path edge. Reports
each path's TTFT of every request, p50/p90/max and the share over 50 ms, and the same for the
time the first token spent between the worker building its message and the client reading it.

    python -m loadtests.first_token [--requests 12] [--rounds 3] [--out FILE]

All traffic goes to 127.0.0.1; every run is a fixed number of requests, each with a timeout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from grpc import aio

from loadtests.report import emit
from loadtests.scenarios import private_mesh
from tests.harness.meshes import second_envoy
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, llm_pb2, llm_pb2_grpc

PROMPT = "hello there " * 8
TOKENS = 128
SLOW_MS = 50.0


async def first_tokens(address: str, worker: bool, requests: int) -> list[tuple[float, float]]:
    """(TTFT, ms the first token spent between the worker building its message and the client
    reading it) of `requests` streams, one after another, on one channel. Both clocks are this
    machine's wall clock (Token.emitted_unix_nanos)."""
    times = []
    async with aio.insecure_channel(address) as channel:
        for _ in range(requests):
            if worker:
                sampling = inference_pb2.SamplingParams(max_tokens=TOKENS, ignore_eos=True)
                call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
                    inference_pb2.InferenceRequest(prompt=PROMPT, sampling=sampling), timeout=60
                )
            else:
                request = llm_pb2.GenerateRequest(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True)
                call = llm_pb2_grpc.LLMServiceStub(channel).Generate(request, timeout=60)
            started = time.time_ns()
            first = held = 0
            async for token in call:
                if not first:
                    first = time.time_ns() - started
                    held = started + first - token.emitted_unix_nanos
            times.append((round(first / 1e6, 1), round(held / 1e6, 1)))
    return times


def summary(times: list[float]) -> dict[str, Any]:
    ordered = sorted(times)
    return {
        "p50_ms": statistics.median(ordered),
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max_ms": ordered[-1],
        "over_50ms_share": round(sum(t > SLOW_MS for t in ordered) / len(ordered), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    if not 1 <= args.requests <= 200 or not 1 <= args.rounds <= 10:
        parser.error("requests 1-200, rounds 1-10")
    with (
        private_mesh() as local_mesh,
        second_envoy(
            local_mesh,
            local_mesh.run_dir,
            direct_token_path=not local_mesh.settings.direct_token_path,
        ) as (other, _),
    ):
        s = local_mesh.settings
        direct, through_gateway = (s, other) if s.direct_token_path else (other, s)
        paths = {
            "worker": (local_mesh.program("worker-0").address, True),
            "Envoy>worker": (f"127.0.0.1:{s.worker_listener_port}", True),
            "edge>gateway>Envoy>worker": (f"127.0.0.1:{through_gateway.edge_port}", False),
            "edge>worker (direct token path)": (f"127.0.0.1:{direct.edge_port}", False),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        held: dict[str, list[float]] = {name: [] for name in paths}
        for number in range(args.rounds):
            for name, (address, worker) in paths.items():
                measured = uvloop.run(first_tokens(address, worker, args.requests))
                print(f"[first-token] {name} ({number + 1}/{args.rounds}): {measured}",
                      file=sys.stderr, flush=True)  # fmt: skip
                times[name].extend(ttft for ttft, _ in measured)
                held[name].extend(wait for _, wait in measured)
    report = {
        "streams": 1,
        "tokens": TOKENS,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "paths": {
            name: {
                **summary(values),
                # How long the first token took from the worker's message to the client.
                "first_token_in_transit": summary(held[name]),
                "ttft_ms": values,
                "in_transit_ms": held[name],
            }
            for name, values in times.items()
        },
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
