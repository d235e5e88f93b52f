"""The control plane process feeding a real Envoy over ADS: endpoints from the static file
reach Envoy's /clusters with their discovery-side health, Envoy's own gRPC health checks run
on them, file edits are followed within seconds, and Envoy keeps its endpoints while the
control plane is down, then resyncs when it returns. Also: NOT_SERVING until the first
snapshot, and the time from start to the first snapshot served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from tests.support import (
    ROOT,
    ServiceProcess,
    controlplane_process,
    free_port,
    health_status,
    metric_value,
    scrape_metrics,
)
from tests.xds_client import XdsClient, decode
from tokenmesh.common.processes import stop_process

pytestmark = pytest.mark.integration

LOG_DIR = ROOT / ".run" / "test-logs"
ENVOY = Path(sys.executable).parent / "envoy"
# The control plane re-reads the file every 0.25 s and pushes at once, so Envoy follows an edit
# in well under a second; the bound is generous for a noisy 2-core machine.
FOLLOWS_WITHIN = 3.0
# "Does not hang" bounds for process start-up and reconnection.
START_TIMEOUT = 60.0
RECONNECT_TIMEOUT = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING


class Upstream:
    """A tiny real gRPC server with grpc.health.v1, standing in for a worker replica."""

    def __init__(self) -> None:
        self.server = aio.server()
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.health.set("", SERVING)
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)


@pytest.fixture
async def upstreams() -> AsyncIterator[list[Upstream]]:
    servers = [Upstream(), Upstream()]
    for server in servers:
        await server.start()
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop()


def write_endpoints(path: Path, worker: list[Any]) -> None:
    """Replace the file atomically, as an operator's editor or a ConfigMap update does."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"clusters": {"worker": worker}}))
    os.replace(temporary, path)


def bootstrap(admin_port: int, controlplane_port: int) -> dict[str, Any]:
    """A minimal Envoy: one EDS cluster `worker` over ADS (HTTP/2, gRPC health checks) and
    `xds_cluster` pointing at the control plane."""
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "node": {"id": "test-envoy", "cluster": "tokenmesh-test"},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds_cluster"}}],
            }
        },
        "static_resources": {
            "clusters": [
                {
                    "name": "worker",
                    "type": "EDS",
                    "connect_timeout": "1s",
                    "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
                    "typed_extension_protocol_options": http2,
                    # Discovery decides membership: by default Envoy keeps a host removed from
                    # EDS for as long as it still passes active health checks.
                    "ignore_health_on_host_removal": True,
                    "health_checks": [
                        {
                            "timeout": "1s",
                            "interval": "0.5s",
                            # Checked even with no traffic (the default would be 60 s).
                            "no_traffic_interval": "0.5s",
                            "unhealthy_threshold": 1,
                            "healthy_threshold": 1,
                            "grpc_health_check": {},
                        }
                    ],
                },
                {
                    "name": "xds_cluster",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": http2,
                    "load_assignment": {
                        "cluster_name": "xds_cluster",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": controlplane_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ]
        },
    }


@dataclass(frozen=True)
class Host:
    address: str
    eds_health: str  # what discovery said: HEALTHY / UNHEALTHY
    failed_active_check: bool  # what Envoy's own gRPC health check found


class Envoy:
    def __init__(self, workdir: Path, controlplane_port: int) -> None:
        self.admin_port = free_port()
        self.config = workdir / "envoy.json"
        self.config.write_text(json.dumps(bootstrap(self.admin_port, controlplane_port)))
        self.log_path = LOG_DIR / f"envoy-{self.admin_port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    str(ENVOY),
                    "-c", str(self.config),
                    # A base id of its own, so other Envoys on this machine do not collide.
                    "--base-id", str(self.admin_port),
                    "--concurrency", "1",
                    "--log-level", "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def admin(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return str(reply.read().decode())

    def hosts(self, cluster: str = "worker") -> dict[str, Host]:
        """The cluster's hosts as Envoy's admin /clusters?format=json reports them."""
        for status in json.loads(self.admin("/clusters?format=json"))["cluster_statuses"]:
            if status["name"] != cluster:
                continue
            hosts = {}
            for host in status.get("host_statuses", []):
                socket_address = host["address"]["socket_address"]
                address = f"{socket_address['address']}:{socket_address['port_value']}"
                health = host.get("health_status", {})
                hosts[address] = Host(
                    address,
                    health.get("eds_health_status", "HEALTHY"),
                    bool(health.get("failed_active_health_check", False)),
                )
            return hosts
        raise AssertionError(f"no cluster {cluster} in /clusters")

    def stat(self, name: str) -> int:
        for line in self.admin(f"/stats?filter=^{name}$").splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        raise AssertionError(f"no stat {name}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-30:])

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 10)


async def until(envoy: Envoy, condition: Any, within: float, what: str) -> float:
    """Poll condition(envoy) every 20 ms; the seconds it took, or fail naming what."""
    started = time.monotonic()
    last: Any = None
    while time.monotonic() - started < within:
        assert envoy.alive(), f"envoy exited:\n{envoy.log_tail()}"
        with contextlib.suppress(OSError):  # admin not up yet
            last = envoy.hosts()
            if condition(last):
                return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not within {within}s; last hosts: {last}\n{envoy.log_tail()}")


def source_errors(metrics_port: int) -> float:
    text = scrape_metrics(metrics_port)
    return metric_value(text, "tokenmesh_controlplane_source_errors_total", 0.0)


@pytest.fixture
def endpoints_file(tmp_path: Path) -> Path:
    return tmp_path / "endpoints.json"


@pytest.fixture
def controlplane(endpoints_file: Path) -> Iterator[ServiceProcess]:
    process = controlplane_process(LOG_DIR, endpoints_file, name="controlplane-envoy-test")
    try:
        yield process
    finally:
        process.stop(timeout=10)


@pytest.fixture
def envoy(tmp_path: Path, controlplane: ServiceProcess) -> Iterator[Envoy]:
    proxy = Envoy(tmp_path, controlplane.port)
    try:
        yield proxy
    finally:
        proxy.stop()


async def test_envoy_gets_endpoints_with_health_and_follows_file_edits(
    upstreams: list[Upstream],
    endpoints_file: Path,
    controlplane: ServiceProcess,
    envoy: Envoy,
) -> None:
    first, second = upstreams
    down = f"127.0.0.1:{free_port()}"  # nothing listens: Envoy's own check must fail it
    write_endpoints(endpoints_file, [first.address, down])
    controlplane.start()
    controlplane.wait_serving(START_TIMEOUT)
    envoy.start()

    await until(
        envoy,
        lambda hosts: set(hosts) == {first.address, down},
        START_TIMEOUT,
        "the first endpoints in Envoy",
    )
    # Envoy's active gRPC health checks run on what discovery gave it (HTTP/2 to real servers).
    await until(
        envoy,
        lambda hosts: (
            not hosts[first.address].failed_active_check and hosts[down].failed_active_check
        ),
        START_TIMEOUT,
        "active health checks passing for the live server and failing for the dead one",
    )

    write_endpoints(endpoints_file, [first.address, {"address": second.address}])
    latency = await until(
        envoy,
        lambda hosts: set(hosts) == {first.address, second.address},
        FOLLOWS_WITHIN,
        "the edited endpoints in Envoy",
    )
    print(f"\nstatic file edit -> Envoy /clusters: {latency * 1000:.0f} ms")

    write_endpoints(endpoints_file, [first.address, {"address": second.address, "healthy": False}])
    await until(
        envoy,
        lambda hosts: (
            hosts.get(second.address, Host("", "", False)).eds_health == "UNHEALTHY"
            and hosts[first.address].eds_health == "HEALTHY"
        ),
        FOLLOWS_WITHIN,
        "discovery-side health (UNHEALTHY) in Envoy",
    )

    write_endpoints(endpoints_file, "not json")  # type: ignore[arg-type]
    metrics = controlplane.metrics_port
    async with asyncio.timeout(FOLLOWS_WITHIN):
        while source_errors(metrics) < 1:  # noqa: ASYNC110 (polling another process)
            await asyncio.sleep(0.05)
    assert set(envoy.hosts()) == {first.address, second.address}  # the last good set stays
    text = scrape_metrics(metrics)
    assert metric_value(text, "tokenmesh_xds_connected_streams") == 1
    assert metric_value(text, "tokenmesh_xds_nacks_total") == 0  # Envoy accepted everything
    assert metric_value(text, "tokenmesh_xds_acks_total") >= 3


async def test_envoy_keeps_endpoints_while_the_control_plane_is_down_and_resyncs(
    upstreams: list[Upstream],
    endpoints_file: Path,
    controlplane: ServiceProcess,
    envoy: Envoy,
) -> None:
    first, second = upstreams
    write_endpoints(endpoints_file, [first.address, second.address])
    controlplane.start()
    controlplane.wait_serving(START_TIMEOUT)
    envoy.start()
    both = {first.address, second.address}
    await until(envoy, lambda hosts: set(hosts) == both, START_TIMEOUT, "the endpoints")
    assert envoy.stat("control_plane.connected_state") == 1

    assert controlplane.stop(timeout=10) == 0  # SIGTERM: a clean exit that closes the stream
    async with asyncio.timeout(RECONNECT_TIMEOUT):
        while envoy.stat("control_plane.connected_state") != 0:  # noqa: ASYNC110 (polling)
            await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # several of Envoy's reconnect attempts fail meanwhile
    hosts = envoy.hosts()
    assert set(hosts) == both, hosts
    assert not any(host.failed_active_check for host in hosts.values())

    # Back with a different file: Envoy reconnects, re-subscribes and follows.
    write_endpoints(endpoints_file, [second.address])
    controlplane.start()
    controlplane.wait_serving(START_TIMEOUT)
    await until(
        envoy,
        lambda hosts: set(hosts) == {second.address},
        RECONNECT_TIMEOUT,
        "the new endpoints after the control plane restarted",
    )
    assert envoy.stat("control_plane.connected_state") == 1


async def test_not_serving_until_the_first_snapshot_then_serves_it(
    endpoints_file: Path, controlplane: ServiceProcess
) -> None:
    controlplane.start()  # the file does not exist yet
    async with asyncio.timeout(START_TIMEOUT):
        while health_status(controlplane.address) != "NOT_SERVING":  # noqa: ASYNC110 (polling)
            await asyncio.sleep(0.05)
    assert controlplane.process is not None and controlplane.process.poll() is None
    async with aio.insecure_channel(controlplane.address) as channel:
        client = XdsClient(channel)
        await client.send(["worker"])
        await client.nothing_within(0.5)  # nothing to serve yet: Envoy keeps waiting
        write_endpoints(endpoints_file, ["127.0.0.1:50061"])
        response = await client.receive(within=FOLLOWS_WITHIN)
        assert decode(response) == {"worker": [("127.0.0.1", 50061, "HEALTHY")]}
        await client.close()
    assert health_status(controlplane.address) == "SERVING"


async def test_time_from_start_to_first_snapshot_served(
    endpoints_file: Path, controlplane: ServiceProcess
) -> None:
    """Measured, not asserted beyond a does-not-hang bound: printed for the record."""
    write_endpoints(endpoints_file, ["127.0.0.1:50061"])
    started = time.monotonic()
    controlplane.start()
    response = None
    async with asyncio.timeout(START_TIMEOUT):
        while response is None:
            async with aio.insecure_channel(controlplane.address) as channel:
                client = XdsClient(channel)
                with contextlib.suppress(Exception):
                    await client.send(["worker"])
                    response = await client.receive(within=0.5)
                await client.close()
    elapsed = time.monotonic() - started
    assert decode(response)["worker"] == [("127.0.0.1", 50061, "HEALTHY")]
    print(f"\ncontrol plane start -> first snapshot served: {elapsed * 1000:.0f} ms")
