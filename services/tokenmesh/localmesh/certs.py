"""A local CA and the mesh's TLS certificates (`make certs`), made with PyPI cryptography."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The gRPC services behind Envoy; each gets a server certificate whose first DNS SAN is its
# kind, which Envoy checks (a worker's certificate cannot pass as the reranker).
SERVICE_KINDS = ("gateway", "worker", "reranker")
# Envoy's client certificate towards the services (mTLS).
ENVOY_CLIENT = "envoy-client"
# Envoy's server certificate on its internal listeners, which the gateways call.
ENVOY_INTERNAL = "envoy"
EDGE = "edge"
LOCAL_NAMES = ("localhost", "127.0.0.1")
# A set is made again when a certificate expires within this long.
RENEW_BEFORE = datetime.timedelta(days=1)


class CertSettings(BaseSettings):
    """What `make certs` makes, from TOKENMESH_CERTS_* variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENMESH_CERTS_", frozen=True, extra="ignore")

    # Where the CA, certificates and keys go (keys are written mode 0600).
    dir: Path = Path(".run/certs")
    # Extra DNS names or IP addresses on the edge certificate besides localhost and 127.0.0.1
    # (a LAN name, a tunnel's host), as a JSON list.
    edge_names: tuple[str, ...] = ()
    # The chart's full name and the namespace whose Services' DNS names go on the service
    # certificates (<fullname>-<kind>[-headless][.<namespace>[.svc.cluster.local]]). The full
    # name is the Helm release's name when it contains "tokenmesh", else <release>-tokenmesh.
    fullname: str = "tokenmesh"
    namespace: str = "default"
    # Short on purpose: these are development certificates. `make certs` (and `make up` with
    # TLS) makes a new set when one expires within a day; --force makes one at any time.
    ca_days: int = Field(default=90, ge=2)
    leaf_days: int = Field(default=30, ge=2)


@dataclass(frozen=True)
class CertPaths:
    """The files of one certificate set in a directory."""

    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def leaf_names(self) -> tuple[str, ...]:
        return (EDGE, *SERVICE_KINDS, ENVOY_CLIENT, ENVOY_INTERNAL)


def service_names(
    kind: str, fullname: str, namespace: str, services: tuple[str, ...] = ("", "-headless")
) -> list[str]:
    """DNS names a service's certificate carries: its kind first (what Envoy checks), then its
    Kubernetes Service names (<fullname>-<kind><suffix> for each suffix in services), then the
    local names."""
    names = [kind]
    for service in (f"{fullname}-{kind}{suffix}" for suffix in services):
        names += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
                  f"{service}.{namespace}.svc.cluster.local"]  # fmt: skip
    return [*names, *LOCAL_NAMES]


def subject_alt_names(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: small and fast, supported by Envoy (BoringSSL) and gRPC alike.
    return ec.generate_private_key(ec.SECP256R1())


def common_name(name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])


class CertMaker:
    """Makes a CA and signs the edge, service and Envoy client certificates with it."""

    def __init__(self, settings: CertSettings, paths: CertPaths) -> None:
        self.settings = settings
        self.paths = paths

    def leaf_sans(self) -> dict[str, list[str]]:
        s = self.settings
        sans = {EDGE: [*LOCAL_NAMES, *s.edge_names], ENVOY_CLIENT: ["envoy"]}
        for kind in SERVICE_KINDS:
            sans[kind] = service_names(kind, s.fullname, s.namespace)
        # The gateways reach the internal listeners through the Service <fullname>-envoy-internal.
        sans[ENVOY_INTERNAL] = service_names("envoy", s.fullname, s.namespace, ("-internal",))
        return sans

    def is_current(self) -> bool:
        """Every file exists, no certificate expires within RENEW_BEFORE, and each carries the
        names asked for now (a new edge name makes a new set)."""
        wanted = self.leaf_sans()
        soon = datetime.datetime.now(datetime.UTC) + RENEW_BEFORE
        files = [self.paths.ca_cert, self.paths.ca_key]
        for name in self.paths.leaf_names():
            files += [self.paths.cert(name), self.paths.key(name)]
        if not all(path.exists() for path in files):
            return False
        for path in [self.paths.ca_cert, *(self.paths.cert(n) for n in wanted)]:
            if x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc < soon:
                return False
        for name, names in wanted.items():
            cert = x509.load_pem_x509_certificate(self.paths.cert(name).read_bytes())
            if cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value != (
                subject_alt_names(names)
            ):
                return False
        return True

    def ensure(self, force: bool = False) -> bool:
        """Make a new set unless the current one is complete and valid; True if one was made."""
        if not force and self.is_current():
            return False
        self.make()
        return True

    def make(self) -> None:
        self.paths.dir.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = new_key()
        ca_name = common_name("tokenmesh local CA")
        ca = (
            self._builder(ca_name, ca_name, ca_key, now, self.settings.ca_days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        self._write(self.paths.ca_cert, self.paths.ca_key, ca, ca_key)
        for name, names in self.leaf_sans().items():
            usage = (
                ExtendedKeyUsageOID.CLIENT_AUTH
                if name == ENVOY_CLIENT
                else ExtendedKeyUsageOID.SERVER_AUTH
            )
            key = new_key()
            cert = (
                self._builder(common_name(names[0]), ca_name, key, now, self.settings.leaf_days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(subject_alt_names(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(
                    x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                    critical=False,
                )
                .sign(ca_key, hashes.SHA256())
            )
            self._write(self.paths.cert(name), self.paths.key(name), cert, key)

    @staticmethod
    def _builder(
        subject: x509.Name,
        issuer: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        now: datetime.datetime,
        days: int,
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            # A minute back: a peer whose clock is slightly behind still accepts it.
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        )

    @staticmethod
    def _write(
        cert_path: Path, key_path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
    ) -> None:
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_bytes = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        key_path.unlink(missing_ok=True)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Make a local CA and the edge, service and Envoy client certificates "
        "(TOKENMESH_CERTS_* settings); nothing is done while the current set is valid."
    )
    parser.add_argument("--dir", type=Path, help="output directory (default .run/certs)")
    parser.add_argument(
        "--edge-name", action="append", default=[], help="an extra edge DNS name or IP"
    )
    parser.add_argument("--force", action="store_true", help="make a new set anyway")
    args = parser.parse_args(argv)
    settings = CertSettings()
    overrides: dict[str, object] = {}
    if args.dir:
        overrides["dir"] = args.dir
    if args.edge_name:
        overrides["edge_names"] = (*settings.edge_names, *args.edge_name)
    settings = settings.model_copy(update=overrides)
    maker = CertMaker(settings, CertPaths(settings.dir))
    made = maker.ensure(force=args.force)
    print(
        f"{'made' if made else 'kept'} certificates in {settings.dir} (CA: {maker.paths.ca_cert})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
