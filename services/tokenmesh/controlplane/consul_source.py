"""Endpoints from Consul: one blocking query on /v1/health/service/<name> per watched service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenmesh.common.backoff import Backoff
from tokenmesh.controlplane.endpoints import Endpoint, Snapshot, check_ip, check_port, normalized

log = logging.getLogger(__name__)

# Consul may answer a blocking query early with nothing changed (a spurious wake-up); its docs
# ask clients to rate-limit, so consecutive queries for one service are at least this far apart.
MIN_QUERY_INTERVAL_SECONDS = 0.05


def endpoints_from_health(entries: Sequence[dict[str, Any]]) -> list[Endpoint]:
    """Endpoints from a /v1/health/service response: the service address (or, when empty,
    the node's), healthy when every check of the entry (node and service) is passing.
    Entries without an IP address are skipped with a warning: Envoy would reject them."""
    endpoints = []
    for entry in entries:
        service = entry.get("Service") or {}
        node = entry.get("Node") or {}
        address = service.get("Address") or node.get("Address") or ""
        try:
            host, port = check_ip(address), check_port(int(service.get("Port", 0)))
        except (TypeError, ValueError) as exc:
            log.warning(
                "skipping a consul instance without a usable address",
                extra={"service_id": service.get("ID"), "error": str(exc)},
            )
            continue
        checks = entry.get("Checks") or []
        healthy = all(check.get("Status") == "passing" for check in checks)
        endpoints.append(Endpoint(host, port, healthy))
    return endpoints


class ConsulSource:
    """Watches services with Consul blocking queries (index/wait): a change returns at once,
    so it reaches Envoy within about a second. On errors a service's watch backs off
    (exponentially, jittered) and its last known endpoints stay in the snapshot; after an
    error the next query starts again without an index, which also covers a restarted Consul
    whose index went back to 1."""

    def __init__(
        self,
        client: Any,
        services: Sequence[str],
        passing_only: bool,
        wait_seconds: float,
        backoff: Callable[[], Backoff],
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._services = tuple(dict.fromkeys(services))
        self._passing_only = passing_only
        self._wait = f"{wait_seconds:g}s"
        self._new_backoff = backoff
        self._on_error = on_error
        # Latest known endpoints per service; a service is absent until it first answers.
        self._known: dict[str, list[Endpoint]] = {}
        self._changed = asyncio.Event()

    async def snapshots(self) -> AsyncIterator[Snapshot]:
        """The first snapshot once every service has answered, then one per change."""
        watches = [
            asyncio.create_task(self._watch(name), name=f"consul-watch-{name}")
            for name in self._services
        ]
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                if len(self._known) == len(self._services):
                    yield normalized(self._known)
        finally:
            for watch in watches:
                watch.cancel()
            for watch in watches:
                with contextlib.suppress(asyncio.CancelledError):
                    await watch

    async def _watch(self, name: str) -> None:
        backoff = self._new_backoff()
        index = 0  # 0: answer at once (first query, or after an error)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                raw_index, entries = await self._client.health.service(
                    name, index=index, wait=self._wait, passing=self._passing_only
                )
                new_index = int(raw_index)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._on_error()
                delay = backoff.next_delay()
                log.warning(
                    "consul query failed; serving the last known endpoints",
                    extra={
                        "service": name,
                        "error": repr(exc),
                        "failures": backoff.failures,
                        "retry_in_seconds": round(delay, 3),
                    },
                )
                index = 0
                await asyncio.sleep(delay)
                continue
            if backoff.failures:
                log.info("consul answering again", extra={"service": name})
            backoff.reset()
            endpoints = endpoints_from_health(entries or [])
            if self._known.get(name) != endpoints:
                self._known[name] = endpoints
                self._changed.set()
            # Consul's rules for the next index: if it went backwards (a restored or restarted
            # Consul), start over; it must never be below 1 for a blocking query.
            index = 0 if new_index < index else max(new_index, 1)
            elapsed = loop.time() - started
            if elapsed < MIN_QUERY_INTERVAL_SECONDS:
                await asyncio.sleep(MIN_QUERY_INTERVAL_SECONDS - elapsed)
