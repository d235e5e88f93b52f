"""The load generator's logic against an in-process fake worker: schedules, workloads,
recording into HDR histograms, result files. No timing assertions: the fake's pace is only
there to make gaps non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from loadtests import report
from loadtests.runner import (
    GENERATOR_NICE,
    RunConfig,
    cpu_set,
    merge,
    one_request,
    run_shard,
)
from loadtests.stats import Latencies
from loadtests.targets import WorkerTarget
from loadtests.workload import Lengths, RequestSpec, Workload, poisson_arrivals
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2


class FakeWorker(inference_pb2_grpc.InferenceServiceServicer):  # type: ignore[misc]
    """Streams max_tokens tokens; a prompt containing 'fail' is refused."""

    async def Generate(
        self, request: inference_pb2.InferenceRequest, context: aio.ServicerContext
    ) -> AsyncIterator[token_pb2.Token]:
        if "fail" in request.prompt:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        for i in range(request.sampling.max_tokens):
            await asyncio.sleep(0.001)
            yield token_pb2.Token(text="t", index=i, emitted_unix_nanos=time.time_ns())


@pytest.fixture
async def fake_worker() -> AsyncIterator[str]:
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(FakeWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def test_poisson_schedule_is_reproducible_from_its_seed() -> None:
    first = list(islice(poisson_arrivals(20.0, seed=7), 50))
    again = list(islice(poisson_arrivals(20.0, seed=7), 50))
    other = list(islice(poisson_arrivals(20.0, seed=8), 50))
    assert first == again
    assert first != other
    assert first == sorted(first)


def test_poisson_gaps_are_exponential_with_mean_one_over_rate() -> None:
    times = list(islice(poisson_arrivals(50.0, seed=3), 20_000))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.03)
    # An exponential distribution's standard deviation equals its mean (a fixed rate's is 0).
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)


def test_shards_get_different_arrival_streams() -> None:
    assert list(islice(poisson_arrivals(5.0, 1, shard=0), 5)) != list(
        islice(poisson_arrivals(5.0, 1, shard=1), 5)
    )


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf")])
def test_open_loop_needs_a_positive_finite_rate(rate: float) -> None:
    with pytest.raises(ValueError):
        next(poisson_arrivals(rate, 1))


def test_length_distributions_parse_and_stay_in_bounds() -> None:
    rng = random.Random(1)
    assert {Lengths.parse("64").draw(rng) for _ in range(10)} == {64}
    uniform = [Lengths.parse("uniform:16:32").draw(rng) for _ in range(500)]
    assert min(uniform) >= 16 and max(uniform) <= 32 and len(set(uniform)) > 10
    normal = [Lengths.parse("normal:5:20").draw(rng) for _ in range(500)]
    assert min(normal) == 1  # clipped, never zero or negative
    with pytest.raises(ValueError, match="bad length distribution"):
        Lengths.parse("zipf:1:2")


def test_workload_requests_are_reproducible_from_the_seed() -> None:
    workload = Workload(Lengths.parse("uniform:4:40"), Lengths.parse("uniform:1:100"), seed=5)
    first = list(islice(workload.requests(), 20))
    assert first == list(islice(workload.requests(), 20))
    assert first != list(islice(workload.requests(shard=1), 20))
    assert [spec.index for spec in first] == list(range(20))


def test_percentiles_are_ordered_and_survive_encoding() -> None:
    latencies = Latencies()
    rng = random.Random(2)
    for _ in range(10_000):
        latencies.record(rng.expovariate(100.0))
    figures = latencies.percentiles()
    values = [value for name, value in figures.items() if name not in ("count", "mean_ms")]
    assert values == sorted(values)
    assert figures["p50_ms"] / 2 < figures["mean_ms"] < figures["max_ms"]
    decoded = Latencies.decode(latencies.encode())
    assert decoded.percentiles() == latencies.percentiles()
    decoded.merge(latencies)
    assert decoded.count == 20_000
    assert decoded.ms(99.9) == latencies.ms(99.9)
    cdf = decoded.cdf()
    assert cdf[-1][1] == pytest.approx(1.0)


def test_empty_histogram_reports_zeros() -> None:
    assert Latencies().percentiles()["p99.9_ms"] == 0.0


def config(address: str, **overrides: Any) -> RunConfig:
    # Runs end at the request budget, well within the duration, which only bounds a run on a
    # heavily loaded machine (a request must still start after the warm-up to be measured).
    values: dict[str, Any] = {
        "target": "worker",
        "address": address,
        "duration": 3.0,
        "warmup": 0.3,
        "requests": 40,
        "concurrency": 4,
        "output_tokens": "5",
        "prompt_words": "uniform:2:8",
    }
    return RunConfig(**{**values, **overrides})


async def test_closed_loop_records_every_token_and_gap(fake_worker: str) -> None:
    cfg = config(fake_worker)
    result = merge(cfg, [await run_shard(cfg, 0)], started=_now())
    assert result["status"] == {"OK": result["requests"]}
    assert 0 < result["requests"] <= 40
    assert result["warmup_requests"] > 0  # the warm-up ran but is not in the figures
    assert result["tokens"] == 5 * result["requests"]
    assert result["ttft_ms"]["count"] == result["requests"]
    assert result["itl_ms"]["count"] == 4 * result["requests"]
    # The same gaps, measured between the server's emission times.
    assert result["server_itl_ms"]["count"] == result["itl_ms"]["count"]
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
        values = [result[metric][key] for key in ("p50_ms", "p90_ms", "p99_ms", "p99.9_ms")]
        assert values == sorted(values) and values[0] > 0
    assert result["tokens_per_second"] > 0
    assert result["generator"]["cpu_fraction_per_process"][0] >= 0


async def test_a_process_starts_its_clock_when_every_process_of_the_run_is_ready(
    fake_worker: str,
) -> None:
    # A generator process spawned late must not leave the others to run part of the load
    # alone: each waits at the run's barrier, and its clock starts when the last arrives.
    cfg = config(fake_worker, duration=0.5, warmup=0.0)
    start = threading.Barrier(2)
    shard = asyncio.create_task(run_shard(cfg, 0, start=start))
    await asyncio.sleep(0.3)
    assert not shard.done()
    arrived = time.time()
    await asyncio.to_thread(start.wait, 5.0)
    result = await shard
    assert result["started_unix"] >= arrived
    assert result["window"][0] >= 0


async def test_shards_windows_are_merged_on_the_wall_clock(fake_worker: str) -> None:
    cfg = config(fake_worker, duration=0.5, warmup=0.0)
    shard = await run_shard(cfg, 0)
    late = {**shard, "started_unix": shard["started_unix"] + 10.0}
    alone = merge(cfg, [shard], started=_now())
    both = merge(cfg, [shard, late], started=_now())
    # Two shards 10 s apart cover their two windows and the gap, not one window.
    assert both["seconds"] == pytest.approx(alone["seconds"] + 10.0, abs=0.01)
    assert both["generator"]["start_spread_ms"] == pytest.approx(10_000, abs=1)
    assert alone["generator"]["start_spread_ms"] == 0


async def test_open_loop_sends_on_schedule_and_stops_at_the_request_bound(
    fake_worker: str,
) -> None:
    cfg = config(fake_worker, mode="open", rate=200.0, requests=30, duration=30.0, warmup=0.0)
    result = merge(cfg, [await run_shard(cfg, 0)], started=_now())
    assert result["requests"] == 30
    assert result["generator"]["send_lag_ms"]["count"] == 30
    assert result["errors"] == 0


async def test_a_failed_request_is_counted_by_its_status_code(fake_worker: str) -> None:
    async with WorkerTarget(fake_worker) as target:
        refused = RequestSpec(0, "please fail", 3)
        outcome = await one_request(target, refused, 5.0)
    first, gaps, _end, tokens, status, _warning, _messages = outcome
    assert (first, gaps, tokens, status) == (None, [], 0, "RESOURCE_EXHAUSTED")


async def test_bytes_on_the_wire_are_counted_through_the_relay(fake_worker: str) -> None:
    cfg = config(fake_worker, count_bytes=True)
    result = merge(cfg, [await run_shard(cfg, 0)], started=_now())
    wire = result["wire_bytes"]
    assert wire["sent"] > 0 and wire["received"] > 0
    assert wire["tokens"] >= result["tokens"]
    # A Token message with one character and an index is a few bytes plus HTTP/2 framing.
    assert 5 < wire["received_per_token"] < 200


async def test_result_file_table_and_plots(fake_worker: str, tmp_path: Path) -> None:
    cfg = config(fake_worker, label="fake c=4")
    result = merge(cfg, [await run_shard(cfg, 0)], started=_now())
    report.write_json(result, tmp_path / "run.json")
    loaded = json.loads((tmp_path / "run.json").read_text())
    assert {"config", "load_average_start", "generator", "ttft_ms", "itl_ms", "e2e_ms"} <= set(
        loaded
    )
    assert loaded["config"]["seed"] == 1
    table = report.markdown_table([loaded]).splitlines()
    assert len(table) == 3 and table[2].startswith("| fake c=4 | c=4 |")
    report.plot_cdfs([loaded], "ttft", tmp_path / "ttft.png", "TTFT")
    report.plot_throughput({"fake": [(1, 10.0), (4, 30.0)]}, tmp_path / "tput.png", "t", 50.0)
    report.plot_timeline(loaded, tmp_path / "timeline.png", "timeline", marker=0.5)
    for name in ("ttft.png", "tput.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        config("127.0.0.1:1", mode="sideways")
    with pytest.raises(ValueError):
        config("127.0.0.1:1", output_tokens="lots")


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


async def test_bench_summary_and_key_ratios_come_from_the_result_files(
    fake_worker: str, tmp_path: Path
) -> None:
    from loadtests.summary import write_summary

    base = config(fake_worker, duration=2.0, warmup=0.1)
    for label in ("worker c=1", "envoy>worker c=1"):
        cfg = replace(base, label=label, concurrency=1)
        report.write_json(merge(cfg, [await run_shard(cfg, 0)], _now()), _file(tmp_path, label))
    for label, count in (("edge gRPC c=8", False), ("edge gRPC bytes c=8", True)):
        cfg = replace(base, label=label, count_bytes=count)
        result = merge(cfg, [await run_shard(cfg, 0)], _now())
        report.write_json(result, tmp_path / "rest" / f"{label.replace(' ', '_')}.json")
    engine = {
        "what": "fake",
        "load_average_start": [0, 0, 0],
        "tokens_per_second_by_batch": {"1": 1000.0},
    }
    (tmp_path / "notes.json").write_text(json.dumps({"engine": engine, "machine": {}}))
    text = write_summary(tmp_path)
    assert "## 1. Transport overhead" in text and "## 2. The physical limit" in text
    assert "| 1 | +envoy |" in text
    ratios = json.loads((tmp_path / "key_ratios.json").read_text())
    assert ratios["engine_best_tokens_per_second"] == 1000.0
    assert ratios["worker_grpc_best_share_of_engine"] > 0
    assert set(ratios["ttft_added_per_hop_c1"]) == {"envoy>worker"}
    assert (tmp_path / "throughput-vs-concurrency.png").exists()


def _file(directory: Path, label: str) -> Path:
    return directory / "transport" / f"{label.replace(' ', '_').replace('>', '')}.json"


def test_a_generator_process_stands_apart_from_the_servers_it_measures() -> None:
    # In a child process: the test's own session and priority stay as they are.
    code = (
        "import os\n"
        "from loadtests.runner import _placement, stand_apart\n"
        "before = _placement()\n"
        "stand_apart(str(min(os.sched_getaffinity(0))))\n"
        "print(before); print(_placement()); print(os.getsid(0) == os.getpid())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    before, after, own = run.stdout.splitlines()
    assert before.startswith("the caller's session") and own == "True"
    assert after.startswith("own session")
    assert after.endswith(f"cores {min(os.sched_getaffinity(0))}")
    if os.geteuid() == 0:  # raising a priority needs the privilege
        assert f"nice {GENERATOR_NICE}, cores" in after
        if Path("/proc/self/autogroup").exists():  # the session's scheduling group too
            assert f"nice {GENERATOR_NICE}, nice" in after


@pytest.mark.parametrize(
    ("cpus", "cores"),
    [("", set()), ("1", {1}), ("0,2", {0, 2}), ("2-4", {2, 3, 4}), ("0,3-4", {0, 3, 4})],
)
def test_generator_cores_read_as_taskset_lists(cpus: str, cores: set[int]) -> None:
    assert cpu_set(cpus) == cores
