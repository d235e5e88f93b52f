"""The stall watchdog on a real ServiceHost and its gRPC health: an engine that holds requests
and makes no step for engine_stall_seconds turns the worker NOT_SERVING, and SERVING again when
it moves; only the engine's clock is a fake."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import helm_python
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from tests.support import eventually
from tests.unit.test_helm_chart import Release, render
from tokenmesh.common.host import ServiceHost
from tokenmesh.common.settings import ServiceSettings
from tokenmesh.worker.app import SERVICE_NAMES, register_stall_gauges
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineLoad, _LoadStatLogger
from tokenmesh.worker.watchdog import EngineActivity, StallWatchdog

LIMIT = 60.0
PROMPTLY = 5.0


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Worker:
    host: ServiceHost
    clock: Clock
    activity: EngineActivity
    watchdog: StallWatchdog
    running: asyncio.Task[int]

    async def statuses(self) -> set[str]:
        """Every status the worker's health answers: each name on its port, and the whole
        server on the probe port (what Envoy, Consul and Kubernetes ask)."""
        seen = {await status(self.host.ports["port"], name) for name in ("", *SERVICE_NAMES)}
        seen.add(await status(self.host.ports["health_port"]))
        return seen


async def status(port: int, service: str = "") -> str:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=PROMPTLY
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def new_worker() -> tuple[ServiceHost, Clock, EngineActivity, StallWatchdog]:
    settings = ServiceSettings(
        port=0, metrics_port=-1, health_port=0, grace_seconds=0.5, consul_http_addr=None
    )
    host = ServiceHost("worker", settings, SERVICE_NAMES)
    clock = Clock()
    activity = EngineActivity(clock)
    return host, clock, activity, StallWatchdog(activity, LIMIT, host.set_healthy)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    """A host that has started and turned SERVING."""
    host, clock, activity, watchdog = new_worker()
    running = asyncio.create_task(host.run())
    await eventually(lambda: host.health.serving)
    yield Worker(host, clock, activity, watchdog, running)
    if not running.done():
        os.kill(os.getpid(), signal.SIGTERM)  # the host's handler is installed while it runs
    assert await asyncio.wait_for(running, PROMPTLY) == 0


async def test_an_idle_engine_never_stalls(worker: Worker) -> None:
    worker.clock.now += 100 * LIMIT
    await worker.watchdog.check()
    assert worker.activity.stalled_seconds() == 0
    assert not worker.watchdog.stalled
    # Nor after work has come and gone, however long ago its last step was.
    worker.activity.request_started()
    worker.activity.stepped()
    worker.activity.request_ended()
    worker.clock.now += 100 * LIMIT
    await worker.watchdog.check()
    assert not worker.watchdog.stalled
    assert await worker.statuses() == {"SERVING"}


async def test_work_reaching_an_idle_engine_starts_its_clock(worker: Worker) -> None:
    """An engine idle for hours is not stalled the moment a request arrives."""
    worker.clock.now += 100 * LIMIT
    worker.activity.request_started()
    await worker.watchdog.check()
    assert worker.activity.stalled_seconds() == 0
    worker.clock.now += LIMIT - 1
    await worker.watchdog.check()
    assert not worker.watchdog.stalled
    assert await worker.statuses() == {"SERVING"}


async def test_a_busy_engine_that_steps_never_stalls(worker: Worker) -> None:
    """Steps of a saturated engine, each under the limit, for many times the limit."""
    worker.activity.request_started()
    for _ in range(10):
        worker.clock.now += LIMIT - 1
        worker.activity.stepped()
        await worker.watchdog.check()
        assert not worker.watchdog.stalled
    assert await worker.statuses() == {"SERVING"}


async def test_work_without_a_step_past_the_limit_turns_not_serving_and_logs_once(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    worker.activity.request_started()
    worker.activity.request_started()
    worker.clock.now += LIMIT - 0.1
    await worker.watchdog.check()
    assert await worker.statuses() == {"SERVING"}
    worker.clock.now += 0.1
    with caplog.at_level(logging.INFO, logger="tokenmesh.worker.watchdog"):
        for _ in range(3):
            await worker.watchdog.check()
            worker.clock.now += 1
    assert worker.watchdog.stalled
    assert await worker.statuses() == {"NOT_SERVING"}
    assert not worker.host.health.serving  # what the gateway's HTTP port would report too
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert "inference engine stalled" in record.getMessage()
    assert record.__dict__["requests"] == 2


async def test_a_step_after_the_stall_turns_serving_again_and_logs_it(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    worker.activity.request_started()
    worker.clock.now += 2 * LIMIT
    await worker.watchdog.check()
    assert await worker.statuses() == {"NOT_SERVING"}
    worker.activity.stepped()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmesh.worker.watchdog"):
        await worker.watchdog.check()
        await worker.watchdog.check()
    assert not worker.watchdog.stalled
    assert await worker.statuses() == {"SERVING"}
    [record] = caplog.records
    assert "moving again" in record.getMessage()


async def test_the_stalled_requests_ending_turns_serving_again(worker: Worker) -> None:
    """Requests that end without a step (their callers gave up and they were aborted) leave
    an idle engine, which is not stalled."""
    worker.activity.request_started()
    worker.clock.now += 2 * LIMIT
    await worker.watchdog.check()
    assert await worker.statuses() == {"NOT_SERVING"}
    worker.activity.request_ended()
    await worker.watchdog.check()
    assert await worker.statuses() == {"SERVING"}


async def test_once_shutdown_has_started_the_watchdog_never_turns_it_serving() -> None:
    host, clock, activity, watchdog = new_worker()
    during_shutdown: list[set[str]] = []

    async def engine_moves_during_the_drain() -> None:
        # Before the server stops: its port still answers.
        activity.stepped()
        await watchdog.check()
        assert not watchdog.stalled  # the watchdog saw the engine move and asked for SERVING
        during_shutdown.append({await status(host.ports["port"], n) for n in ("", *SERVICE_NAMES)})
        during_shutdown.append({await status(host.ports["health_port"])})

    host.before_server_stop(engine_moves_during_the_drain)
    running = asyncio.create_task(host.run())
    await eventually(lambda: host.health.serving)
    activity.request_started()
    clock.now += 2 * LIMIT
    await watchdog.check()
    assert not host.health.serving
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(running, PROMPTLY) == 0
    assert during_shutdown == [{"NOT_SERVING"}, {"NOT_SERVING"}]
    # And after it, too.
    await host.set_healthy(True)
    assert not host.health.serving


async def test_a_stall_seen_while_starting_keeps_it_not_serving_until_the_engine_moves() -> None:
    host, clock, activity, watchdog = new_worker()

    async def start() -> None:
        activity.request_started()
        clock.now += 2 * LIMIT
        await watchdog.check()

    running = asyncio.create_task(host.run(start))
    await eventually(lambda: watchdog.stalled and "health_port" in host.ports)
    await asyncio.sleep(0.1)  # run() has finished start and would have turned SERVING
    assert await status(host.ports["health_port"]) == "NOT_SERVING"
    activity.stepped()
    await watchdog.check()
    assert await status(host.ports["health_port"]) == "SERVING"
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(running, PROMPTLY) == 0


def test_each_engine_step_the_stat_logger_hears_of_is_progress() -> None:
    clock = Clock()
    activity = EngineActivity(clock)
    logger = _LoadStatLogger(EngineLoad(), activity)
    activity.request_started()
    clock.now += 2 * LIMIT
    assert activity.stalled_seconds() == 2 * LIMIT
    # A step whose outputs carry no scheduler figures is a step all the same.
    logger.record(scheduler_stats=None, iteration_stats=None)
    assert activity.stalled_seconds() == 0


async def test_the_gauges_show_the_stall_and_the_age_of_the_last_step() -> None:
    registry = CollectorRegistry()
    clock = Clock()
    activity = EngineActivity(clock)
    verdicts: list[bool] = []

    async def set_healthy(healthy: bool) -> None:
        verdicts.append(healthy)

    watchdog = StallWatchdog(activity, LIMIT, set_healthy)
    register_stall_gauges(registry, activity, watchdog)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name)

    clock.now += 100 * LIMIT
    assert (
        sample("tokenmesh_worker_engine_stalled"),
        sample("tokenmesh_worker_engine_step_age_seconds"),
    ) == (0, 0)
    activity.request_started()
    clock.now += 2 * LIMIT
    assert sample("tokenmesh_worker_engine_step_age_seconds") == 2 * LIMIT
    await watchdog.check()
    assert sample("tokenmesh_worker_engine_stalled") == 1
    activity.stepped()
    await watchdog.check()
    assert (
        sample("tokenmesh_worker_engine_stalled"),
        sample("tokenmesh_worker_engine_step_age_seconds"),
    ) == (0, 0)
    assert verdicts == [False, True]


# ---- the chart


def test_the_chart_passes_the_stall_limit_within_the_liveness_budget() -> None:
    """The worker's env carries worker.engineStallSeconds (the setting's own default unless
    set); a hung engine is restarted after it plus liveness period x threshold, within minutes;
    setting it through env as well is refused, so the budget has one source."""
    stall = "TOKENMESH_WORKER_ENGINE_STALL_SECONDS"
    defaults = Release(render({}))
    assert float(defaults.env("worker")[stall]) == WorkerSettings().engine_stall_seconds
    liveness = defaults.container("worker")["livenessProbe"]
    restart_after = (
        WorkerSettings().engine_stall_seconds
        + liveness["periodSeconds"] * liveness["failureThreshold"]
    )
    assert restart_after <= 5 * 60
    assert Release(render({"worker": {"engineStallSeconds": 2.5}})).env("worker")[stall] == "2.5"
    with pytest.raises(helm_python.HelmValuesError):
        render({"worker": {"engineStallSeconds": 0}})
    for values in ({"env": {stall: "5"}}, {"extraEnv": [{"name": stall, "value": "5"}]}):
        with pytest.raises(helm_python.HelmRenderError, match=r"worker\.engineStallSeconds"):
            render({"worker": values})
