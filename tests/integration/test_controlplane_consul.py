"""The control plane process in Consul mode, against the fake agent (tests/consul_fake.py):
it registers itself, serves what Consul reports over xDS with health, pushes changes, keeps
the last known endpoints through Consul errors, and deregisters on SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc import aio

from tests.consul_fake import FakeConsul, Instance
from tests.support import ROOT, ServiceProcess, controlplane_process
from tests.xds_client import XdsClient, decode

pytestmark = pytest.mark.integration

LOG_DIR = ROOT / ".run" / "test-logs"
START_TIMEOUT = 60.0
# Blocking queries return on a change, so a change is pushed well within a second; generous.
PUSHED_WITHIN = 5.0


@pytest.fixture
def controlplane(fake_consul: FakeConsul, tmp_path: Path) -> Iterator[ServiceProcess]:
    process = controlplane_process(
        LOG_DIR,
        tmp_path / "unused.json",
        name="controlplane-consul-test",
        source="consul",
        consul_http_addr=fake_consul.address,
        consul_services='["worker", "reranker"]',
        consul_wait_seconds="5",
        consul_backoff_initial_seconds="0.05",
        consul_backoff_max_seconds="0.5",
    )
    try:
        yield process
    finally:
        process.stop(timeout=10)


async def test_serves_consul_endpoints_pushes_changes_and_registers_itself(
    fake_consul: FakeConsul, controlplane: ServiceProcess
) -> None:
    fake_consul.put_instance(Instance("worker-1", "worker", "127.0.0.1", 50061))
    fake_consul.put_instance(
        Instance("worker-2", "worker", "127.0.0.1", 50062, check_status="critical")
    )
    controlplane.start()
    await asyncio.to_thread(controlplane.wait_serving, START_TIMEOUT)
    async with aio.insecure_channel(controlplane.address) as channel:
        client = XdsClient(channel)
        await client.send(["worker", "reranker"])
        assert decode(await client.receive()) == {
            "reranker": [],
            "worker": [("127.0.0.1", 50061, "HEALTHY"), ("127.0.0.1", 50062, "UNHEALTHY")],
        }
        await client.ack(["worker", "reranker"])

        fake_consul.set_status("worker-2", "passing")
        pushed = decode(await client.receive(within=PUSHED_WITHIN))
        assert pushed["worker"][1] == ("127.0.0.1", 50062, "HEALTHY")
        await client.ack(["worker", "reranker"])

        fake_consul.fail_next(3)  # Consul errors: nothing pushed, the endpoints stay as they are
        fake_consul.bump()
        await client.nothing_within(1.0)
        fake_consul.remove("worker-1")  # and once Consul answers again, changes flow again
        pushed = decode(await client.receive(within=PUSHED_WITHIN))
        assert pushed["worker"] == [("127.0.0.1", 50062, "HEALTHY")]
        await client.close()

    registered = [i for i in fake_consul.instances.values() if i.name == "controlplane"]
    assert [(i.port, i.tags) for i in registered] == [(controlplane.port, ["role=controlplane"])]
    # In a thread: the fake agent answering the deregistration runs on this event loop.
    assert await asyncio.to_thread(controlplane.stop, 10) == 0
    assert not [i for i in fake_consul.instances.values() if i.name == "controlplane"]
