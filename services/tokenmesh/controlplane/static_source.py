"""Endpoints from a JSON or YAML file, re-read whenever the file changes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import yaml

from tokenmesh.controlplane.endpoints import Endpoint, Snapshot, normalized, parse_address

log = logging.getLogger(__name__)


def parse_static(text: str, yaml_syntax: bool) -> Snapshot:
    """{"clusters": {name: [entry, ...]}} where an entry is "ip:port" or
    {"address": "ip:port", "healthy": bool}; ValueError naming the bad part otherwise."""
    try:
        document: Any = yaml.safe_load(text) if yaml_syntax else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"not valid {'YAML' if yaml_syntax else 'JSON'}: {exc}") from None
    clusters = document.get("clusters") if isinstance(document, dict) else None
    if not isinstance(clusters, dict):
        raise ValueError('expected an object with a "clusters" mapping')
    result: dict[str, list[Endpoint]] = {}
    for name, entries in clusters.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"cluster name {name!r} is not a non-empty string")
        if not isinstance(entries, list):
            raise ValueError(f"clusters.{name}: expected a list of endpoints")
        result[name] = [parse_entry(f"clusters.{name}[{i}]", e) for i, e in enumerate(entries)]
    return normalized(result)


def parse_entry(where: str, entry: Any) -> Endpoint:
    healthy: Any = True
    address = entry
    if isinstance(entry, dict):
        unknown = set(entry) - {"address", "healthy"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        address, healthy = entry.get("address"), entry.get("healthy", True)
    if not isinstance(address, str):
        raise ValueError(f'{where}: expected "ip:port" or {{"address": ..., "healthy": ...}}')
    if not isinstance(healthy, bool):
        raise ValueError(f"{where}: healthy must be true or false")
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return Endpoint(host, port, healthy)


def load_static(path: Path) -> Snapshot:
    return parse_static(path.read_text(), yaml_syntax=path.suffix in (".yaml", ".yml"))


class StaticFileSource:
    """Polls the file's (mtime, size, inode) and re-reads it when they change; an atomic
    rename (editors, Kubernetes ConfigMaps) changes the inode, so it is seen too."""

    def __init__(
        self,
        path: Path,
        poll_seconds: float,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        self._poll_seconds = poll_seconds
        self._on_error = on_error

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size, stat.st_ino)

    async def snapshots(self) -> AsyncIterator[Snapshot]:
        seen: tuple[int, int, int] | bool | None = False  # False: nothing read yet
        while True:
            signature = self._signature()
            if signature != seen:
                seen = signature
                # The file is small and local: reading it inline is cheaper than a thread.
                try:
                    snapshot = load_static(self.path)
                except (OSError, ValueError) as exc:
                    self._on_error()
                    log.warning(
                        "static endpoints file unreadable; keeping the last good endpoints",
                        extra={"path": str(self.path), "error": str(exc)},
                    )
                else:
                    log.info(
                        "static endpoints loaded",
                        extra={
                            "path": str(self.path),
                            "endpoints": {name: len(eps) for name, eps in snapshot.items()},
                        },
                    )
                    yield snapshot
            await asyncio.sleep(self._poll_seconds)
