"""Private meshes (tests, benchmarks) get ports that are free and never overlap a replica's;
a keys file reaches every gateway; TLS settings reach Envoy's config and the services."""

from __future__ import annotations

import socket
from pathlib import Path

from tokenmesh.localmesh.certs import ENVOY_CLIENT
from tokenmesh.localmesh.mesh import MAX_REPLICAS, REPLICATED_PORTS, LocalMesh, LocalMeshSettings


def listening_ports(settings: LocalMeshSettings) -> list[int]:
    """Every port the mesh's processes would listen on with the most replicas allowed."""
    ports = []
    for name, value in settings.model_dump().items():
        if name.endswith("_port"):
            replicas = MAX_REPLICAS if name in REPLICATED_PORTS else 1
            ports.extend(value + i for i in range(replicas))
    return ports


def test_every_replica_port_is_distinct_and_free(tmp_path: Path) -> None:
    settings = LocalMeshSettings.on_free_ports(tmp_path, gateways=2, workers=2)
    ports = listening_ports(settings)
    assert len(ports) == len(set(ports))
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_overrides_win_over_the_chosen_ports(tmp_path: Path) -> None:
    settings = LocalMeshSettings.on_free_ports(tmp_path, edge_port=18_080, gateways=1)
    assert settings.edge_port == 18_080 and settings.gateways == 1
    assert settings.run_dir == tmp_path


def test_a_keys_file_turns_auth_on_in_every_gateway_and_nothing_else(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    plain = LocalMesh(LocalMeshSettings.on_free_ports(tmp_path, gateways=2, workers=1), root)
    assert not any("TOKENMESH_GATEWAY_KEYS_FILE" in p.env for p in plain.programs)
    secured = LocalMesh(
        LocalMeshSettings.on_free_ports(tmp_path, gateways=2, workers=1, keys_file="keys.json"),
        root,
    )
    keyed = {p.name: p.env.get("TOKENMESH_GATEWAY_KEYS_FILE") for p in secured.programs}
    gateways = {name: path for name, path in keyed.items() if name.startswith("gateway-")}
    assert gateways == {name: str(root / "keys.json") for name in ("gateway-0", "gateway-1")}
    assert all(path is None for name, path in keyed.items() if name not in gateways)


def test_tls_and_mtls_reach_envoys_config_and_every_service_but_the_control_plane(
    tmp_path: Path,
) -> None:
    root = Path(__file__).resolve().parents[2]
    plain = LocalMesh(LocalMeshSettings.on_free_ports(tmp_path, gateways=1, workers=1), root)
    assert not plain.tls and not any(p.mtls for p in plain.programs)
    edge_only = LocalMesh(LocalMeshSettings.on_free_ports(tmp_path, workers=1, tls=True), root)
    mesh = edge_only.settings.mesh(edge_only.certs)
    assert mesh.edge_tls_cert_file == str(tmp_path / "certs" / "edge.crt")
    assert not mesh.upstream_mtls and not any(p.mtls for p in edge_only.programs)
    both = LocalMesh(
        LocalMeshSettings.on_free_ports(tmp_path, workers=1, tls=True, mtls=True), root
    )
    assert both.settings.mesh(both.certs).upstream_tls_ca_file == str(both.certs.ca_cert)
    for program in both.programs:
        prefix = f"TOKENMESH_{(program.service or '').upper()}_"
        if program.service in ("gateway", "worker", "reranker"):
            assert program.mtls
            # Gateways reach Envoy's internal listeners over TLS too.
            assert (prefix + "DEPENDENCY_TLS_CA_FILE" in program.env) == (
                program.service == "gateway"
            )
            assert program.env[prefix + "TLS_CERT_FILE"] == str(both.certs.cert(program.service))
            assert program.env[prefix + "TLS_CLIENT_CA_FILE"] == str(both.certs.ca_cert)
        elif program.service == "controlplane":
            # Its port stays plaintext; its ops feed calls the workers with Envoy's certificate.
            assert not program.mtls and prefix + "TLS_CERT_FILE" not in program.env
            assert {k: v for k, v in program.env.items() if "TLS" in k} == {
                prefix + "WORKER_TLS_CA_FILE": str(both.certs.ca_cert),
                prefix + "WORKER_TLS_CERT_FILE": str(both.certs.cert(ENVOY_CLIENT)),
                prefix + "WORKER_TLS_KEY_FILE": str(both.certs.key(ENVOY_CLIENT)),
            }
        else:
            assert not program.mtls and not any("TLS" in key for key in program.env)
