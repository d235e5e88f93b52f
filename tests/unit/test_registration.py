"""Self-registration in Consul: the documented register payload with a native gRPC check,
settings (CONSUL_HTTP_ADDR fallback, advertised address), and the lifecycle against a fake
agent: register in the background, survive a Consul restart, deregister on stop."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from tests.consul_fake import FakeConsul
from tests.support import eventually, free_port
from tokenmesh.common.registration import ConsulRegistration, instance_for
from tokenmesh.common.settings import ServiceSettings
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.worker.config import WorkerSettings

PROMPTLY = 5.0
RESYNC = 0.05


def worker_settings(**values: Any) -> WorkerSettings:
    return WorkerSettings(consul_http_addr="127.0.0.1:8500", **values)


def test_payload_is_consuls_documented_register_body_with_a_grpc_check() -> None:
    settings = worker_settings(host="10.0.0.5")
    registration = ConsulRegistration(
        settings.consul_http_addr,
        instance_for(settings, "worker", 50061, 9461, extra={"model": "tiny-llama"}),
    )
    assert registration.payload() == {
        "Name": "worker",
        "ID": "worker-10.0.0.5-50061",
        "Address": "10.0.0.5",
        "Port": 50061,
        "Tags": ["role=worker", "model=tiny-llama"],
        "Meta": {"role": "worker", "model": "tiny-llama", "metrics_port": "9461"},
        "Check": {
            "Name": "worker gRPC health",
            "GRPC": "10.0.0.5:50061",
            "GRPCUseTLS": False,
            "Interval": "5s",
            "Timeout": "2s",
            "DeregisterCriticalServiceAfter": "1m",
        },
    }


def test_a_wildcard_host_registers_this_machines_address() -> None:
    instance = instance_for(worker_settings(host="0.0.0.0"), "worker", 1)
    assert instance.address == socket.gethostbyname(socket.gethostname())
    assert instance.address != "0.0.0.0"
    explicit = instance_for(worker_settings(host="0.0.0.0", advertise_host="10.1.2.3"), "w", 1)
    assert explicit.address == "10.1.2.3" and explicit.service_id == "w-10.1.2.3-1"


def test_consul_address_comes_from_the_prefixed_setting_or_consul_http_addr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CONSUL_HTTP_ADDR", raising=False)
    assert GatewaySettings().consul_http_addr is None
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "10.0.0.1:8500")
    assert GatewaySettings().consul_http_addr == "10.0.0.1:8500"
    monkeypatch.setenv("TOKENMESH_GATEWAY_CONSUL_HTTP_ADDR", "http://10.0.0.2:8500")
    assert GatewaySettings().consul_http_addr == "http://10.0.0.2:8500"


def test_a_malformed_consul_address_fails_at_start_up() -> None:
    with pytest.raises(ValueError, match="consul address"):
        settings = ServiceSettings(consul_http_addr="unix:///consul.sock")
        ConsulRegistration(settings.consul_http_addr, instance_for(settings, "gateway", 1))


async def test_without_consul_registration_does_nothing() -> None:
    settings = ServiceSettings(consul_http_addr=None)
    registration = ConsulRegistration(None, instance_for(settings, "gateway", 50050))
    assert not registration.enabled
    registration.start()  # would fail to build a client from a None address if it tried
    await registration.stop()
    assert not registration.registered.is_set()


def registration_with(address: str, port: int = 50050) -> ConsulRegistration:
    settings = ServiceSettings(consul_http_addr=address, host="127.0.0.1")
    return ConsulRegistration(
        address, instance_for(settings, "gateway", port, 9450), resync_seconds=RESYNC
    )


async def test_registers_on_start_and_deregisters_on_stop(
    fake_consul: FakeConsul, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "s3cret")  # py-consul's standard ACL token variable
    registration = registration_with(fake_consul.address)
    registration.start()
    await asyncio.wait_for(registration.registered.wait(), PROMPTLY)
    [register] = fake_consul.requests_to("/v1/agent/service/register")
    assert register.method == "PUT" and register.body == registration.payload()
    assert register.headers.get("X-Consul-Token") == "s3cret"
    assert (
        fake_consul.instances["gateway-127.0.0.1-50050"].check_status == "critical"
    )  # until checked

    await registration.stop()
    [deregister] = fake_consul.requests_to("/v1/agent/service/deregister/")
    assert deregister.method == "PUT"
    assert deregister.path == "/v1/agent/service/deregister/gateway-127.0.0.1-50050"
    assert fake_consul.instances == {}
    assert not registration.registered.is_set()


async def test_stays_registered_and_registers_again_after_consul_restarts(
    fake_consul: FakeConsul,
) -> None:
    registration = registration_with(fake_consul.address)
    registration.start()
    try:
        await asyncio.wait_for(registration.registered.wait(), PROMPTLY)
        await eventually(lambda: len(fake_consul.requests_to("/v1/agent/services")) >= 3)
        assert len(fake_consul.registrations) == 1  # verified, not re-sent, while it is there
        await fake_consul.restart(downtime=0.2)  # a -dev agent forgets every registration
        await eventually(lambda: "gateway-127.0.0.1-50050" in fake_consul.instances)
        assert len(fake_consul.registrations) == 2
        assert fake_consul.registrations[1] == registration.payload()
    finally:
        await registration.stop()


async def test_start_never_waits_for_consul_and_registers_once_it_answers() -> None:
    port = free_port()
    registration = registration_with(f"127.0.0.1:{port}")
    started = time.monotonic()
    registration.start()  # nothing listens on port yet
    assert time.monotonic() - started < 0.5  # bounded: it did not try synchronously
    fake_consul = FakeConsul()
    try:
        await asyncio.sleep(0.2)  # a few failed attempts
        assert not registration.registered.is_set()
        fake_consul.fail_next(2)  # and then an agent without a leader yet
        await fake_consul.start(port)
        await asyncio.wait_for(registration.registered.wait(), PROMPTLY)
        assert "gateway-127.0.0.1-50050" in fake_consul.instances
        statuses = [r.status for r in fake_consul.requests_to("/v1/agent/service/register")]
        assert statuses == [500, 500, 200]  # retried after errors, not given up
    finally:
        await registration.stop()
        await fake_consul.stop()


async def test_stop_does_not_hang_when_consul_is_gone(fake_consul: FakeConsul) -> None:
    registration = registration_with(fake_consul.address)
    registration.start()
    await asyncio.wait_for(registration.registered.wait(), PROMPTLY)
    await fake_consul.stop()
    # Bounded by the request timeout (3 s); a generous "does not hang" limit.
    await asyncio.wait_for(registration.stop(), 10)
