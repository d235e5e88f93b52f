"""API keys: the keys file (hashes only, hot-reloaded) and the interceptors that name the tenant."""

# A grpc.aio server interceptor rather than Envoy's ext_authz calling a check service: the key
# is checked in the process that serves the call (no extra network hop per RPC), refusals map
# to status codes in one place (ErrorMappingInterceptor, like every other error), and calls
# straight to a gateway, bypassing Envoy, are checked too.

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tokenmesh.common.errors import Unauthenticated
from tokenmesh.common.interceptors import with_tenant
from tokenmesh.common.tenants import Limits, Tenant
from tokenmesh.gateway.core.tenancy.metrics import OTHER_TENANT, TenantMetrics

log = logging.getLogger(__name__)

# The one message for a missing, malformed, unknown or revoked key: it says nothing about
# which tenants or keys exist.
UNAUTHENTICATED_MESSAGE = (
    "a valid API key is required (metadata `authorization: Bearer <key>` or `x-api-key`)"
)
# Longer values are not keys (ours are 46 characters); they are refused without hashing.
MAX_KEY_CHARS = 256
KEY_PREFIX = "tm_"
TENANT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def hash_key(key: str) -> str:
    """What the keys file stores for a key: the SHA-256 of its UTF-8 bytes, lowercase hex.
    Keys are 256-bit random strings, so a fast hash is enough (no password stretching)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A new random API key (256 bits, URL-safe)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class TenantEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # SHA-256 (hex) of each of the tenant's keys; several allow rotation without downtime.
    key_sha256: list[str] = Field(default_factory=list)
    # Overrides of the file's defaults, field by field; null means unlimited.
    limits: Limits = Limits()

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, hashes: list[str]) -> list[str]:
        for digest in hashes:
            if len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise ValueError("each key_sha256 must be 64 lowercase hex characters")
        return hashes


class KeysFile(BaseModel):
    """The keys file (JSON): default limits and the tenants with their key hashes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    defaults: Limits = Limits()
    tenants: dict[str, TenantEntry] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _tenant_ids(cls, tenants: dict[str, TenantEntry]) -> dict[str, TenantEntry]:
        seen: set[str] = set()
        for tenant_id, entry in tenants.items():
            if not re.match(TENANT_ID_PATTERN, tenant_id) or tenant_id == OTHER_TENANT:
                raise ValueError(
                    f"tenant id {tenant_id!r}: 1-64 of A-Z a-z 0-9 _ . - (not {OTHER_TENANT!r})"
                )
            duplicates = seen.intersection(entry.key_sha256)
            if duplicates or len(set(entry.key_sha256)) != len(entry.key_sha256):
                raise ValueError(f"tenant {tenant_id!r}: a key hash is listed twice")
            seen.update(entry.key_sha256)
        return tenants

    def resolved(self, tenant_id: str) -> Tenant:
        """The tenant with its own limits laid over the defaults."""
        entry = self.tenants[tenant_id]
        own = entry.limits.model_dump(exclude_unset=True)
        return Tenant(tenant_id, self.defaults.model_copy(update=own))


class KeysFileError(Exception):
    """The keys file cannot be read or is not valid."""


def read_keys_file(path: Path) -> KeysFile:
    try:
        return KeysFile.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise KeysFileError(f"cannot read keys file {path}: {exc.strerror}") from exc
    except ValidationError as exc:
        # Where and what, never the values: a key pasted where its hash belongs stays unlogged.
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'file'}: {error['msg']}"
            for error in exc.errors(include_url=False, include_input=False, include_context=False)
        )
        raise KeysFileError(f"invalid keys file {path}: {problems}") from exc


@dataclass(frozen=True)
class _Config:
    tenants: dict[str, Tenant]
    # key hash -> (that hash, its tenant)
    by_hash: dict[str, tuple[str, Tenant]]
    # The tenant ids, looked at per token (metrics labels): computed once.
    ids: frozenset[str]

    @classmethod
    def of(cls, keys: KeysFile) -> _Config:
        tenants = {tenant_id: keys.resolved(tenant_id) for tenant_id in keys.tenants}
        by_hash = {
            digest: (digest, tenants[tenant_id])
            for tenant_id, entry in keys.tenants.items()
            for digest in entry.key_sha256
        }
        return cls(tenants, by_hash, frozenset(tenants))


def _signature(path: Path) -> tuple[int, int, int]:
    """What changes when the file is rewritten or replaced (stat follows symlinks, so a
    Kubernetes Secret volume's atomic swap of its ..data link shows as a new inode)."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


class KeyStore:
    """The tenants and key hashes of a keys file, re-read when the file changes (polled); a
    broken file keeps the last good configuration and logs an error.

    Polled rather than watched with inotify (watchfiles): one stat a second costs nothing, and
    a Kubernetes Secret volume replaces its files by swapping a symlinked directory, which a
    watch on the file's path can miss while stat (following the links) sees a new inode."""

    def __init__(self, path: Path) -> None:
        """Reads the file now: a broken file at start-up is an error (KeysFileError)."""
        self.path = path
        try:
            self._signature = _signature(path)
        except OSError as exc:
            raise KeysFileError(f"cannot read keys file {path}: {exc.strerror}") from exc
        self._config = _Config.of(read_keys_file(path))
        self._logged_failure: tuple[int, int, int] | None = None

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant whose key this is, or None."""
        if not key or len(key) > MAX_KEY_CHARS:
            return None
        digest = hash_key(key)
        # The lookup compares SHA-256 digests of what the caller sent, not keys, so its timing
        # says nothing usable about a stored key; the final comparison is constant-time anyway.
        found = self._config.by_hash.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]

    def tenant_ids(self) -> frozenset[str]:
        return self._config.ids

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self._config.tenants.get(tenant_id)

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed since the last look; True when a new configuration
        is in force."""
        try:
            signature = _signature(self.path)
        except OSError as exc:
            self._failed((0, 0, 0), f"cannot stat keys file {self.path}: {exc.strerror}")
            return False
        if signature == self._signature:
            return False
        try:
            keys = read_keys_file(self.path)
        except KeysFileError as exc:
            self._failed(signature, str(exc))
            return False
        self._signature = signature
        self._config = _Config.of(keys)
        self._logged_failure = None
        log.info(
            "keys file reloaded",
            extra={"tenants": len(self._config.tenants), "keys": len(self._config.by_hash)},
        )
        return True

    def _failed(self, signature: tuple[int, int, int], message: str) -> None:
        """Log a failed reload once per version of the file; the last good keys stay."""
        if self._logged_failure != signature:
            self._logged_failure = signature
            log.error("%s; keeping the last good keys", message)

    async def watch(self, interval: float) -> None:
        """Poll the file every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()


def presented_key(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The API key a caller sent: `authorization: Bearer <key>`, else `x-api-key`."""
    api_key = None
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, credentials = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return credentials.strip()
        elif key == "x-api-key" and isinstance(value, str) and api_key is None:
            api_key = value.strip()
    return api_key


def resolve_tenant(
    store: KeyStore, metadata: Sequence[tuple[str, Any]] | None, metrics: TenantMetrics
) -> Tenant:
    """The tenant of the key in a request's metadata (gRPC) or headers (HTTP, lower-case
    names); Unauthenticated, counted, when there is no valid key."""
    tenant = store.authenticate(presented_key(metadata))
    if tenant is None:
        metrics.request(None, "unauthenticated")
        raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
    return tenant


class AuthInterceptor(aio.ServerInterceptor):
    """Checks the caller's API key once per RPC (methods under `open_methods` excepted) and
    makes its tenant the RPC's; no valid key: UNAUTHENTICATED, one message for every cause.
    The key is never logged."""

    def __init__(
        self, store: KeyStore, open_methods: Sequence[str], metrics: TenantMetrics
    ) -> None:
        self._store = store
        self._open = tuple(open_methods)
        self._metrics = metrics

    def _resolve(self, context: aio.ServicerContext[Any, Any]) -> Tenant:
        return resolve_tenant(self._store, context.invocation_metadata(), self._metrics)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        return with_tenant(handler, self._resolve)
