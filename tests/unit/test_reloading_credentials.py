"""Certificates renewed in place: a TLS server serves new connections with the files' new
certificate and CA without a restart, a dependency's channel reopens with new client files,
and files that do not make a pair yet are not taken."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.common.channels import Dependency
from tokenmesh.common.credentials import (
    ReloadingChannelCredentials,
    ReloadingServerCredentials,
    WatchedFiles,
)
from tokenmesh.common.server import Health, bind, build_server
from tokenmesh.localmesh.certs import ENVOY_CLIENT, CertMaker, CertPaths, CertSettings
from tokenmesh.worker.config import WorkerSettings

# Generous: a loaded machine can be slow to connect and handshake; a refused one fails at once.
RPC_TIMEOUT = 20.0
# Each test channel gets its own connections, never one another test channel made.
OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]
FILES = ("tls.crt", "tls.key", "ca.crt")


def issue(directory: Path) -> CertPaths:
    """A new CA with the worker's and Envoy's client certificates signed by it."""
    settings = CertSettings(dir=directory)
    maker = CertMaker(settings, CertPaths(settings.dir))
    maker.make()
    return maker.paths


class MountedSecret:
    """A directory laid out as kubelet mounts a Secret: each file is a symlink into `..data`,
    itself a symlink to a timestamped directory that an update replaces in one rename."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir()
        self._versions = 0

    def path(self, name: str) -> Path:
        return self.dir / name

    def publish(self, files: dict[str, bytes]) -> None:
        self._versions += 1
        version = self.dir / f"..version_{self._versions}"
        version.mkdir()
        for name, content in files.items():
            (version / name).write_bytes(content)
        link = self.dir / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.dir / "..data")  # atomic, like kubelet's swap
        if self._versions > 1:  # kubelet then removes the previous version
            shutil.rmtree(self.dir / f"..version_{self._versions - 1}")
        for name in files:
            if not (self.dir / name).is_symlink():
                (self.dir / name).symlink_to(Path("..data") / name)


def server_files(certs: CertPaths) -> dict[str, bytes]:
    return {
        "tls.crt": certs.cert("worker").read_bytes(),
        "tls.key": certs.key("worker").read_bytes(),
        "ca.crt": certs.ca_cert.read_bytes(),
    }


def client_files(certs: CertPaths) -> dict[str, bytes]:
    return {
        "tls.crt": certs.cert(ENVOY_CLIENT).read_bytes(),
        "tls.key": certs.key(ENVOY_CLIENT).read_bytes(),
        "ca.crt": certs.ca_cert.read_bytes(),
    }


def envoy_credentials(certs: CertPaths) -> grpc.ChannelCredentials:
    """What Envoy presents: the client certificate of `certs`, trusting only its CA."""
    return grpc.ssl_channel_credentials(
        certs.ca_cert.read_bytes(),
        certs.key(ENVOY_CLIENT).read_bytes(),
        certs.cert(ENVOY_CLIENT).read_bytes(),
    )


async def check(channel: Any) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT
    )
    return int(reply.status)


async def refused(credentials: grpc.ChannelCredentials, address: str) -> bool:
    async with aio.secure_channel(address, credentials, options=OWN_CONNECTIONS) as channel:
        try:
            await check(channel)
        except aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            return True
    return False


@dataclass
class Served:
    address: str
    secret: MountedSecret
    health: Health
    old: CertPaths
    new: CertPaths


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """A TLS server (the services' own bind()) on the old certificates, mounted as a Secret,
    and a second, unrelated set issued for the renewal."""
    old, new = issue(tmp_path / "old"), issue(tmp_path / "new")
    secret = MountedSecret(tmp_path / "secret")
    secret.publish(server_files(old))
    settings = WorkerSettings(
        host="127.0.0.1",
        port=0,
        tls_cert_file=secret.path("tls.crt"),
        tls_key_file=secret.path("tls.key"),
        tls_client_ca_file=secret.path("ca.crt"),
    )
    server = build_server(settings, [])
    health = Health([])
    health.register(server)
    address = f"127.0.0.1:{bind(server, settings)}"
    await server.start()
    await health.set_serving()
    try:
        yield Served(address, secret, health, old, new)
    finally:
        await server.stop(0)


async def test_a_renewed_certificate_serves_new_connections_without_a_restart(
    served: Served,
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    async with aio.secure_channel(
        served.address, envoy_credentials(served.old), options=OWN_CONNECTIONS
    ) as connected:
        assert await check(connected) == serving
        # A client of the new CA is refused while the old files are mounted.
        assert await refused(envoy_credentials(served.new), served.address)

        served.secret.publish(server_files(served.new))

        async with aio.secure_channel(
            served.address, envoy_credentials(served.new), options=OWN_CONNECTIONS
        ) as renewed:
            assert await check(renewed) == serving
        # New connections get the new certificate and need a client of the new CA...
        assert await refused(envoy_credentials(served.old), served.address)
        # ...while a connection made before the renewal keeps working.
        assert await check(connected) == serving


async def test_a_dependency_reopens_its_channel_with_renewed_client_files(
    served: Served, tmp_path: Path
) -> None:
    client = MountedSecret(tmp_path / "client")
    client.publish(client_files(served.old))
    tls = ReloadingChannelCredentials(
        client.path("ca.crt"), client.path("tls.crt"), client.path("tls.key")
    )
    worker = Dependency("worker", served.address, 1024 * 1024, tls=tls)
    try:
        stub = health_pb2_grpc.HealthStub(worker.channel)  # built once, as services do
        request = health_pb2.HealthCheckRequest()
        await stub.Check(request, timeout=RPC_TIMEOUT)
        first = worker.channel.current
        assert not worker.reload_tls()
        watch = stub.Watch(request)  # a stream in flight across the renewal
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

        # The server's files and then the client's are renewed (a new CA for both).
        served.secret.publish(server_files(served.new))
        client.publish(client_files(served.new))
        assert worker.reload_tls(grace=RPC_TIMEOUT)
        assert worker.channel.current is not first
        # The same stub now calls over a new connection, which only the new files can make.
        await stub.Check(request, timeout=RPC_TIMEOUT)
        assert worker.channel.current.get_state() is grpc.ChannelConnectivity.READY
        assert await refused(envoy_credentials(served.old), served.address)
        # The stream begun before goes on, on the old channel.
        await served.health.set_not_serving()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert worker.channel.retiring == 1
        # Once its calls end (here cancelled, as a handler's are at shutdown), it closes.
        watch.cancel()
    finally:
        await worker.close()
    assert worker.channel.retiring == 0


def test_files_that_do_not_make_a_pair_yet_are_not_taken(tmp_path: Path) -> None:
    old, new = issue(tmp_path / "old"), issue(tmp_path / "new")
    secret = MountedSecret(tmp_path / "secret")
    secret.publish(server_files(old))
    credentials = ReloadingServerCredentials(*(secret.path(name) for name in FILES))
    assert credentials.fetch() is None  # nothing changed

    # A new certificate next to the old key (a copy that is half done): keep the old pair.
    secret.publish({**server_files(old), "tls.crt": new.cert("worker").read_bytes()})
    assert credentials.fetch() is None
    assert credentials.fetch() is None  # and not tried again until the files change

    secret.publish(server_files(new))
    assert credentials.fetch() is not None
    assert credentials.reloads == 1


def test_files_touched_or_copied_again_with_the_same_content_are_no_change(
    tmp_path: Path,
) -> None:
    certs = issue(tmp_path / "certs")
    secret = MountedSecret(tmp_path / "secret")
    secret.publish(server_files(certs))
    files = WatchedFiles([secret.path(name) for name in FILES])
    assert not files.changed()
    secret.publish(server_files(certs))  # new inodes, same bytes
    assert not files.changed()
    secret.publish({**server_files(certs), "ca.crt": b"another CA"})
    assert files.changed()
    assert files.contents[2] == b"another CA"


async def test_the_gateways_openai_port_serves_a_renewed_certificate(tmp_path: Path) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from tokenmesh.gateway.frontends.openai.http import HttpServer

    old, new = issue(tmp_path / "old"), issue(tmp_path / "new")
    secret = MountedSecret(tmp_path / "secret")
    secret.publish(server_files(old))
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    server = HttpServer(
        app, "127.0.0.1", 0, 1.0, *(secret.path(name) for name in FILES), tls_check_seconds=0.05
    )
    port = await server.start()

    async def answered(certs: CertPaths) -> bool:
        """A client that trusts only certs' CA and presents its Envoy client certificate."""
        context = ssl.create_default_context(cafile=certs.ca_cert)
        context.load_cert_chain(certs.cert(ENVOY_CLIENT), certs.key(ENVOY_CLIENT))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        except ssl.SSLError:
            return False
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        reply = await reader.read()
        writer.close()
        return reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok")

    try:
        assert await answered(old) and not await answered(new)
        secret.publish(server_files(new))
        for _ in range(200):  # bounded: the watch looks every 0.05 s
            if await answered(new):
                break
            await asyncio.sleep(0.05)
        assert await answered(new)
        assert not await answered(old)  # the old CA's client does not trust the new certificate
    finally:
        await server.stop()
