"""Against a real Consul agent (`consul agent -dev`), when a consul binary is on PATH: a
service registers itself with a native gRPC health check, Consul runs that check against the
service's grpc.health.v1, the control plane's Consul source sees the instance turn healthy,
unhealthy and go away, and the registration comes back after the agent restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from tests.support import ROOT, free_port
from tokenmesh.common.backoff import Backoff
from tokenmesh.common.consul_http import consul_client
from tokenmesh.common.processes import stop_process
from tokenmesh.common.registration import ConsulRegistration, ServiceInstance
from tokenmesh.controlplane.consul_source import ConsulSource
from tokenmesh.controlplane.endpoints import Endpoint, Snapshot

pytestmark = pytest.mark.integration

CONSUL = shutil.which("consul")
LOG_DIR = ROOT / ".run" / "test-logs"
# A -dev agent elects itself leader in about a second; generous for a loaded machine.
AGENT_READY_TIMEOUT = 60.0
# Consul runs the check every second (below); seeing its result takes a few intervals.
CHECK_SEEN_WITHIN = 20.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ConsulAgent:
    """`consul agent -dev` with every port of its own (several may run on one machine)."""

    def __init__(self) -> None:
        self.http_port = free_port()
        self.ports = {
            "-serf-lan-port": free_port(),
            "-serf-wan-port": free_port(),
            "-server-port": free_port(),
        }
        self.log_path = LOG_DIR / f"consul-{self.http_port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def start(self) -> None:
        assert CONSUL is not None
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        command = [
            CONSUL, "agent", "-dev",
            "-bind", "127.0.0.1", "-client", "127.0.0.1",
            "-http-port", str(self.http_port),
            # DNS and gRPC (xDS for Consul's own mesh) are not used: off, so they cannot clash.
            "-dns-port", "-1", "-grpc-port", "-1", "-hcl", "ports { grpc_tls = -1 }",
            "-node", f"test-{self.http_port}",
            *[str(item) for pair in self.ports.items() for item in pair],
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + AGENT_READY_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text(errors="replace")
            with contextlib.suppress(OSError, ValueError):
                url = f"http://{self.address}/v1/status/leader"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if json.loads(reply.read()):  # "" until a leader is elected
                        return
            time.sleep(0.2)
        raise TimeoutError(f"consul agent not ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 20)

    def agent_services(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.address}/v1/agent/services", timeout=5) as r:
            return dict(json.loads(r.read()))


@pytest.fixture
def agent() -> Iterator[ConsulAgent]:
    if CONSUL is None:
        pytest.skip(
            "no consul binary on PATH: install Consul (e.g. the HashiCorp apt repository) to run "
            "the real-agent tests; the fake-agent tests in tests/unit cover the same protocol"
        )
    consul = ConsulAgent()
    consul.start()
    try:
        yield consul
    finally:
        consul.stop()


@pytest.fixture
async def service() -> AsyncIterator[tuple[HealthServicer, int]]:
    server = aio.server()
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await health.set("", SERVING)
    await server.start()
    try:
        yield health, port
    finally:
        await server.stop(0)


async def next_matching(
    snapshots: asyncio.Queue[Snapshot], condition: Callable[[Snapshot], bool]
) -> Snapshot:
    async with asyncio.timeout(CHECK_SEEN_WITHIN):
        while True:
            snapshot = await snapshots.get()
            if condition(snapshot):
                return snapshot


async def test_registration_and_consul_source_against_a_real_agent(
    agent: ConsulAgent, service: tuple[HealthServicer, int]
) -> None:
    health, port = service
    instance = ServiceInstance(
        "worker", "127.0.0.1", port, tags=("role=worker",), meta={"role": "worker"},
        check_interval="1s", check_timeout="1s",
    )  # fmt: skip
    registration = ConsulRegistration(agent.address, instance, resync_seconds=0.5)
    client = consul_client(agent.address, request_timeout=30)
    source = ConsulSource(
        client, ["worker"], passing_only=False, wait_seconds=5, backoff=lambda: Backoff(0.1, 1.0)
    )
    snapshots: asyncio.Queue[Snapshot] = asyncio.Queue()

    async def watch() -> None:
        async for snapshot in source.snapshots():
            snapshots.put_nowait(snapshot)

    watching = asyncio.create_task(watch())
    me = Endpoint("127.0.0.1", port)
    try:
        registration.start()
        # Consul's gRPC check reaches our grpc.health.v1 and passes: healthy in the source.
        await next_matching(snapshots, lambda s: s.get("worker") == (me,))
        registered = agent.agent_services()[instance.service_id]
        assert registered["Port"] == port and registered["Tags"] == ["role=worker"]

        await health.set("", NOT_SERVING)  # the check turns critical
        unhealthy = Endpoint("127.0.0.1", port, healthy=False)
        await next_matching(snapshots, lambda s: s.get("worker") == (unhealthy,))
        await health.set("", SERVING)
        await next_matching(snapshots, lambda s: s.get("worker") == (me,))

        # A -dev agent forgets everything on restart; the registration puts itself back.
        agent.stop()
        agent.start()
        await next_matching(snapshots, lambda s: s.get("worker") == (me,))
        assert instance.service_id in agent.agent_services()

        await registration.stop()  # deregisters
        await next_matching(snapshots, lambda s: s.get("worker") == ())
        assert instance.service_id not in agent.agent_services()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await registration.stop()
        await client.close()
