"""What the local mesh, its tests and benchmarks ask of running services: ports, health, metrics,
Envoy's view of its hosts."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.v1 import inference_pb2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def health(
    address: str, credentials: grpc.ChannelCredentials | None = None, timeout: float = 2.0
) -> str:
    """The overall grpc.health.v1 status at address (over TLS with credentials), or the error
    code name."""
    with (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    ) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def serving(address: str, credentials: grpc.ChannelCredentials | None = None) -> bool:
    return health(address, credentials) == "SERVING"


def fetch_text(url: str, timeout: float = 10.0, default: str | None = None) -> str:
    """The page at url; `default` when it does not answer (None: the error is raised)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return str(reply.read().decode())
    except OSError:
        if default is None:
            raise
        return default


def series_values(metrics: str, name: str, **labels: str) -> list[float]:
    """The values of every series name{labels...} in a Prometheus text page (labels may be a
    subset of a series' labels)."""
    values = []
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(
            f'{key}="{val}"' in series for key, val in labels.items()
        ):
            values.append(float(value))
    return values


async def engine_empty_at(
    inference: Any, after_ns: int = 0, within: float = 10.0, call_timeout: float = 30.0
) -> int:
    """When a worker's vLLM scheduler first reported nothing running or waiting (ns since the
    epoch), in a report made after after_ns, polling the worker's GetEngineStats (`inference`:
    its InferenceService stub). vLLM reports at every engine step, so an idle engine's last
    report is the one that emptied it. TimeoutError, with what it reported, if it did not
    within `within` seconds."""
    deadline = time.monotonic() + within
    reports = []
    while time.monotonic() < deadline:
        report = await inference.GetEngineStats(
            inference_pb2.EngineStatsRequest(), timeout=call_timeout
        )
        if report.reported_unix_nanos >= after_ns and not (
            report.running_requests or report.waiting_requests
        ):
            return int(report.reported_unix_nanos)
        reports.append(
            (
                report.running_requests,
                report.waiting_requests,
                (report.reported_unix_nanos - after_ns) / 1e9,
            )
        )
        await asyncio.sleep(0.002)
    raise TimeoutError(
        f"engine not empty {within}s after; (running, waiting, report age) first/last: "
        f"{reports[:3]} ... {reports[-3:]}"
    )


def http_ok(url: str) -> bool:
    """url answers 200 (Prometheus' /-/ready does once its storage is open)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def envoy_host_statuses(admin_port: int) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(cluster, address, host status from /clusters?format=json) of every host the Envoy whose
    admin listens on admin_port knows at a network address (not the stream relay's internal
    listener); nothing when Envoy does not answer."""
    url = f"http://127.0.0.1:{admin_port}/clusters?format=json"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            statuses = json.load(reply).get("cluster_statuses", [])
    except (urllib.error.URLError, OSError, ValueError):
        return
    for cluster in statuses:
        for host in cluster.get("host_statuses", []):
            address = host["address"].get("socket_address")
            if address is None:
                continue
            yield cluster["name"], f"{address['address']}:{address['port_value']}", host


def envoy_hosts(admin_port: int) -> dict[str, list[tuple[str, bool]]]:
    """The view of the Envoy whose admin listens on admin_port: (address, healthy) of each
    host, by cluster; empty when Envoy does not answer."""
    hosts: dict[str, list[tuple[str, bool]]] = {}
    for cluster, address, host in envoy_host_statuses(admin_port):
        flags = host.get("health_status", {})
        # Any true flag (failed_active_health_check, pending_active_hc, ...) keeps
        # Envoy from routing to the host.
        healthy = flags.get("eds_health_status") == "HEALTHY" and not any(
            value is True for value in flags.values()
        )
        hosts.setdefault(cluster, []).append((address, healthy))
    return hosts
