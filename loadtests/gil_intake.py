"""How long a burst of new calls waits for a grpc.aio server's handlers when a second thread of
the server's process keeps Python's GIL busy, as a worker's engine thread does (its output
handling on a loop of its own, decision 0010), at several GIL switch intervals.

A server process (grpc.aio on uvloop, as the services run) streams a 30-byte message every
8 ms on --background calls (the engine's step at 32 streams); its other thread works in pure
Python for --work-ms, then sleeps --sleep-ms, over and over. A client opens the background
streams, then sends --burst new calls at once, --rounds times; each new call's handler answers
with the time it began. Reported per switch interval: the wait from the client's send to the
handler's start (p50/p90/max, ms) and the server's CPU per background message from /proc. The
switch intervals run in interleaved rounds, each in a fresh server process, in two regimes:
"spare" (the server's process alone on its core) and "saturated" (a process spinning on the
same core, as the load generator, Envoy and the gateway share the front-end core of the 2-core
benchmark mesh), both pinned to the last core, the client to the others.

    python -m loadtests.gil_intake [--burst 64] [--background 64] [--rounds 3] [--out FILE]

Everything listens on 127.0.0.1; every call has a deadline and every loop a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvloop
from grpc import aio

from loadtests.grpc_floor import METHOD, identity, serve
from loadtests.report import emit
from loadtests.token_cost import cpu_seconds
from tokenmesh.localmesh.probes import free_port

# Python's default (5 ms), then shorter ones.
SWITCH_INTERVALS_MS = (5.0, 1.0, 0.5, 0.2)
REGIMES = ("spare", "saturated")
# A background stream's message, and how often it comes (the engine's step at 32 streams).
MESSAGE = b"x" * 30
PACE_SECONDS = 0.008
BACKGROUND_MESSAGES = 100_000  # more than a run lasts: cancelled at its end


def busy(work_ms: float, sleep_ms: float, stop: threading.Event) -> None:
    """The engine thread's stand-in: pure Python for work_ms, then a sleep, until stop."""
    while not stop.is_set():
        end = time.perf_counter() + work_ms / 1000
        count = 0
        while time.perf_counter() < end:
            count += 1
        time.sleep(sleep_ms / 1000)


def spin(core: int) -> None:
    """Another process's load on the server's core."""
    os.sched_setaffinity(0, {core})
    while True:
        pass


def server(
    port: int, interval_ms: float, work_ms: float, sleep_ms: float, core: int, ready: Any
) -> None:
    os.sched_setaffinity(0, {core})
    sys.setswitchinterval(interval_ms / 1000)
    stop = threading.Event()
    threading.Thread(target=busy, args=(work_ms, sleep_ms, stop), daemon=True).start()

    async def calls(request: bytes, context: Any) -> AsyncIterator[bytes]:
        began = time.time_ns()
        if request == b"burst":
            yield str(began).encode()
            return
        for _ in range(BACKGROUND_MESSAGES):
            await asyncio.sleep(PACE_SECONDS)
            yield MESSAGE

    uvloop.run(serve(port, calls, identity, ready))


async def client(port: int, background: int, burst: int, bursts: int) -> list[float]:
    """The waits (ms) from each burst call's send to its handler's start."""
    waits: list[float] = []
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(
            METHOD, request_serializer=identity, response_deserializer=identity
        )

        async def stream() -> None:
            async for _ in call(b"background", timeout=120):
                pass

        streams = [asyncio.create_task(stream()) for _ in range(background)]
        await asyncio.sleep(2.0)  # every background stream is flowing

        async def one() -> None:
            sent = time.time_ns()
            async for began in call(b"burst", timeout=30):
                waits.append((int(began) - sent) / 1e6)

        for _ in range(bursts):
            await asyncio.gather(*(one() for _ in range(burst)))
            await asyncio.sleep(0.5)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return waits


def measure(
    core: int,
    interval_ms: float,
    saturated: bool,
    background: int,
    burst: int,
    bursts: int,
    work_ms: float,
    sleep_ms: float,
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    port = free_port()
    process = context.Process(
        target=server, args=(port, interval_ms, work_ms, sleep_ms, core, ready), daemon=True
    )
    process.start()
    hog = context.Process(target=spin, args=(core,), daemon=True) if saturated else None
    if hog is not None:
        hog.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the server did not start within 30 s")
        before = cpu_seconds([process.pid or 0])
        began = time.monotonic()
        waits = sorted(uvloop.run(client(port, background, burst, bursts)))
        seconds = time.monotonic() - began
        cpu = cpu_seconds([process.pid or 0]) - before
    finally:
        for started in (process, hog):
            if started is not None:
                started.kill()
                started.join(10)

    def quantile(q: float) -> float:
        return round(waits[min(len(waits) - 1, int(q * len(waits)))], 2)

    return {
        "regime": "saturated" if saturated else "spare",
        "switch_interval_ms": interval_ms,
        "calls": len(waits),
        "wait_p50_ms": quantile(0.5),
        "wait_p90_ms": quantile(0.9),
        "wait_max_ms": round(waits[-1], 2),
        "server_cpu_fraction": round(cpu / seconds, 3),
    }


def summary(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per regime and switch interval, the median of the rounds' figures."""
    rows = []
    for regime, interval in ((r, i) for r in REGIMES for i in SWITCH_INTERVALS_MS):
        mine = [r for r in rounds if (r["regime"], r["switch_interval_ms"]) == (regime, interval)]
        rows.append(
            {
                "regime": regime,
                "switch_interval_ms": interval,
                **{
                    key: round(statistics.median(r[key] for r in mine), 2)
                    for key in ("wait_p50_ms", "wait_p90_ms", "wait_max_ms", "server_cpu_fraction")
                },
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=64, help="new calls sent at once")
    parser.add_argument("--bursts", type=int, default=5, help="bursts per round")
    parser.add_argument("--background", type=int, default=64, help="streams already flowing")
    parser.add_argument("--work-ms", type=float, default=5.0, help="the busy thread's stretch")
    parser.add_argument("--sleep-ms", type=float, default=1.0, help="its pause between them")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    if not (
        1 <= args.burst <= 256
        and 1 <= args.bursts <= 20
        and 0 <= args.background <= 256
        and 1 <= args.rounds <= 10
    ):
        parser.error("burst 1-256, bursts 1-20, background 0-256, rounds 1-10")
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        parser.error("needs 2 cores: the server's, and the client's")
    # The server (and the spinning process) on the last core, this client on the others.
    server_core = max(cores)
    os.sched_setaffinity(0, cores - {server_core})
    rounds = []
    for number in range(args.rounds):
        for regime, interval in ((r, i) for r in REGIMES for i in SWITCH_INTERVALS_MS):
            result = measure(
                server_core,
                interval,
                regime == "saturated",
                args.background,
                args.burst,
                args.bursts,
                args.work_ms,
                args.sleep_ms,
            )
            result["round"] = number + 1
            print(result, file=sys.stderr, flush=True)
            rounds.append(result)
    emit(
        {
            "burst": args.burst,
            "bursts_per_round": args.bursts,
            "background_streams": args.background,
            "busy_thread": {"work_ms": args.work_ms, "sleep_ms": args.sleep_ms},
            "summary": summary(rounds),
            "rounds": rounds,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
