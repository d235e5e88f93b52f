"""TLS at the edge, mTLS to the services, TLS on the internal listeners; certificates over SDS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.unit.test_meshconfig import clusters, envoy_validate, with_health_checks
from tokenmesh.localmesh.certs import (
    EDGE,
    ENVOY_CLIENT,
    ENVOY_INTERNAL,
    CertMaker,
    CertPaths,
    CertSettings,
)
from tokenmesh.meshconfig.__main__ import render_secret_files, render_yaml
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings, kubernetes_profile
from tokenmesh.meshconfig.tls import secret_files


def delivered(reference: dict[str, Any], mesh: MeshSettings) -> dict[str, Any]:
    """The secret an SDS reference names, from the SDS file it names (secret_files)."""
    path = reference["sds_config"]["path_config_source"]["path"]
    (secret,) = secret_files(mesh)[path]["resources"]
    assert secret["@type"].endswith("envoy.extensions.transport_sockets.tls.v3.Secret")
    assert secret["name"] == reference["name"]
    return dict(secret)


def certificate_of(context: dict[str, Any], mesh: MeshSettings) -> dict[str, Any]:
    """The certificate a TLS context gets over SDS (static certificates are never re-read)."""
    assert "tls_certificates" not in context
    (reference,) = context["tls_certificate_sds_secret_configs"]
    return dict(delivered(reference, mesh)["tls_certificate"])


def test_tls_edge_terminates_tls_on_the_edge_only() -> None:
    mesh = kubernetes_profile(tls=True)
    config = render(mesh)
    chains = {
        item["name"]: item["filter_chains"][0] for item in config["static_resources"]["listeners"]
    }
    tls = chains["edge"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["alpn_protocols"] == ["h2", "http/1.1"]
    assert certificate_of(tls, mesh)["certificate_chain"]["filename"] == "/etc/envoy/tls/tls.crt"
    assert (
        "transport_socket" not in chains["worker"] and "transport_socket" not in chains["reranker"]
    )
    with pytest.raises(ValueError, match="go together"):
        MeshSettings(edge_tls_cert_file="/tls/tls.crt")


def test_certificates_come_over_sds_and_are_reread_when_their_secret_is_swapped() -> None:
    """Envoy re-reads a certificate only when SDS delivers it: each one comes from its own
    SDS file in sds_dir (the chart's ConfigMap), which names the certificate's files and
    watches their directory, the one a renewed Secret swaps."""
    mesh = kubernetes_profile(tls=True, mtls=True)
    config = render(mesh)
    assert "tls_certificates" not in json.dumps(config)
    chains = {
        item["name"]: item["filter_chains"][0] for item in config["static_resources"]["listeners"]
    }
    edge = chains["edge"]["transport_socket"]["typed_config"]["common_tls_context"]
    (reference,) = edge["tls_certificate_sds_secret_configs"]
    assert reference["sds_config"]["path_config_source"] == {
        "path": "/etc/envoy/config/sds-edge-certificate.yaml",
        "watched_directory": {"path": "/etc/envoy/config"},
    }
    assert certificate_of(edge, mesh) == {
        "certificate_chain": {"filename": "/etc/envoy/tls/tls.crt"},
        "private_key": {"filename": "/etc/envoy/tls/tls.key"},
        "watched_directory": {"path": "/etc/envoy/tls"},
    }
    internal = chains["worker"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert certificate_of(internal, mesh)["watched_directory"] == {
        "path": "/etc/envoy/internal-tls"
    }
    upstream = clusters(config)["worker"]["transport_socket"]["typed_config"]
    assert certificate_of(upstream["common_tls_context"], mesh)["watched_directory"] == {
        "path": "/etc/envoy/mtls"
    }
    validation = upstream["common_tls_context"]["combined_validation_context"]
    ca = delivered(validation["validation_context_sds_secret_config"], mesh)
    assert ca["validation_context"] == {
        "trusted_ca": {"filename": "/etc/envoy/mtls/ca.crt"},
        "watched_directory": {"path": "/etc/envoy/mtls"},
    }
    # One file per secret, and only the ones the bootstrap names.
    named = {
        item["sds_config"]["path_config_source"]["path"]
        for item in iter_values(config, "tls_certificate_sds_secret_configs")
    } | {
        validation["validation_context_sds_secret_config"]["sds_config"]["path_config_source"][
            "path"
        ]
    }
    assert set(secret_files(mesh)) == named
    assert secret_files(kubernetes_profile()) == {}
    with pytest.raises(ValueError, match="sds_dir"):
        MeshSettings(edge_tls_cert_file="/tls/tls.crt", edge_tls_key_file="/tls/tls.key")


def iter_values(item: Any, key: str) -> list[Any]:
    """Every item of the lists under key, anywhere in a config."""
    found: list[Any] = []
    if isinstance(item, dict):
        for name, value in item.items():
            found += value if name == key else iter_values(value, key)
    elif isinstance(item, list):
        for value in item:
            found += iter_values(value, key)
    return found


def mtls_mesh(certs: CertPaths, **overrides: object) -> MeshSettings:
    settings: dict[str, Any] = {
        "upstream_tls_cert_file": str(certs.cert(ENVOY_CLIENT)),
        "upstream_tls_key_file": str(certs.key(ENVOY_CLIENT)),
        "upstream_tls_ca_file": str(certs.ca_cert),
        "internal_tls_cert_file": str(certs.cert(ENVOY_INTERNAL)),
        "internal_tls_key_file": str(certs.key(ENVOY_INTERNAL)),
        "sds_dir": str(certs.dir),
    }
    return MeshSettings(**{**settings, **overrides})


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    paths = CertPaths(tmp_path_factory.mktemp("certs"))
    CertMaker(CertSettings(dir=paths.dir), paths).make()
    return paths


def test_upstream_mtls_presents_envoys_certificate_and_checks_each_services_name(
    certs: CertPaths,
) -> None:
    mesh = mtls_mesh(certs)
    found = clusters(render(mesh))
    for name in ("gateway", "worker", "reranker"):
        socket = found[name]["transport_socket"]
        assert socket["name"] == "envoy.transport_sockets.tls"
        context = socket["typed_config"]
        assert context["@type"].endswith("UpstreamTlsContext")
        assert context["sni"] == name
        tls = context["common_tls_context"]
        assert tls["alpn_protocols"] == ["h2"]
        certificate = certificate_of(tls, mesh)
        assert certificate["certificate_chain"]["filename"] == str(certs.cert(ENVOY_CLIENT))
        assert certificate["private_key"]["filename"] == str(certs.key(ENVOY_CLIENT))
        validation = tls["combined_validation_context"]
        ca = delivered(validation["validation_context_sds_secret_config"], mesh)
        assert ca["validation_context"]["trusted_ca"]["filename"] == str(certs.ca_cert)
        assert validation["default_validation_context"]["match_typed_subject_alt_names"] == [
            {"san_type": "DNS", "matcher": {"exact": name}}
        ]
        # Health checks use the cluster's transport socket: no plaintext override.
        assert "transport_socket_match_criteria" not in found[name]["health_checks"][0]
    # The control plane's clusters stay plaintext.
    for name in ("xds_cluster", "ops", "ops_page"):
        assert "transport_socket" not in found[name]
    assert all(
        "transport_socket" not in cluster for cluster in clusters(render(MeshSettings())).values()
    )
    with pytest.raises(ValueError, match="go together"):
        MeshSettings(upstream_tls_cert_file="/tls/envoy.crt")


def test_internal_listeners_speak_tls_for_the_gateways_http2_only(certs: CertPaths) -> None:
    mesh = mtls_mesh(certs)
    config = render(mesh)
    chains = {
        item["name"]: item["filter_chains"][0] for item in config["static_resources"]["listeners"]
    }
    for name in ("worker", "reranker"):
        context = chains[name]["transport_socket"]["typed_config"]
        assert context["@type"].endswith("DownstreamTlsContext")
        tls = context["common_tls_context"]
        assert tls["alpn_protocols"] == ["h2"]
        assert certificate_of(tls, mesh)["certificate_chain"]["filename"] == str(
            certs.cert(ENVOY_INTERNAL)
        )
    assert "transport_socket" not in chains["edge"]
    with pytest.raises(ValueError, match="go together"):
        MeshSettings(internal_tls_key_file="/tls/envoy.key")


def test_envoy_accepts_tls_at_the_edge_and_mtls_to_the_services(
    certs: CertPaths, tmp_path: Path
) -> None:
    mesh = mtls_mesh(
        certs,
        edge_tls_cert_file=str(certs.cert(EDGE)),
        edge_tls_key_file=str(certs.key(EDGE)),
        sds_dir=str(tmp_path),
    )
    for sds_path, text in render_secret_files(mesh).items():
        Path(sds_path).write_text(text)
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(mesh))
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("profile", ["kubernetes-tls", "kubernetes-mtls", "kubernetes-tls-mtls"])
def test_envoy_accepts_the_charts_tls_configs_with_their_sds_files(
    profile: str, certs: CertPaths, tmp_path: Path
) -> None:
    """The chart's files as its ConfigMap mounts them (the bootstrap and the SDS files it
    names, in one directory), with the Secrets' mounts here test certificates."""
    chart = ROOT / "helm" / "tokenmesh" / "files"
    mounts = {
        "/etc/envoy/config": tmp_path / "config",
        "/etc/envoy/tls": tmp_path / "tls",
        "/etc/envoy/mtls": tmp_path / "mtls",
        "/etc/envoy/internal-tls": tmp_path / "internal-tls",
    }
    for directory in mounts.values():
        directory.mkdir()
    for name, directory in (
        (EDGE, "tls"),
        (ENVOY_CLIENT, "mtls"),
        (ENVOY_INTERNAL, "internal-tls"),
    ):
        shutil.copy(certs.cert(name), tmp_path / directory / "tls.crt")
        shutil.copy(certs.key(name), tmp_path / directory / "tls.key")
    shutil.copy(certs.ca_cert, tmp_path / "mtls" / "ca.crt")

    def mounted(text: str) -> str:
        for mount, directory in mounts.items():
            text = text.replace(mount, str(directory))
        text = text.replace("${TOKENMESH_CONTROLPLANE_HOST}", "127.0.0.1")
        return with_health_checks(text, MeshSettings())

    bootstrap = mounted((chart / f"envoy{profile.removeprefix('kubernetes')}.yaml").read_text())
    for sds_file in (chart / "sds").glob("*.yaml"):
        (tmp_path / "config" / sds_file.name).write_text(mounted(sds_file.read_text()))
    path = tmp_path / "config" / "envoy.yaml"
    path.write_text(bootstrap)
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_openai_cluster_speaks_mtls_to_the_gateways_http_port(certs: CertPaths) -> None:
    """With mTLS, Envoy reaches the gateways' OpenAI port as it reaches their gRPC port: its
    client certificate, the gateway's name checked, over HTTP/1.1, health checks included."""
    found = clusters(render(mtls_mesh(certs)))
    openai_socket = found["openai"]["transport_socket"]
    context = openai_socket["typed_config"]
    assert context["@type"].endswith("UpstreamTlsContext")
    assert context["sni"] == "gateway"
    tls = context["common_tls_context"]
    assert tls["alpn_protocols"] == ["http/1.1"]
    gateway_tls = found["gateway"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert (
        tls["tls_certificate_sds_secret_configs"]
        == gateway_tls["tls_certificate_sds_secret_configs"]
    )
    assert tls["combined_validation_context"] == gateway_tls["combined_validation_context"]
    validation = tls["combined_validation_context"]["default_validation_context"]
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "gateway"}}
    ]
    check = found["openai"]["health_checks"][0]
    assert check["http_health_check"] == {"path": "/health"}
    assert "transport_socket_match_criteria" not in check
    assert "typed_extension_protocol_options" not in found["openai"]  # HTTP/1.1 to uvicorn
    assert "transport_socket" not in clusters(render(MeshSettings()))["openai"]
