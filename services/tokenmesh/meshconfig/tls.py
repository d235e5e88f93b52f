"""TLS: the listeners' and the service clusters' TLS contexts, and the secrets (certificates,
the services' CA) they get over SDS from files, with those files' contents."""

from __future__ import annotations

import posixpath

from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import TYPE, Config
from tokenmesh.meshconfig.policy import ServicePolicy

SECRET = TYPE + "envoy.extensions.transport_sockets.tls.v3.Secret"
# The secrets (certificates, the services' CA) Envoy's TLS contexts get over SDS.
EDGE_CERTIFICATE = "edge-certificate"
INTERNAL_CERTIFICATE = "internal-certificate"
UPSTREAM_CERTIFICATE = "upstream-certificate"
UPSTREAM_CA = "upstream-ca"
# The protocol a service's hosts speak, by ALPN.
ALPN = {"grpc": "h2", "http1": "http/1.1"}


def certificate(cert_file: str, key_file: str) -> Config:
    """A certificate and key from files, read again together when their directory changes."""
    return {
        "certificate_chain": {"filename": cert_file},
        "private_key": {"filename": key_file},
        "watched_directory": {"path": posixpath.dirname(cert_file)},
    }


def secrets(mesh: MeshSettings) -> dict[str, Config]:
    """The secrets Envoy's TLS contexts name, by name: each certificate and the services' CA.
    SDS delivers them, so Envoy reads their files again when a renewed Secret swaps their
    directory; set in the bootstrap, a certificate would be read once, at start-up."""
    found: dict[str, Config] = {}
    if mesh.edge_tls_cert_file and mesh.edge_tls_key_file:
        found[EDGE_CERTIFICATE] = {
            "tls_certificate": certificate(mesh.edge_tls_cert_file, mesh.edge_tls_key_file)
        }
    if mesh.internal_tls_cert_file and mesh.internal_tls_key_file:
        found[INTERNAL_CERTIFICATE] = {
            "tls_certificate": certificate(mesh.internal_tls_cert_file, mesh.internal_tls_key_file)
        }
    if mesh.upstream_tls_cert_file and mesh.upstream_tls_key_file and mesh.upstream_tls_ca_file:
        found[UPSTREAM_CERTIFICATE] = {
            "tls_certificate": certificate(mesh.upstream_tls_cert_file, mesh.upstream_tls_key_file)
        }
        found[UPSTREAM_CA] = {
            "validation_context": {
                "trusted_ca": {"filename": mesh.upstream_tls_ca_file},
                "watched_directory": {"path": posixpath.dirname(mesh.upstream_tls_ca_file)},
            }
        }
    return found


def sds_path(name: str, mesh: MeshSettings) -> str:
    """The SDS file of the secret name."""
    assert mesh.sds_dir is not None
    return posixpath.join(mesh.sds_dir, f"sds-{name}.yaml")


def secret_files(mesh: MeshSettings) -> dict[str, Config]:
    """The SDS files the bootstrap names, by path: one secret each (a DiscoveryResponse's
    shape), for whoever writes Envoy's config (the local mesh, the chart's ConfigMap)."""
    return {
        sds_path(name, mesh): {"resources": [{"@type": SECRET, "name": name, **secret}]}
        for name, secret in secrets(mesh).items()
    }


def sds(name: str, mesh: MeshSettings) -> Config:
    """A secret from its SDS file, read again when sds_dir changes (a ConfigMap's update swaps
    it as a Secret's does)."""
    assert mesh.sds_dir is not None
    return {
        "name": name,
        "sds_config": {
            "path_config_source": {
                "path": sds_path(name, mesh),
                "watched_directory": {"path": mesh.sds_dir},
            },
            "resource_api_version": "V3",
        },
    }


def downstream_tls(secret: str, mesh: MeshSettings, alpn: list[str]) -> Config:
    """TLS on a listener with the certificate secret, offering the alpn protocols."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TYPE + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": alpn,
                "tls_certificate_sds_secret_configs": [sds(secret, mesh)],
            },
        },
    }


def upstream_tls(service: ServicePolicy, mesh: MeshSettings) -> Config:
    """mTLS towards a service cluster: Envoy's client certificate, the CA, and the service's
    certificate must carry its server name (DNS SAN; also sent as SNI), in the service's
    protocol by ALPN. The cluster's health checks use this transport socket too."""
    assert mesh.upstream_mtls
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": service.server_name,
            "common_tls_context": {
                "alpn_protocols": [ALPN[service.protocol]],
                "tls_certificate_sds_secret_configs": [sds(UPSTREAM_CERTIFICATE, mesh)],
                # The CA from SDS, the name this cluster's hosts must carry from here.
                "combined_validation_context": {
                    "default_validation_context": {
                        "match_typed_subject_alt_names": [
                            {"san_type": "DNS", "matcher": {"exact": service.server_name}}
                        ],
                    },
                    "validation_context_sds_secret_config": sds(UPSTREAM_CA, mesh),
                },
            },
        },
    }
