"""The cost of a worker's front ends: a worker with one front end and one with two over its
engine (TOKENMESH_WORKER_FRONTENDS), streamed to directly, beside vLLM's OpenAI server with
one and with two API servers (`--api-server-count`), all up, in interleaved rounds at 64 and
256 streams of 128 tokens. For each: tokens/s, TTFT, and the CPU microseconds per delivered
token of each process (each front end, the supervisor, the engine; vLLM's API servers and
engine), read from /proc; from the front ends' sum, the tokens/s one core of front end
delivers (its ceiling).

    python -m loadtests.frontends_bench [--quick] [--rounds 3] [--out DIR]

The workers' and servers' engines share one core (one at a time is busy), their front ends
and the generator the other. All traffic goes to 127.0.0.1; every run is bounded in
duration and request count.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from loadtests import report
from loadtests.scenarios import RESULTS, Bench, openai_server
from loadtests.token_cost import Route, interleaved, summary_row
from tests.support import ROOT, worker_process
from tokenmesh.worker.placement import descendants

CONCURRENCY = (64, 256)
QUICK_CONCURRENCY = (64,)
OUTPUT_TOKENS = "128"
# Streams a generator connection carries: the kernel spreads a worker's connections over its
# front ends, and Envoy opens one per worker_streams_per_connection (64; 16 here spreads the
# generator's few connections as Envoy's threads spread theirs).
STREAMS_PER_CONNECTION = 16
ENGINE_CORE = "1"
FRONT_CORES = "0"


@contextmanager
def worker(frontends: int) -> Iterator[tuple[str, int]]:
    """A worker on the tiny model with `frontends` front ends: its address and pid."""
    process = worker_process(
        ROOT / ".run" / "bench-logs",
        name=f"worker-{frontends}-frontends",
        frontends=str(frontends),
        max_model_len="2048",
        max_num_seqs="256",
        cpu_threads_bind=ENGINE_CORE,
        cpu_affinity=FRONT_CORES,
    )
    print(f"[frontends] worker with {frontends} front end(s)", file=sys.stderr, flush=True)
    process.start()
    try:
        process.wait_serving(600)
        assert process.process is not None
        yield process.address, process.process.pid
    finally:
        process.stop()


def frontend_pids(root: int) -> list[int]:
    return [
        child.pid
        for child in psutil.Process(root).children()
        if "TokenmeshFrontend" in " ".join(child.cmdline())
    ]


def worker_route(label: str, address: str, pid: int) -> Route:
    """A worker's processes: one front end is the worker's own process; with several, each
    front end, the supervisor, and the engine's processes apart."""
    fronts = frontend_pids(pid)
    engine = [p for p in descendants(pid) if p not in fronts]
    if fronts:
        processes = {f"frontend {i}": [p] for i, p in enumerate(fronts)}
        processes["supervisor"] = [pid]
    else:
        processes = {"frontend 0": [pid]}
    processes["engine"] = engine
    return Route(label, "worker", address, "", processes, {})


def server_route(label: str, address: str, pid: int) -> Route:
    """vLLM's server: its API servers (the process itself when it runs one) and its engine."""
    children = psutil.Process(pid).children()
    servers = [c.pid for c in children if "APIServer" in " ".join(c.cmdline())]
    processes = {f"API server {i}": [p] for i, p in enumerate(servers or [pid])}
    if servers:
        processes["launcher"] = [pid]
    processes["engine"] = [p for p in descendants(pid) if p not in servers]
    return Route(label, "openai", address, "tiny", processes, {})


def front_end_cost(row: dict[str, Any]) -> dict[str, float]:
    """What the front ends spend together on a token (CPU µs), and so the tokens/s one core
    of front end delivers (its ceiling): 1e6 / that. Each front end's own figure is per token
    of the whole worker, of which it delivered a share; their sum is per token delivered."""
    spent = sum(
        cost
        for name, cost in row["cpu_us_per_token"].items()
        if name.startswith(("frontend", "API server"))
    )
    return {
        "front_ends_us_per_token": round(spent, 1),
        "tokens_per_second_a_core": round(1e6 / spent) if spent else 0,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| path | streams | tokens/s | TTFT p50 ms | CPU µs/token by process "
        "| front ends' µs/token | tokens/s a front-end core |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        costs = ", ".join(f"{k} {v}" for k, v in row["cpu_us_per_token"].items())
        front = row["front_ends"]
        lines.append(
            f"| {row['path']} | {row['streams']} | {row['tokens_per_second']:,.0f} | "
            f"{row['ttft_ms']['p50_ms']} | {costs} | {front['front_ends_us_per_token']} | "
            f"{front['tokens_per_second_a_core']:,} |"
        )
    return "\n".join(lines) + "\n"


def bench_frontends(bench: Bench, rounds: int) -> dict[str, Any]:
    concurrency = QUICK_CONCURRENCY if bench.quick else CONCURRENCY
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        one = worker_route("worker, 1 front end", *stack.enter_context(worker(1)))
        two = worker_route("worker, 2 front ends", *stack.enter_context(worker(2)))
        servers = [
            server_route(
                f"vLLM OpenAI, {n} API server{'s' if n > 1 else ''}",
                *stack.enter_context(openai_server(api_servers=n, engine_core=ENGINE_CORE)),
            )
            for n in (1, 2)
        ]
        routes = [one, two, *servers]
        for c in concurrency:
            configs = [
                bench.config(
                    target=route.target,
                    address=route.address,
                    model=route.model,
                    concurrency=c,
                    processes=2,
                    connections=max(1, c // 2 // STREAMS_PER_CONNECTION),
                    duration=bench.round_seconds,
                    output_tokens=OUTPUT_TOKENS,
                    cpus=FRONT_CORES,
                    label=f"{route.label} c={c}",
                )
                for route in routes
            ]
            runs = interleaved(configs, routes, rounds, "frontends")
            for route in routes:
                combined = runs[route.label]
                bench._record("frontends", combined)
                row = summary_row(combined, route, c)
                row["front_ends"] = front_end_cost(row)
                rows.append(row)
            print(markdown(rows[-len(routes) :]), file=sys.stderr, flush=True)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short rounds (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per target")
    parser.add_argument("--out", type=Path, default=None, help="result directory")
    args = parser.parse_args()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    bench = Bench(args.out or RESULTS / (stamp + ("-quick" if args.quick else "")), args.quick)
    started = time.strftime("%F %T")
    result = bench_frontends(bench, args.rounds)
    result["machine"] = {
        "cpus": os.cpu_count(),
        **report.processor(),
        "started_at": started,
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
    }
    (bench.out / "frontends").mkdir(parents=True, exist_ok=True)
    report.write_json(result, bench.out / "frontends" / "summary.json")
    (bench.out / "frontends" / "frontends.md").write_text(markdown(result["rows"]))
    print(markdown(result["rows"]))
    print(f"results in {bench.out / 'frontends'}", file=sys.stderr)


if __name__ == "__main__":
    main()
