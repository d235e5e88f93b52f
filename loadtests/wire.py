"""A byte-counting TCP relay on 127.0.0.1: the generator connects through it, so the bytes on
the wire (HTTP/2 frames and headers, or HTTP/1.1 and SSE framing; TCP/IP headers excluded) are
counted exactly in both directions, whatever the protocol."""

from __future__ import annotations

import asyncio
import contextlib

from loadtests.targets import check_local


class ByteCounter:
    def __init__(self, upstream: str) -> None:
        check_local(upstream)
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self.sent = 0  # client -> server
        self.received = 0  # server -> client
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        assert self._server is not None, "start the relay first"
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, upstream=True)),
            asyncio.create_task(self._pipe(up_reader, writer, upstream=False)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool
    ) -> None:
        try:
            while chunk := await reader.read(65536):
                if upstream:
                    self.sent += len(chunk)
                else:
                    self.received += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()
