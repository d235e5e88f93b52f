"""grpc.aio's own cost per streamed message: a bare server and a bare proxy, no tokenmesh code.

A server process streams prebuilt Token messages; a proxy process forwards them (read one from
its upstream call, write it to its caller), as the gateway does; a client process reads them.
Each process runs grpc.aio on uvloop, as the services do. CPU per source message (one token
each) of the server and the proxy comes from /proc. Paced runs send one message per stream
every --pace seconds (the engine's step at 32 streams is ~8 ms), so each message wakes the
processes on its own, as in the mesh; unpaced runs show the floor when messages queue up.
Shapes of the proxy: `direct` (read, write), `readahead` (the gateway's ReadAhead reading
while it writes).

    python -m loadtests.grpc_floor [--streams 32] [--messages 400] [--pace 0.008] [--rounds 3]

Everything listens on 127.0.0.1; every stream is a fixed number of messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import uvloop
from grpc import aio

from loadtests.report import emit
from loadtests.token_cost import cpu_seconds
from tokenmesh.localmesh.probes import free_port
from tokenmesh.v1 import token_pb2

METHOD = "/floor.Stream/Tokens"
SHAPES = ("direct", "readahead")


def identity(data: bytes) -> bytes:
    return data


async def serve(port: int, handler: Any, serializer: Any, ready: Any) -> None:
    server = aio.server()
    method = grpc.unary_stream_rpc_method_handler(
        handler, request_deserializer=identity, response_serializer=serializer
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("floor.Stream", {"Tokens": method})]
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def source(port: int, messages: int, pace: float, ready: Any) -> None:
    """Streams `messages` serialized Tokens per call, one every `pace` seconds."""
    payload = [token_pb2.Token(text=" tok", index=i, token_ids=[i]).SerializeToString()
               for i in range(messages)]  # fmt: skip

    async def tokens(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for message in payload:
            if pace:
                await asyncio.sleep(pace)
            yield message

    uvloop.run(serve(port, tokens, identity, ready))


def proxy(port: int, upstream: str, shape: str, ready: Any) -> None:
    """Forwards each upstream message (parsed, as the gateway reads them) to its caller."""
    from tokenmesh.gateway.core.workers import ReadAhead

    async def main() -> None:
        channel = aio.insecure_channel(upstream)
        call = channel.unary_stream(
            METHOD, request_serializer=identity, response_deserializer=token_pb2.Token.FromString
        )

        async def direct(request: bytes, context: Any) -> AsyncIterator[token_pb2.Token]:
            stream = call(b"")
            while (message := await stream.read()) is not aio.EOF:
                yield message

        async def ahead(request: bytes, context: Any) -> AsyncIterator[token_pb2.Token]:
            reader = ReadAhead(call(b""), 256, 64)
            try:
                while (message := await reader.next()) is not None:
                    yield message
            finally:
                reader.close()

        handler = direct if shape == "direct" else ahead
        await serve(port, handler, token_pb2.Token.SerializeToString, ready)

    uvloop.run(main())


async def read_all(address: str, streams: int) -> tuple[int, int]:
    """Every stream, read concurrently on one channel: (messages, tokens) that arrived (the
    read-ahead proxy merges the tokens that queue up behind a write)."""
    async with aio.insecure_channel(address) as channel:
        call = channel.unary_stream(METHOD, request_serializer=identity,
                                    response_deserializer=token_pb2.Token.FromString)  # fmt: skip

        async def one() -> tuple[int, int]:
            messages = [message async for message in call(b"", timeout=300)]
            return len(messages), sum(len(message.token_ids) for message in messages)

        counts = await asyncio.gather(*(one() for _ in range(streams)))
        return sum(m for m, _ in counts), sum(t for _, t in counts)


def measure(shape: str, streams: int, messages: int, pace: float) -> dict[str, Any]:
    """One round: fresh processes, a warm-up pass, then the measured pass."""
    spawn = multiprocessing.get_context("spawn")
    upstream_port, proxy_port = free_port(), free_port()
    processes = []
    try:
        for target, args in (
            (source, (upstream_port, messages, pace)),
            (proxy, (proxy_port, f"127.0.0.1:{upstream_port}", shape)),
        ):
            ready = spawn.Event()
            process = spawn.Process(target=target, args=(*args, ready), daemon=True)
            process.start()
            processes.append(process)
            if not ready.wait(60):
                raise SystemExit(f"{target.__name__} did not start")
        address = f"127.0.0.1:{proxy_port}"
        uvloop.run(read_all(address, streams))
        before = [cpu_seconds([process.pid or 0]) for process in processes]
        started = time.monotonic()
        received, tokens = uvloop.run(read_all(address, streams))
        seconds = time.monotonic() - started
        after = [cpu_seconds([process.pid or 0]) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.join(10)
    # Per source message (one token each): what the proxy spends to forward each.
    server, forwarded = (1e6 * (b - a) / tokens for a, b in zip(before, after, strict=True))
    return {
        "shape": shape,
        "messages": tokens,
        "messages_out": received,
        "messages_per_second": round(tokens / seconds),
        "server_us_per_message": round(server, 1),
        "proxy_us_per_message": round(forwarded, 1),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per shape of each figure over the rounds."""
    out: dict[str, Any] = {}
    for shape in SHAPES:
        runs = [r for r in rounds if r["shape"] == shape]
        out[shape] = {
            key: statistics.median(r[key] for r in runs)
            for key in ("messages_per_second", "server_us_per_message", "proxy_us_per_message")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--messages", type=int, default=400, help="per stream")
    parser.add_argument("--pace", type=float, default=0.008, help="seconds between messages")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape")
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    if not 1 <= args.streams <= 256 or not 1 <= args.messages <= 10_000 or args.rounds > 10:
        parser.error("streams 1-256, messages 1-10000, rounds at most 10")
    rounds = []
    for number in range(args.rounds):
        for pace in (args.pace, 0.0):
            for shape in SHAPES:
                result = measure(shape, args.streams, args.messages, pace)
                result.update(pace_seconds=pace, round=number + 1)
                print(json.dumps(result), file=sys.stderr, flush=True)
                rounds.append(result)
    report = {
        "streams": args.streams,
        "messages_per_stream": args.messages,
        "paced": summary([r for r in rounds if r["pace_seconds"]]),
        "unpaced": summary([r for r in rounds if not r["pace_seconds"]]),
        "pace_seconds": args.pace,
        "rounds": rounds,
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
