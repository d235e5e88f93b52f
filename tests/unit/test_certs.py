"""`make certs`: the local CA signs every certificate, each carries the names its peers check,
a valid set is kept, and a service bound with its certificate speaks only mTLS."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.common.server import Health, ProbePort, bind, build_server
from tokenmesh.localmesh.certs import (
    EDGE,
    ENVOY_CLIENT,
    ENVOY_INTERNAL,
    SERVICE_KINDS,
    CertMaker,
    CertPaths,
    CertSettings,
    main,
)
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.config import WorkerSettings

# Generous: each call below may first connect (and handshake TLS), which a loaded machine can be
# slow to do; a refused handshake still fails at once.
RPC_TIMEOUT = 20.0


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        names.get_values_for_type(x509.DNSName),
        [str(ip) for ip in names.get_values_for_type(x509.IPAddress)],
    )


@pytest.fixture
def made(tmp_path: Path) -> CertMaker:
    settings = CertSettings(dir=tmp_path / "certs", edge_names=("llm.example", "10.1.2.3"))
    maker = CertMaker(settings, CertPaths(settings.dir))
    assert maker.ensure()
    return maker


def test_the_ca_signs_every_certificate_with_the_names_peers_check(made: CertMaker) -> None:
    paths = made.paths
    ca = load(paths.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in paths.leaf_names():
        cert = load(paths.cert(name))
        cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(
            days=29
        )
    dns, ips = sans(load(paths.cert(EDGE)))
    assert dns == ["localhost", "llm.example"] and ips == ["127.0.0.1", "10.1.2.3"]
    for kind in SERVICE_KINDS:
        dns, ips = sans(load(paths.cert(kind)))
        # The kind first (what Envoy checks), the Kubernetes Service names, then local names.
        assert dns[0] == kind
        assert f"tokenmesh-{kind}-headless.default.svc.cluster.local" in dns
        assert "localhost" in dns and ips == ["127.0.0.1"]
        usage = load(paths.cert(kind)).extensions.get_extension_for_class(x509.ExtendedKeyUsage)
        assert list(usage.value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    dns, ips = sans(load(paths.cert(ENVOY_INTERNAL)))
    assert dns[0] == "envoy" and "tokenmesh-envoy-internal.default.svc" in dns
    assert "localhost" in dns and ips == ["127.0.0.1"]
    client = load(paths.cert(ENVOY_CLIENT)).extensions.get_extension_for_class(
        x509.ExtendedKeyUsage
    )
    assert list(client.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_keys_match_their_certificates_and_only_the_owner_reads_them(made: CertMaker) -> None:
    for name in made.paths.leaf_names():
        key = load_pem_private_key(made.paths.key(name).read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.public_key() == load(made.paths.cert(name)).public_key()
        assert stat.S_IMODE(made.paths.key(name).stat().st_mode) == 0o600


def test_a_valid_set_is_kept_and_force_or_a_new_name_makes_a_new_one(made: CertMaker) -> None:
    before = made.paths.ca_cert.read_bytes()
    assert not made.ensure()
    assert made.paths.ca_cert.read_bytes() == before
    assert made.ensure(force=True)
    assert made.paths.ca_cert.read_bytes() != before
    renamed = CertMaker(
        made.settings.model_copy(update={"edge_names": ("other.example",)}), made.paths
    )
    assert not renamed.is_current()
    made.paths.key("worker").unlink()
    assert not made.is_current()


def test_a_certificate_about_to_expire_makes_a_new_set(tmp_path: Path) -> None:
    settings = CertSettings(dir=tmp_path, leaf_days=2)
    maker = CertMaker(settings, CertPaths(tmp_path))
    maker.make()
    assert maker.is_current()
    # One day of margin: a two-day certificate is kept, one that ends within a day is not.
    soon = CertMaker(settings.model_copy(update={"leaf_days": 1}), CertPaths(tmp_path))
    soon.make()
    assert not soon.is_current()


def test_the_command_line_keeps_a_valid_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--dir", str(tmp_path), "--edge-name", "api.example"]) == 0
    assert "made" in capsys.readouterr().out
    assert main(["--dir", str(tmp_path), "--edge-name", "api.example"]) == 0
    assert "kept" in capsys.readouterr().out
    assert "api.example" in sans(load(CertPaths(tmp_path).cert(EDGE)))[0]


def test_tls_settings_go_together(made: CertMaker) -> None:
    with pytest.raises(ValueError, match="go together"):
        WorkerSettings(tls_cert_file=made.paths.cert("worker"))


async def test_a_tls_service_refuses_callers_without_a_certificate_and_probes_stay_plaintext(
    made: CertMaker,
) -> None:
    paths = made.paths
    settings = WorkerSettings(
        port=0,
        tls_cert_file=paths.cert("worker"),
        tls_key_file=paths.key("worker"),
        tls_client_ca_file=paths.ca_cert,
        health_port=0,
    )
    server = build_server(settings, [])
    health = Health(["tokenmesh.v1.InferenceService"])
    health.register(server)
    address = f"127.0.0.1:{bind(server, settings)}"
    await server.start()
    probes = ProbePort(health, settings)
    probe_port = await probes.start()
    await health.set_serving()
    ca = paths.ca_cert.read_bytes()
    envoy = grpc.ssl_channel_credentials(
        ca, paths.key(ENVOY_CLIENT).read_bytes(), paths.cert(ENVOY_CLIENT).read_bytes()
    )
    request = health_pb2.HealthCheckRequest()
    try:
        async with aio.secure_channel(address, envoy) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for credentials in (None, grpc.ssl_channel_credentials(ca)):  # plaintext; no client cert
            channel = (
                aio.insecure_channel(address)
                if credentials is None
                else aio.secure_channel(address, credentials)
            )
            async with channel:
                with pytest.raises(aio.AioRpcError) as refused:
                    await health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The plaintext probe port (for Kubernetes' gRPC probes) tells the same status, and
        # serves nothing else.
        async with aio.insecure_channel(f"127.0.0.1:{probe_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await health.set_not_serving()
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(aio.AioRpcError) as unknown:
                await inference_pb2_grpc.InferenceServiceStub(channel).GetEngineStats(
                    inference_pb2.EngineStatsRequest(), timeout=RPC_TIMEOUT
                )
            assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await probes.stop()
        await server.stop(0)
