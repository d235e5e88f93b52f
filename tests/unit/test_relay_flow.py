"""The edge's stream relay (envoy/relay/tokenmesh_relay.c) towards a caller that reads slower
than its worker writes, with Envoy's side of the module ABI faked (tests/relay_fake_envoy.c):
the test hands the relay the worker's bytes in the pieces it chooses (Envoy hands over a
frame, or what it buffered for the stream, at once), and plays the caller's HTTP/2 codec, whose
watermarks reach the relay from inside its sends as Envoy's do. Inside a real Envoy, with
real streams, the relay is tests/unit/test_relay_module.py."""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Iterator

import pytest

from tests.support import ROOT, require_c_compiler
from tokenmesh.localmesh.relay_module import FLAGS, RELAY_SOURCE, c_compiler
from tokenmesh.v1 import inference_pb2, token_pb2

FAKE_ENVOY = ROOT / "tests" / "relay_fake_envoy.c"
WINDOW = 65536
# The relay's default: the most it sends on before it reads the caller's watermark again.
BATCH = 16384
CONFIG = f"cluster=worker;max_resumptions=0;max_held_bytes={WINDOW}"


def framed(message: bytes) -> bytes:
    return b"\0" + len(message).to_bytes(4, "big") + message


def token(i: int, pad: int = 300) -> bytes:
    """Token i of a stream: ~330 bytes framed, as a token with its logprobs is (pad: the
    bytes of its text)."""
    return framed(
        token_pb2.Token(
            text=f"t{i} " + "x" * pad, index=i, token_id=1000 + i, token_ids=[1000 + i]
        ).SerializeToString()
    )


def messages(data: bytes) -> list[token_pb2.Token]:
    """The whole gRPC messages in data, which must hold nothing else."""
    found, at = [], 0
    while at < len(data):
        length = int.from_bytes(data[at + 1 : at + 5], "big")
        found.append(token_pb2.Token.FromString(data[at + 5 : at + 5 + length]))
        at += 5 + length
    assert at == len(data), "a message was cut"
    return found


class FakeEnvoy:
    """One relay filter over the fake's caller codec and worker streams."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        for name in (
            "fake_sent",
            "fake_max_waiting",
            "fake_request_size",
            "fake_sends",
            "fake_sliced",
        ):
            getattr(library, name).restype = ctypes.c_size_t
        for name in ("fake_streams", "fake_resets"):
            getattr(library, name).restype = ctypes.c_uint64
        for name in ("fake_caller_bytes", "fake_request_bytes"):
            getattr(library, name).restype = ctypes.c_void_p
        library.fake_start.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        library.fake_worker_data.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        library.fake_caller_reads.argtypes = [ctypes.c_size_t]
        self._body = framed(
            inference_pb2.InferenceRequest(
                prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=5000)
            ).SerializeToString()
        )

    def start(self, config: str = CONFIG) -> None:
        started = self._lib.fake_start(
            config.encode(), WINDOW, WINDOW // 2, self._body, len(self._body)
        )
        assert started, "the relay started no worker stream"
        self._lib.fake_worker_headers()

    def worker_sends(self, data: bytes) -> None:
        self._lib.fake_worker_data(data, len(data))

    def run_posted(self) -> None:
        self._lib.fake_run_posted()

    def caller_reads_everything(self) -> None:
        self._lib.fake_caller_reads(self.sent)

    @property
    def sent(self) -> int:
        return int(self._lib.fake_sent())

    @property
    def sends(self) -> int:
        return int(self._lib.fake_sends())

    @property
    def sliced(self) -> int:
        return int(self._lib.fake_sliced())

    @property
    def max_waiting(self) -> int:
        return int(self._lib.fake_max_waiting())

    @property
    def streams(self) -> int:
        return int(self._lib.fake_streams())

    @property
    def resets(self) -> int:
        return int(self._lib.fake_resets())

    def caller_bytes(self) -> bytes:
        return ctypes.string_at(self._lib.fake_caller_bytes(), self.sent) if self.sent else b""

    def last_request(self) -> inference_pb2.InferenceRequest:
        body = ctypes.string_at(self._lib.fake_request_bytes(), self._lib.fake_request_size())
        request = inference_pb2.InferenceRequest()
        request.ParseFromString(body[5:])
        return request

    def end(self) -> None:
        self._lib.fake_end()


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    require_c_compiler()
    out = tmp_path_factory.mktemp("relay-flow") / "relay_flow.so"
    relay = ROOT / RELAY_SOURCE
    sources = [str(path) for path in sorted(relay.glob("*.c"))] + [str(FAKE_ENVOY)]
    subprocess.run([str(c_compiler()), *FLAGS, f"-I{relay}", "-o", str(out), *sources], check=True)
    return ctypes.CDLL(str(out))


@pytest.fixture
def envoy(library: ctypes.CDLL) -> Iterator[FakeEnvoy]:
    fake = FakeEnvoy(library)
    fake.start()
    try:
        yield fake
    finally:
        fake.end()


def test_each_message_goes_to_a_caller_that_keeps_up_at_once(envoy: FakeEnvoy) -> None:
    """A worker's messages one at a time, the caller reading each: every one is sent the
    moment it came, and the worker's stream is never parked."""
    sent = 0
    for i in range(300):
        envoy.worker_sends(token(i))
        sent += len(token(i))
        assert envoy.sent == sent
        envoy.caller_reads_everything()
        envoy.run_posted()
    assert envoy.resets == 0
    assert [t.index for t in messages(envoy.caller_bytes())] == list(range(300))


def test_a_burst_handed_over_at_once_passes_a_stalled_caller_only_a_batch(
    envoy: FakeEnvoy,
) -> None:
    """Envoy hands the relay 1,000 messages (330 KB) at once while the caller's codec still
    has room: the relay sends them a batch at a time and holds what follows the batch that
    took the codec over its watermark, parks the worker once it holds a window, and drops
    the rest; once the caller reads, it gets the held messages and the stream goes on from
    the last one delivered, whole and in order."""
    envoy.worker_sends(token(0))
    burst = b"".join(token(i) for i in range(1, 1001))
    envoy.worker_sends(burst)
    # Past the watermark by at most a batch and a message, not by the burst.
    assert envoy.max_waiting <= WINDOW + BATCH + len(token(0))
    envoy.run_posted()
    assert envoy.resets == 1, "the worker's stream was not parked"
    for _ in range(10):
        if envoy.streams == 2:
            break
        envoy.caller_reads_everything()
        envoy.run_posted()
    assert envoy.streams == 2, "the parked stream never went on"
    delivered = messages(envoy.caller_bytes())
    assert [t.index for t in delivered] == list(range(len(delivered)))
    assert WINDOW < len(envoy.caller_bytes()) < len(burst)
    # The next worker is told every message the caller got, and goes on after the last.
    assert len(envoy.last_request().delivered_messages) == len(delivered)


@pytest.mark.parametrize("pad", [300, 1000, 5000, 9000])
def test_what_the_relay_sends_envoy_copies_or_keeps_in_whole_pages(
    envoy: FakeEnvoy, pad: int
) -> None:
    """Envoy keeps a piece of 512 bytes or more a filter sends as a slice of whole 4 KiB pages
    (a 1 KB message: 4 KiB while it waits for a stalled caller): the relay sends whole pages
    whole and the rest in pieces under 512 bytes, messages one at a time, a burst, or what it
    held, and the caller gets the same bytes."""
    sent = b""
    for i in range(50):
        envoy.worker_sends(token(i, pad))
        sent += token(i, pad)
        envoy.caller_reads_everything()
        envoy.run_posted()
    burst = b"".join(token(i, pad) for i in range(50, 150))
    envoy.worker_sends(burst)
    for _ in range(10):
        envoy.caller_reads_everything()
        envoy.run_posted()
    assert envoy.sends > 50
    assert envoy.sliced == 0
    delivered = messages(envoy.caller_bytes())
    assert envoy.caller_bytes().startswith(sent)
    assert [t.index for t in delivered] == list(range(len(delivered)))
