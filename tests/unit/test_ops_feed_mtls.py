"""The ops feed's worker probe against a gRPC port that speaks only mTLS (the services' own
credentials, real certificates from `make certs`' code): with the control plane's client
certificate it reads the worker's health and engine stats; plaintext, no client certificate,
another CA or a certificate that does not name the worker are refused; renewed client files
take effect without a restart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.test_ops_feed import PROMPTLY, StatsServicer
from tests.unit.test_reloading_credentials import MountedSecret, client_files, issue
from tokenmesh.common.credentials import ReloadingChannelCredentials
from tokenmesh.common.server import Health, bind, build_server
from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.controlplane.ops import GrpcWorkerProbe, WorkerFigures
from tokenmesh.localmesh.certs import CertPaths
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.v1 import inference_pb2_grpc

MAX_MESSAGE_BYTES = 1 << 20
# What the probe reads from StatsServicer on a SERVING worker.
LIVE = dict(serving=True, running_requests=4, waiting_requests=2, kv_cache_usage=0.5)


@dataclass
class MtlsWorker:
    address: str
    certs: CertPaths
    other: CertPaths


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[MtlsWorker]:
    """A worker's health and GetEngineStats on a port bound with the services' mTLS
    credentials and the worker's certificate; and an unrelated set of certificates."""
    certs, other = issue(tmp_path / "certs"), issue(tmp_path / "other")
    # Any service's settings bind alike; the worker's own certificate is what matters.
    settings = RerankerSettings(
        host="127.0.0.1",
        port=0,
        tls_cert_file=certs.cert("worker"),
        tls_key_file=certs.key("worker"),
        tls_client_ca_file=certs.ca_cert,
    )
    server = build_server(settings, [])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(StatsServicer(), server)
    health = Health(["tokenmesh.v1.InferenceService"])
    health.register(server)
    port = bind(server, settings)
    await server.start()
    await health.set_serving()
    try:
        yield MtlsWorker(f"127.0.0.1:{port}", certs, other)
    finally:
        await server.stop(0)


def client_tls(certs: CertPaths, client: bool = True) -> ReloadingChannelCredentials:
    """The CA of certs and, with client, the client certificate made with it."""
    if not client:
        return ReloadingChannelCredentials(certs.ca_cert)
    return ReloadingChannelCredentials(
        certs.ca_cert, certs.cert("envoy-client"), certs.key("envoy-client")
    )


async def probed(probe: GrpcWorkerProbe, address: str) -> WorkerFigures:
    """One snapshot's worth of probing: retain (which reloads renewed files), then probe."""
    try:
        await probe.retain([address])
        return await probe.probe(address)
    finally:
        await probe.close()


async def test_the_probe_reads_an_mtls_worker_with_a_client_certificate(
    worker: MtlsWorker,
) -> None:
    probe = GrpcWorkerProbe(PROMPTLY, MAX_MESSAGE_BYTES, client_tls(worker.certs), "worker")
    assert await probed(probe, worker.address) == WorkerFigures(worker.address, **LIVE)


@pytest.mark.parametrize(
    "client",
    ["plaintext", "no client certificate", "another CA", "another name"],
)
async def test_the_mtls_worker_refuses_a_probe_it_cannot_trust(
    worker: MtlsWorker, client: str
) -> None:
    """Each is refused, and shows as an error rather than figures."""
    probe = {
        "plaintext": GrpcWorkerProbe(PROMPTLY, MAX_MESSAGE_BYTES),
        "no client certificate": GrpcWorkerProbe(
            PROMPTLY, MAX_MESSAGE_BYTES, client_tls(worker.certs, client=False), "worker"
        ),
        "another CA": GrpcWorkerProbe(
            PROMPTLY, MAX_MESSAGE_BYTES, client_tls(worker.other), "worker"
        ),
        # The worker's certificate names `worker`, not the reranker.
        "another name": GrpcWorkerProbe(
            PROMPTLY, MAX_MESSAGE_BYTES, client_tls(worker.certs), "reranker"
        ),
    }[client]
    figures = await probed(probe, worker.address)
    assert not figures.serving
    assert figures.error.startswith("UNAVAILABLE"), figures.error


async def test_renewed_client_files_reach_the_probe_without_a_restart(
    worker: MtlsWorker, tmp_path: Path
) -> None:
    """Files mounted as a Secret, first from another CA (refused), then renewed in place."""
    secret = MountedSecret(tmp_path / "client")
    secret.publish(client_files(worker.other))
    tls = ReloadingChannelCredentials(
        secret.path("ca.crt"), secret.path("tls.crt"), secret.path("tls.key")
    )
    probe = GrpcWorkerProbe(PROMPTLY, MAX_MESSAGE_BYTES, tls, "worker")
    try:
        await probe.retain([worker.address])
        assert (await probe.probe(worker.address)).error.startswith("UNAVAILABLE")
        secret.publish(client_files(worker.certs))
        await probe.retain([worker.address])
        assert await probe.probe(worker.address) == WorkerFigures(worker.address, **LIVE)
    finally:
        await probe.close()


def test_settings_take_the_client_files_together() -> None:
    base = {"source": "dns", "dns_targets": {"worker": "w:1"}}
    ControlPlaneSettings(**base, worker_tls_ca_file=Path("ca.crt"))
    with pytest.raises(ValueError, match="go together"):
        ControlPlaneSettings(**base, worker_tls_ca_file=Path("ca"), worker_tls_cert_file=Path("c"))
    with pytest.raises(ValueError, match="needs worker_tls_ca_file"):
        ControlPlaneSettings(**base, worker_tls_cert_file=Path("c"), worker_tls_key_file=Path("k"))
