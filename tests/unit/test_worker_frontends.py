"""The parts of several front ends over one engine that need no engine: the load and step clock
they share, their metrics gathered on one port, the settings and the port they share."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import ValidationError

from tokenmesh.common.errors import ResourceExhausted
from tokenmesh.worker.admission import Admission
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine_state import EngineLoad, shared_step_clock
from tokenmesh.worker.gathered_metrics import FrontendMetrics
from tokenmesh.worker.watchdog import EngineActivity


def report_twice(load: EngineLoad) -> None:
    """In a spawned process: two steps' reports."""
    load.report(running=3, waiting=1, kv_cache_usage=0.5, queries=100, hits=40)
    load.report(running=2, waiting=0, kv_cache_usage=0.25, queries=60, hits=60)


def test_a_load_in_shared_memory_shows_what_another_process_reported() -> None:
    context = multiprocessing.get_context("spawn")
    load = EngineLoad.shared(context)
    child = context.Process(target=report_twice, args=(load,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert (load.running, load.waiting, load.kv_cache_usage) == (2, 0, 0.25)
    # Each step's lookups add up, whichever process they were reported to.
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (160, 100)
    assert load.reported_unix_nanos > 0
    load.report(running=0, waiting=0, kv_cache_usage=0.0, queries=40, hits=0)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (200, 100)


def test_a_step_reported_to_one_front_end_moves_the_engine_for_all() -> None:
    now = [100.0]
    steps = shared_step_clock(multiprocessing.get_context("spawn"))
    steps[0] = now[0]
    mine, other = (EngineActivity(lambda: now[0], steps) for _ in range(2))
    mine.request_started()
    other.request_started()
    now[0] = 160.0
    assert mine.stalled_seconds() == other.stalled_seconds() == 60.0
    # vLLM sends the step's report to one front end only.
    other.stepped()
    now[0] = 161.0
    assert mine.stalled_seconds() == other.stalled_seconds() == 1.0


def test_each_front_ends_series_keep_their_own_label_on_the_one_page() -> None:
    pages = {}
    for index, count in ((0, 3), (1, 5)):
        registry = CollectorRegistry()
        Counter("streams", "Streams.", ["method"], registry=registry).labels("Generate").inc(count)
        Gauge("stalled", "Stalled.", registry=registry).set(index)
        pages[9000 + index] = generate_latest(registry).decode()
    registry = CollectorRegistry()
    # Front end 2 has no metrics port yet; 9002 does not answer.
    registry.register(FrontendMetrics(lambda: [9000, 9001, 0], lambda port: pages.get(port)))
    page = generate_latest(registry).decode()
    assert 'streams_total{frontend="0",method="Generate"} 3.0' in page
    assert 'streams_total{frontend="1",method="Generate"} 5.0' in page
    assert 'stalled{frontend="1"} 1.0' in page
    # One family, declared once.
    assert page.count("# TYPE streams_total counter") == 1
    assert 'frontend="2"' not in page


def test_front_ends_share_one_engine_not_data_parallel_ranks() -> None:
    WorkerSettings(frontends=4)
    with pytest.raises(ValidationError, match="data_parallel_size=2"):
        WorkerSettings(frontends=2, engine_args={"data_parallel_size": 2})
    with pytest.raises(ValidationError, match="frontends"):
        WorkerSettings(frontends=0)


def test_the_shared_port_must_be_free_first() -> None:
    # Imported here: the spawned process above imports this module, and this one imports vLLM.
    from tokenmesh.worker.frontends import claim_port

    free = claim_port("127.0.0.1", 0)
    assert free > 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            claim_port("127.0.0.1", taken.getsockname()[1])


def test_front_ends_admit_against_one_shared_bound() -> None:
    shared = multiprocessing.get_context("spawn").Value("q", 0)
    first, second = Admission(1, shared), Admission(1, shared)
    with contextlib.ExitStack() as held:
        held.enter_context(first.admit(engine_waiting=0, max_running=2))
        held.enter_context(second.admit(engine_waiting=0, max_running=2))
        held.enter_context(first.admit(engine_waiting=0, max_running=2))
        # The worker's fourth stream, whichever front end it reaches.
        with pytest.raises(ResourceExhausted, match="3 streams admitted"):
            held.enter_context(second.admit(engine_waiting=0, max_running=2))
        assert first.admitted == second.admitted == 3
    assert shared.value == 0
