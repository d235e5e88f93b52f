"""TLS on a real mesh (1 gateway, 1 worker, the reranker, Envoy) started with `tls` and `mtls`:
the edge speaks only TLS (grpcurl and Python with the local CA stream tokens, plaintext and a
wrong CA are refused, REST over https/1.1), the services speak only mTLS (a direct call
without Envoy's client certificate is refused, while Envoy's health checks over TLS pass), and
the gateways reach Envoy's internal listeners over TLS."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.request
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from grpc import aio

from tests.support import grpcurl, grpcurl_messages, positions, running_mesh
from tokenmesh.localmesh.certs import ENVOY_CLIENT, CertMaker, CertPaths, CertSettings
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.localmesh.probes import health
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

# The mesh's start (vLLM loading) counts against the first test's timeout: on a busy 2-core
# machine it alone has taken over 3 minutes.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BODY = '{"prompt":"hello","max_tokens":16,"ignore_eos":true}'
GENERATE = "tokenmesh.v1.LLMService/Generate"
# Seconds a direct health check may take (TLS handshakes on a busy machine).
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    settings = LocalMeshSettings.on_free_ports(
        tmp_path_factory.mktemp("tls"), gateways=1, workers=1, tls=True, mtls=True
    )
    with running_mesh(settings) as local_mesh:
        yield local_mesh


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A CA (PEM) that signed none of the mesh's certificates."""
    paths = CertPaths(tmp_path_factory.mktemp("other-ca"))
    CertMaker(CertSettings(dir=paths.dir), paths).make()
    return paths.ca_cert.read_bytes()


def edge(local_mesh: LocalMesh) -> str:
    return f"127.0.0.1:{local_mesh.settings.edge_port}"


def test_grpcurl_with_the_ca_lists_and_streams_tokens_from_the_edge(tls_mesh: LocalMesh) -> None:
    ca = str(tls_mesh.certs.ca_cert)
    listed = grpcurl("-cacert", ca, edge(tls_mesh), "list", plaintext=False)
    assert "tokenmesh.v1.LLMService" in listed.stdout.split(), listed.stderr
    streamed = grpcurl("-cacert", ca, "-d", BODY, edge(tls_mesh), GENERATE, plaintext=False)
    assert streamed.returncode == 0, streamed.stderr
    # Every one of the 16 tokens, however the worker grouped them into messages.
    assert positions(grpcurl_messages(streamed.stdout)) == list(range(16)), streamed.stdout


def test_a_plaintext_client_is_refused_at_the_tls_edge(tls_mesh: LocalMesh) -> None:
    refused = grpcurl("-d", BODY, edge(tls_mesh), GENERATE)
    assert refused.returncode != 0
    assert "tokenId" not in refused.stdout
    print(refused.stderr)


def test_grpcurl_without_the_ca_does_not_trust_the_edge(tls_mesh: LocalMesh) -> None:
    refused = grpcurl("-d", BODY, edge(tls_mesh), GENERATE, plaintext=False)
    assert refused.returncode != 0
    assert "certificate" in refused.stderr, refused.stderr


async def test_python_with_the_ca_streams_and_with_another_ca_is_unavailable(
    tls_mesh: LocalMesh, other_ca: bytes
) -> None:
    request = llm_pb2.GenerateRequest(prompt="hello", max_tokens=8, ignore_eos=True)
    trusted = grpc.ssl_channel_credentials(tls_mesh.certs.ca_cert.read_bytes())
    async with aio.secure_channel(edge(tls_mesh), trusted) as channel:
        tokens = [t async for t in llm_pb2_grpc.LLMServiceStub(channel).Generate(request)]
    assert positions(tokens) == list(range(8))
    untrusted = grpc.ssl_channel_credentials(other_ca)
    for credentials in (untrusted, None):
        channel = (
            aio.insecure_channel(edge(tls_mesh))
            if credentials is None
            else aio.secure_channel(edge(tls_mesh), credentials)
        )
        async with channel:
            call = llm_pb2_grpc.LLMServiceStub(channel).Generate(request, timeout=10)
            with pytest.raises(aio.AioRpcError) as refused:
                _ = [t async for t in call]
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


def test_the_edge_offers_h2_and_http11_and_rest_works_over_https(tls_mesh: LocalMesh) -> None:
    context = ssl.create_default_context(cafile=str(tls_mesh.certs.ca_cert))
    for offered, chosen in ((["h2", "http/1.1"], "h2"), (["http/1.1"], "http/1.1")):
        context.set_alpn_protocols(offered)
        port = tls_mesh.settings.edge_port
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            assert tls.selected_alpn_protocol() == chosen
    context = ssl.create_default_context(cafile=str(tls_mesh.certs.ca_cert))
    connection = http.client.HTTPSConnection(
        "127.0.0.1", tls_mesh.settings.edge_port, timeout=60, context=context
    )
    body = json.dumps({"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    connection.request("POST", "/" + GENERATE, body, {"content-type": "application/json"})
    reply = connection.getresponse()
    lines = [line for line in reply.read().decode().splitlines() if line.strip()]
    connection.close()
    assert reply.status == 200, lines
    # Tokens the engine made while a message was being written share the next message.
    tokens = [json.loads(line).get("token_ids", []) for line in lines]
    assert sum(len(ids) for ids in tokens) == 4, lines


def test_services_refuse_callers_without_envoys_client_certificate(tls_mesh: LocalMesh) -> None:
    ca = tls_mesh.certs.ca_cert.read_bytes()
    services = [program for program in tls_mesh.programs if program.mtls]
    assert {program.service for program in services} == {"gateway", "worker", "reranker"}
    for program in services:
        # Plaintext, and TLS that trusts the CA but presents no certificate: refused.
        without_certificate = grpc.ssl_channel_credentials(ca)
        assert health(program.address, None, TIMEOUT) == "UNAVAILABLE"
        assert health(program.address, without_certificate, TIMEOUT) == "UNAVAILABLE"
        assert health(program.address, tls_mesh.client_credentials(), TIMEOUT) == "SERVING"


def test_envoys_health_checks_pass_over_mtls(tls_mesh: LocalMesh) -> None:
    assert tls_mesh.envoy_ready(), tls_mesh.envoy_hosts()
    url = f"http://127.0.0.1:{tls_mesh.settings.envoy_admin_port}/stats?filter=ssl.handshake$"
    with urllib.request.urlopen(url, timeout=10) as reply:
        stats = dict(line.split(": ") for line in reply.read().decode().splitlines())
    # Every service cluster's connections (health checks and streams) are TLS handshakes.
    for cluster in ("gateway", "worker", "reranker"):
        assert int(stats[f"cluster.{cluster}.ssl.handshake"]) > 0, stats


def test_envoys_internal_listeners_speak_tls_to_the_gateways(tls_mesh: LocalMesh) -> None:
    """The gateways' hop to workers goes through Envoy's internal listener over TLS (the
    streams above passed through it); a plaintext caller there is refused."""
    listener = f"127.0.0.1:{tls_mesh.settings.worker_listener_port}"
    trusted = grpc.ssl_channel_credentials(tls_mesh.certs.ca_cert.read_bytes())
    # Health through the listener reaches a worker (over Envoy's mTLS to it).
    assert health(listener, trusted, TIMEOUT) == "SERVING"
    assert health(listener, None, TIMEOUT) == "UNAVAILABLE"
    gateway = next(p for p in tls_mesh.programs if p.service == "gateway")
    assert gateway.env["TOKENMESH_GATEWAY_DEPENDENCY_TLS_CA_FILE"] == str(tls_mesh.certs.ca_cert)


def test_openai_chat_streams_through_the_tls_edge_over_mtls_to_the_gateway(
    tls_mesh: LocalMesh,
) -> None:
    """The OpenAI SDK trusting the mesh's CA streams a chat through the TLS edge; Envoy reaches
    the gateway's HTTP port over mTLS, which refuses plaintext and clients without Envoy's
    certificate, as the gRPC port does."""
    ca = str(tls_mesh.certs.ca_cert)
    edge_url = f"https://127.0.0.1:{tls_mesh.settings.edge_port}/v1"
    with (
        httpx.Client(verify=ssl.create_default_context(cafile=ca)) as client,
        openai.OpenAI(
            base_url=edge_url, api_key="unused", http_client=client, max_retries=0
        ) as sdk,
    ):
        model = sdk.models.list().data[0].id
        chunks = list(
            sdk.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert reasons[-1] == "length"
    url = (
        f"http://127.0.0.1:{tls_mesh.settings.envoy_admin_port}/stats?filter=openai.ssl.handshake$"
    )
    with urllib.request.urlopen(url, timeout=10) as reply:
        stats = dict(line.split(": ") for line in reply.read().decode().splitlines())
    assert int(stats["cluster.openai.ssl.handshake"]) > 0, stats
    (gateway,) = [p for p in tls_mesh.programs if p.openai_port is not None]
    without_certificate = ssl.create_default_context(cafile=ca)
    with_certificate = ssl.create_default_context(cafile=ca)
    with_certificate.load_cert_chain(
        tls_mesh.certs.cert(ENVOY_CLIENT), tls_mesh.certs.key(ENVOY_CLIENT)
    )
    for context in (None, without_certificate):
        with pytest.raises((OSError, http.client.HTTPException)):
            openai_health(gateway.openai_port, context)
    assert openai_health(gateway.openai_port, with_certificate) == 200


def openai_health(port: int | None, context: ssl.SSLContext | None) -> int:
    """GET /health on a gateway's OpenAI port, plaintext or with context."""
    assert port is not None
    connection = (
        http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        if context is None
        else http.client.HTTPSConnection("127.0.0.1", port, timeout=TIMEOUT, context=context)
    )
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()
