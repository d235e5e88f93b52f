"""A stand-in worker for the edge relay's unit test (tests/unit/test_relay_module.py): it serves
InferenceService.Generate (and GenerateOpenAI: each message a relayed Server-Sent Events part
that carries its Token, the last with [DONE], as the worker makes them), reading a moved
stream's delivered messages as the real worker does (common/resumption.read_delivered), and
answers token i of a stream as id 1000 + i, text "t<i> " (N bytes longer for a prompt "pad:N",
all at once for "burst:N"; for "last:N:M" the last message M bytes longer, and its trailers
LINGER seconds after it, as a busy worker's may come), one message per token, the last with
the usage as the worker's, going on from what was delivered. It records each request it
received (one JSON line: its delivered tokens and the move's attempt) and each stream its
caller cancelled ({"ended": "cancelled"}), and with DIE_AFTER=k exits hard (os._exit, as a
SIGKILLed worker) after its k-th message.

    python tests/relay_fake_worker.py PORT RECORD_FILE
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.api import httpbody_pb2

from tokenmesh.common.resumption import read_delivered
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

# Seconds between messages: slow enough that a stream is mid-way when the test acts on it.
INTERVAL = 0.01
# Seconds a "last:N" stream's trailers come after its last message.
LINGER = 2.0


class FakeWorker(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, record: Path, die_after: int) -> None:
        self._record = record
        self._die_after = die_after
        self._sent = 0

    def Generate(
        self, request: inference_pb2.InferenceRequest, context: Any
    ) -> Iterator[token_pb2.Token]:
        return self._tokens(read_delivered(request), request, context)

    def GenerateOpenAI(
        self, request: inference_pb2.InferenceRequest, context: Any
    ) -> Iterator[httpbody_pb2.HttpBody]:
        for token in self._tokens(read_delivered(request, parts=True), request, context):
            data = f"data: {json.dumps({'text': token.text})}\n\n"
            if token.HasField("usage"):
                data += "data: [DONE]\n\n"
            part = httpbody_pb2.HttpBody(content_type="text/event-stream", data=data.encode())
            part.MergeFromString(inference_pb2.RelayedPart(token=token).SerializeToString())
            yield part

    def _tokens(
        self,
        resumed: inference_pb2.InferenceRequest,
        request: inference_pb2.InferenceRequest,
        context: Any,
    ) -> Iterator[token_pb2.Token]:
        delivered = [list(c.token_ids) for c in resumed.resume.choices]
        start = len(delivered[0]) if delivered else 0
        with self._record.open("a") as record:
            line = {"delivered": delivered, "attempt": resumed.resume.attempt}
            record.write(json.dumps(line) + "\n")
            # The deadline it was given (the caller's grpc-timeout, or what was left of it),
            # and the workers the request named (the gateway's picks, less those that failed).
            # And the bytes of the delivered messages the relay sent: what it kept for a move.
            named = dict(context.invocation_metadata()).get("x-tokenmesh-worker")
            kept = sum(len(message) for message in request.delivered_messages)
            record.write(
                json.dumps(
                    {"remaining_s": context.time_remaining(), "named": named, "kept_bytes": kept}
                )
            )
            record.write("\n")
        total = request.sampling.max_tokens
        if total <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: at least 1")
        # A prompt "pad:N" makes each message's text N bytes longer, "last:N:M" the last M;
        # "burst:N" as "pad:N", every message at once (no interval).
        kind, *sizes = request.prompt.split(":")
        pad = int(sizes[0]) if kind in ("pad", "last", "burst") else 0
        last_pad = int(sizes[1]) if kind == "last" else pad
        finished: list[bool] = []
        context.add_callback(lambda: self._ended(finished))
        for i in range(start, total):
            if kind != "burst":
                time.sleep(INTERVAL)
            last = i == total - 1
            yield token_pb2.Token(
                text=f"t{i} " + "x" * (last_pad if last else pad),
                index=i,
                token_id=1000 + i,
                token_ids=[1000 + i],
                resumed=resumed.resume.attempt if i == start and start else 0,
                finish_reason=token_pb2.FINISH_REASON_LENGTH if last else 0,  # type: ignore[arg-type]
                usage=token_pb2.Usage(prompt_tokens=1, completion_tokens=total) if last else None,
            )
            self._sent += 1
            if self._die_after and self._sent >= self._die_after:
                if last:  # dies once its last message has gone, before its trailers
                    time.sleep(0.2)
                os._exit(1)
        finished.append(True)
        if kind == "last":
            time.sleep(LINGER)

    def _ended(self, finished: list[bool]) -> None:
        """When the stream ended: one that had not sent its last message was cancelled."""
        if not finished:
            with self._record.open("a") as record:
                record.write(json.dumps({"ended": "cancelled"}) + "\n")


def main() -> None:
    port, record = int(sys.argv[1]), Path(sys.argv[2])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        FakeWorker(record, int(os.environ.get("DIE_AFTER", "0"))), server
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
