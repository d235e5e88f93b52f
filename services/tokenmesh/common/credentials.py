"""TLS credentials read from PEM files and read again when the files change (renewal)."""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int, int], ...]
Validator = Callable[[Sequence[Path]], None]


class WatchedFiles:
    """Files read together, and read again once they change. A change is seen in the stat of
    what each path resolves to: kubelet and cert-manager replace a mounted Secret by swapping
    its `..data` symlink, so the link a path names never changes, its target does. New
    content is taken only when `validate` accepts it and no file changed while it was read;
    otherwise it is tried again when the files change next."""

    def __init__(self, paths: Sequence[Path], validate: Validator | None = None) -> None:
        self.paths = tuple(paths)
        self._validate = validate
        self._lock = threading.Lock()
        signature = self._stat()
        if validate is not None:
            validate(self.paths)  # at start-up a broken file is an error, not a warning
        self.contents = self._read()
        self._signature = signature
        self._rejected: Signature | None = None
        self._last_rejection: tuple[Signature | None, str] | None = None
        self._digest = _digest(self.contents)

    def changed(self) -> bool:
        """Read the files again if they changed since the last reading; True when their
        content is new (it is then in `contents`). Cheap when nothing changed: a stat per file."""
        with self._lock:  # gRPC may ask from several threads at once
            try:
                signature = self._stat()
            except OSError as exc:  # a file removed: keep what was read
                self._reject(None, exc)
                return False
            if signature in (self._signature, self._rejected):
                return False
            try:
                if self._validate is not None:
                    self._validate(self.paths)
                contents = self._read()
                if self._stat() != signature:
                    return False  # replaced while read: read again next time
            except (OSError, ValueError, ssl.SSLError) as exc:
                self._reject(signature, exc)
                return False
            self._signature = signature
            digest = _digest(contents)
            if digest == self._digest:
                return False  # touched or copied again, same content
            self.contents, self._digest = contents, digest
            return True

    def _reject(self, signature: Signature | None, exc: Exception) -> None:
        """Keep the current content; say so once per state of the files, not per handshake."""
        self._rejected = signature
        if (signature, str(exc)) == self._last_rejection:
            return
        self._last_rejection = (signature, str(exc))
        log.warning(
            "TLS files not reloaded, keeping the current ones: %s",
            exc,
            extra={"files": [str(path) for path in self.paths]},
        )

    def _stat(self) -> Signature:
        stats = [os.stat(path) for path in self.paths]  # follows symlinks
        return tuple((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def _read(self) -> tuple[bytes, ...]:
        return tuple(path.read_bytes() for path in self.paths)


def _digest(contents: Sequence[bytes]) -> bytes:
    hasher = hashlib.sha256()
    for content in contents:
        hasher.update(len(content).to_bytes(8, "big") + content)
    return hasher.digest()


def _certificate_key_and_ca(paths: Sequence[Path]) -> None:
    """Raise unless paths are a certificate, its key and a CA bundle (e.g. a key not yet
    written next to a new certificate)."""
    cert, key, ca = paths
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.load_verify_locations(ca)


def _ca_and_pair(paths: Sequence[Path]) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(paths[0])
    if len(paths) == 3:
        context.load_cert_chain(paths[1], paths[2])


class ReloadingServerCredentials:
    """mTLS server credentials (a client certificate signed by client_ca_file is required)
    whose certificate, key and CA are read again when their files change. gRPC calls the
    fetcher before each new connection's handshake, so the next connection gets a renewed
    certificate; connections already up keep the one they were made with."""

    def __init__(self, cert_file: Path, key_file: Path, client_ca_file: Path) -> None:
        self._files = WatchedFiles((cert_file, key_file, client_ca_file), _certificate_key_and_ca)
        self.reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), self.fetch, require_client_authentication=True
        )

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self._files.contents
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None keeps the current configuration."""
        if not self._files.changed():
            return None
        self.reloads += 1
        log.info(
            "TLS certificate reloaded",
            extra={"files": [str(path) for path in self._files.paths], "reloads": self.reloads},
        )
        return self._configuration()


class ReloadingChannelCredentials:
    """Client TLS from files: the CA that signs the server's certificate and, optionally, a
    client certificate and key. gRPC has no dynamic channel credentials, so the owner of the
    channel asks `changed()` and opens a new channel with `credentials()` (channels.Dependency)."""

    def __init__(
        self, ca_file: Path, cert_file: Path | None = None, key_file: Path | None = None
    ) -> None:
        paths = [ca_file]
        if cert_file is not None or key_file is not None:
            if cert_file is None or key_file is None:
                raise ValueError("a client certificate needs its key, and a key its certificate")
            paths += [cert_file, key_file]
        self._files = WatchedFiles(paths, _ca_and_pair)

    @property
    def paths(self) -> tuple[Path, ...]:
        return self._files.paths

    def changed(self) -> bool:
        return self._files.changed()

    def credentials(self) -> grpc.ChannelCredentials:
        ca, *pair = self._files.contents
        if not pair:
            return grpc.ssl_channel_credentials(ca)
        return grpc.ssl_channel_credentials(ca, private_key=pair[1], certificate_chain=pair[0])


class ReloadingSslContext:
    """A server's ssl.SSLContext (uvicorn's, on the gateway's OpenAI port) that loads its
    certificate, key and client CA again when their files change: OpenSSL gives the next
    handshake the new certificate; connections already up keep theirs. A CA file that changes
    adds its certificates to the trusted ones (the context cannot forget one)."""

    def __init__(
        self, context: ssl.SSLContext, cert_file: Path, key_file: Path, client_ca_file: Path
    ) -> None:
        self._context = context
        self._files = WatchedFiles((cert_file, key_file, client_ca_file), _certificate_key_and_ca)
        self.reloads = 0

    def reload(self) -> bool:
        """Load the files into the context if they changed; True when it did."""
        if not self._files.changed():
            return False
        cert, key, ca = self._files.paths
        self._context.load_cert_chain(cert, key)
        self._context.load_verify_locations(ca)
        self.reloads += 1
        log.info(
            "TLS certificate reloaded",
            extra={"files": [str(path) for path in self._files.paths], "reloads": self.reloads},
        )
        return True
