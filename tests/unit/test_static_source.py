"""The static endpoints file: its format (JSON or YAML), its errors, and re-reading on change
with the last good endpoints kept through a malformed edit."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tokenmesh.controlplane.endpoints import Endpoint, Snapshot
from tokenmesh.controlplane.static_source import StaticFileSource, parse_static

# Generous bound on a change being noticed (the poll interval below is 0.02 s).
NOTICED_WITHIN = 5.0
# Long enough for a wrongly produced snapshot to show up; only to show one does NOT.
QUIET = 0.3


def test_json_entries_are_addresses_or_objects_with_health() -> None:
    text = json.dumps(
        {
            "clusters": {
                "worker": ["127.0.0.1:50062", {"address": "127.0.0.1:50061", "healthy": False}],
                "gateway": ["[::1]:50050"],
                "reranker": [],
            }
        }
    )
    assert parse_static(text, yaml_syntax=False) == {
        "gateway": (Endpoint("::1", 50050),),
        "reranker": (),
        "worker": (Endpoint("127.0.0.1", 50061, healthy=False), Endpoint("127.0.0.1", 50062)),
    }


def test_yaml_means_the_same_as_json() -> None:
    text = """
clusters:
  worker:
    - 127.0.0.1:50061
    - {address: "127.0.0.1:50062", healthy: false}
"""
    as_json = '{"clusters": {"worker": ["127.0.0.1:50061",'
    as_json += ' {"address": "127.0.0.1:50062", "healthy": false}]}}'
    assert parse_static(text, yaml_syntax=True) == parse_static(as_json, yaml_syntax=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ('{"workers": {}}', '"clusters" mapping'),
        ('{"clusters": {"worker": "127.0.0.1:1"}}', "clusters.worker: expected a list"),
        ('{"clusters": {"worker": ["localhost:50061"]}}', "not an IP address"),
        ('{"clusters": {"worker": ["127.0.0.1:0"]}}', "not in 1..65535"),
        ('{"clusters": {"worker": ["127.0.0.1"]}}', "not IP:port"),
        ('{"clusters": {"worker": ["::1:50061"]}}', "[ip]:port"),
        ('{"clusters": {"worker": [{"address": "127.0.0.1:1", "up": true}]}}', "unknown keys"),
        ('{"clusters": {"worker": [{"address": "127.0.0.1:1", "healthy": "no"}]}}', "true or"),
    ],
)
def test_malformed_files_are_rejected_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_static(text, yaml_syntax=False)


class Watch:
    """Runs a source's snapshots() into a queue in the background."""

    def __init__(self, source: StaticFileSource) -> None:
        self.errors = 0
        self.snapshots: asyncio.Queue[Snapshot] = asyncio.Queue()
        source._on_error = self._error
        self._task = asyncio.create_task(self._run(source))

    def _error(self) -> None:
        self.errors += 1

    async def _run(self, source: StaticFileSource) -> None:
        async for snapshot in source.snapshots():
            self.snapshots.put_nowait(snapshot)

    async def next(self) -> Snapshot:
        return await asyncio.wait_for(self.snapshots.get(), NOTICED_WITHIN)

    async def nothing_within(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        assert self.snapshots.empty(), self.snapshots.get_nowait()

    async def until_errors(self, count: int) -> None:
        async with asyncio.timeout(NOTICED_WITHIN):
            while self.errors < count:  # noqa: ASYNC110 (a counter, not an event)
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


def write(path: Path, clusters: dict[str, list[str]] | str) -> None:
    """Write atomically (temp file + rename), as editors and ConfigMap updates do."""
    text = clusters if isinstance(clusters, str) else json.dumps({"clusters": clusters})
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[Path, Watch]]:
    path = tmp_path / "endpoints.json"
    write(path, {"worker": ["127.0.0.1:50061"]})
    watch = Watch(StaticFileSource(path, poll_seconds=0.02))
    try:
        yield path, watch
    finally:
        await watch.stop()


async def test_edits_are_picked_up(watched: tuple[Path, Watch]) -> None:
    path, watch = watched
    assert await watch.next() == {"worker": (Endpoint("127.0.0.1", 50061),)}
    write(path, {"worker": ["127.0.0.1:50061", "127.0.0.1:50062"]})
    assert (await watch.next())["worker"][1] == Endpoint("127.0.0.1", 50062)
    # An in-place rewrite (no rename, same inode) is seen too.
    path.write_text(json.dumps({"clusters": {"gateway": ["127.0.0.1:50050"]}}))
    assert await watch.next() == {"gateway": (Endpoint("127.0.0.1", 50050),)}


async def test_a_malformed_edit_is_reported_and_yields_nothing(
    watched: tuple[Path, Watch],
) -> None:
    path, watch = watched
    await watch.next()
    write(path, '{"clusters": {"worker": ["127.0.0.1:50061",')  # half-written
    await watch.until_errors(1)
    await watch.nothing_within(QUIET)  # the last good snapshot stays the one served
    write(path, {"worker": ["127.0.0.1:50063"]})
    assert await watch.next() == {"worker": (Endpoint("127.0.0.1", 50063),)}
    assert watch.errors == 1  # reported once per bad version, not once per poll


async def test_a_deleted_file_keeps_the_last_endpoints_until_it_returns(
    watched: tuple[Path, Watch],
) -> None:
    path, watch = watched
    await watch.next()
    path.unlink()
    await watch.until_errors(1)
    await watch.nothing_within(QUIET)
    write(path, {"worker": ["127.0.0.1:50064"]})
    assert await watch.next() == {"worker": (Endpoint("127.0.0.1", 50064),)}
