"""The ops page's static files over HTTP (Envoy's edge routes /ops/ here), read on each request."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

NOT_BUILT = "the ops page is not built: run `make ops-page` (it builds into ops/dist)\n"
# The bundle's names are fixed (no content hashes): browsers must revalidate each load.
NO_CACHE = {"Cache-Control": "no-cache"}


def locate(directory: Path, name: str) -> Path | None:
    """directory/name if it is a plain file directly inside directory (no "..", no
    subdirectories)."""
    path = (directory / name).resolve()
    if path.parent != directory.resolve() or not path.is_file():
        return None
    return path


def page_app(directory: Path | None) -> web.Application:
    """/ops/ is index.html; /ops/<file> a file of directory; 404 with a hint when not built."""

    async def index(request: web.Request) -> web.StreamResponse:
        return await asset(request, "index.html")

    async def named(request: web.Request) -> web.StreamResponse:
        return await asset(request, request.match_info["name"])

    async def asset(request: web.Request, name: str) -> web.StreamResponse:
        if directory is None:
            return web.Response(status=404, text=NOT_BUILT)
        path = await asyncio.to_thread(locate, directory, name)
        if path is None:
            missing = NOT_BUILT if name == "index.html" else f"no such file: {name}\n"
            return web.Response(status=404, text=missing)
        return web.FileResponse(path, headers=NO_CACHE)

    app = web.Application()
    app.router.add_get("/ops/", index)
    app.router.add_get("/ops/{name}", named)
    return app


class PageServer:
    """Serves page_app on host:port until stopped (port 0: a free port; -1: off)."""

    def __init__(self, directory: Path | None, host: str, port: int) -> None:
        self._runner = web.AppRunner(page_app(directory), access_log=None)
        self._host = host
        self._port = port

    async def start(self) -> int:
        """Start serving; returns the bound port, or -1 when disabled."""
        if self._port < 0:
            return -1
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        await self._runner.cleanup()
