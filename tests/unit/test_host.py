"""ServiceHost's lifecycle on a real gRPC server: health on both ports through start-up, Consul
registration once SERVING, exit codes, and shutdown in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.consul_fake import FakeConsul
from tests.support import eventually
from tokenmesh.common.host import ServiceHost
from tokenmesh.common.settings import ServiceSettings

PROMPTLY = 5.0
NAMES = ("tokenmesh.v1.TestService",)


def settings(**values: Any) -> ServiceSettings:
    defaults: dict[str, Any] = {
        "port": 0,
        "metrics_port": 0,
        "health_port": 0,
        "grace_seconds": 0.5,
        "drain_seconds": 0,
        "consul_http_addr": None,
    }
    return ServiceSettings(**{**defaults, **values})


async def status(port: int, service: str = "") -> str:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=PROMPTLY
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def test_not_serving_while_starting_then_serving_on_both_ports_and_registered(
    fake_consul: FakeConsul,
) -> None:
    host = ServiceHost(
        "test", settings(consul_http_addr=fake_consul.address), NAMES, consul_meta={"model": "m"}
    )
    release = asyncio.Event()
    seen: dict[str, str] = {}

    async def start() -> None:
        await eventually(lambda: "health_port" in host.ports)
        seen["port"] = await status(host.ports["port"], NAMES[0])
        seen["health_port"] = await status(host.ports["health_port"])
        seen["consul"] = str(bool(fake_consul.instances))
        await release.wait()

    running = asyncio.create_task(host.run(start))
    await eventually(lambda: "consul" in seen)
    assert seen == {"port": "NOT_SERVING", "health_port": "NOT_SERVING", "consul": "False"}
    release.set()
    await eventually(lambda: bool(fake_consul.instances))
    [instance] = fake_consul.instances.values()
    assert (instance.port, instance.meta["role"], instance.meta["model"]) == (
        host.ports["port"],
        "test",
        "m",
    )
    assert await status(host.ports["port"], NAMES[0]) == "SERVING"
    assert await status(host.ports["health_port"]) == "SERVING"
    os.kill(os.getpid(), signal.SIGTERM)  # the host's handler is installed while it runs
    assert await asyncio.wait_for(running, PROMPTLY) == 0
    assert fake_consul.instances == {}  # deregistered on the way out


async def test_a_failed_start_exits_1_and_still_cleans_up(caplog: pytest.LogCaptureFixture) -> None:
    host = ServiceHost("test", settings(), NAMES)
    cleaned: list[str] = []
    host.on_stop(lambda: cleaned.append("stopped"))

    async def start() -> None:
        raise RuntimeError("the model failed to load")

    with caplog.at_level(logging.ERROR):
        assert await asyncio.wait_for(host.run(start), PROMPTLY) == 1
    assert "test failed to start: the model failed to load" in caplog.text
    assert cleaned == ["stopped"]


async def test_a_background_task_that_ends_stops_the_service_in_order() -> None:
    host = ServiceHost("test", settings(), NAMES)
    order: list[str] = []
    ended = asyncio.Event()

    async def watchdog() -> None:
        await ended.wait()  # e.g. the engine died

    async def close(name: str) -> None:
        await asyncio.sleep(0)
        order.append(name)

    host.keep_running(watchdog(), "watchdog")
    host.before_server_stop(lambda: order.append("before server stop"))
    host.on_stop(lambda: close("added first"))
    host.on_stop(lambda: close("added last"))
    running = asyncio.create_task(host.run())
    await eventually(lambda: "port" in host.ports)
    assert await status(host.ports["port"]) == "SERVING"
    ended.set()
    assert await asyncio.wait_for(running, PROMPTLY) == 1
    assert order == ["before server stop", "added last", "added first"]


async def test_on_sigterm_it_answers_not_serving_and_still_serves_rpcs_while_it_drains() -> None:
    """A stream Envoy sends before it has seen NOT_SERVING is served, not cancelled by a
    server that stopped accepting (Envoy does not retry a CANCELLED answer)."""
    host = ServiceHost("test", settings(drain_seconds=30), NAMES)
    running = asyncio.create_task(host.run())
    await eventually(lambda: "port" in host.ports)
    assert await status(host.ports["port"]) == "SERVING"
    os.kill(os.getpid(), signal.SIGTERM)
    await eventually(lambda: not host.health.serving)
    # Draining: health checks and every other RPC are still answered on the service port.
    for _ in range(3):
        assert await status(host.ports["port"], NAMES[0]) == "NOT_SERVING"
        await asyncio.sleep(0.2)
    assert not running.done()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running


async def test_a_service_stopping_for_a_failure_does_not_drain() -> None:
    """Its own failure (a dead engine): new RPCs are refused at once, so Envoy sends them
    elsewhere instead of to a server that cannot answer them."""
    host = ServiceHost("test", settings(drain_seconds=30), NAMES)
    ended = asyncio.Event()

    async def watchdog() -> None:
        await ended.wait()

    host.keep_running(watchdog(), "watchdog")
    running = asyncio.create_task(host.run())
    await eventually(lambda: "port" in host.ports)
    ended.set()
    assert await asyncio.wait_for(running, PROMPTLY) == 1


async def test_a_signal_during_start_cancels_it_and_exits_0() -> None:
    host = ServiceHost("test", settings(health_port=-1), NAMES)
    cancelled = asyncio.Event()

    async def start() -> None:
        try:
            await asyncio.sleep(60)  # a model that takes long to load
        except asyncio.CancelledError:
            cancelled.set()
            raise

    running = asyncio.create_task(host.run(start))
    await eventually(lambda: "port" in host.ports)
    assert "health_port" not in host.ports
    await asyncio.sleep(0.05)  # start is running, the signal handler installed
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(running, PROMPTLY) == 0
    assert cancelled.is_set()


@pytest.fixture
def switch_interval_kept() -> Iterator[None]:
    """The test process's GIL switch interval as it was, after the test sets it."""
    kept = sys.getswitchinterval()
    yield
    sys.setswitchinterval(kept)


@pytest.mark.usefixtures("switch_interval_kept")
def test_the_host_sets_its_processs_gil_switch_interval() -> None:
    # A worker's gRPC loop shares the GIL with its engine's thread (decision 0036).
    ServiceHost("test", settings(gil_switch_interval_ms=0.25), NAMES)
    assert sys.getswitchinterval() == pytest.approx(0.00025)
    ServiceHost("test", settings(), NAMES)
    assert sys.getswitchinterval() == pytest.approx(0.005)
