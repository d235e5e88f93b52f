"""The worker's own Python per token on the OpenAI path, without gRPC or vLLM: the tree's real
InferenceServicer.GenerateOpenAI (validate, admission, Generate, _generate, token_message,
stream metrics, the OpenAI presentation, HttpBody) over a fake engine that yields the tree's
Tokens (one token per output, 128 per request, as the benchmark's requests), C streams at once.
Prints CPU µs per token (process_time). Run with cwd and PYTHONPATH in a tree.

    micro.py [REQUESTS] [STREAMS] [--profile OUT.txt]
"""
import asyncio, inspect, sys, time
import contextlib

from prometheus_client import CollectorRegistry, Counter

from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.v1 import inference_pb2, token_pb2
from tokenmesh.worker import servicer as servicer_module
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineSlot

try:
    from tokenmesh.worker.outputs import Tokens
    AFTER = True
except ImportError:
    from tokenmesh.worker.engine import Tokens
    AFTER = False

OUTPUT = 128
PIECES = [" ab", "cd", " efg", "h", " ij", "klm", "n", " op"]


class Load:
    waiting = 0


class FakeEngine:
    load = Load()
    max_num_seqs = 256

    async def stream(self, spec, on_abort=None):
        for i in range(OUTPUT):
            await asyncio.sleep(0)
            last = i == OUTPUT - 1
            tokens = Tokens(i, [1000 + i % 50], PIECES[i % len(PIECES)], prompt_tokens=17)
            if last:
                tokens.finish_reason = token_pb2.FINISH_REASON_LENGTH
                if AFTER:
                    tokens.last, tokens.completion_tokens = True, OUTPUT
            yield tokens

    async def abort(self, ids):
        pass


class Context:
    def __init__(self):
        self.sent = 0

    def set_trailing_metadata(self, md):
        pass

    async def send_initial_metadata(self, md):
        pass

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return 119.0

    def add_done_callback(self, cb):
        pass

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def cancelled(self):
        return False

    def code(self):
        return None


def request(number):
    r = inference_pb2.InferenceRequest(prompt=f"word {number} " * 8)
    r.sampling.max_tokens = OUTPUT
    r.sampling.ignore_eos = True
    r.openai.stream = True
    r.openai.include_usage = True
    r.openai.model = "tiny-llama"
    r.openai.id = f"cmpl-{number:032x}"
    r.openai.created = 1765000000
    r.openai.time_limit_seconds = 120
    return r


async def main(requests, streams):
    registry = CollectorRegistry()
    settings = WorkerSettings()
    metrics = StreamMetrics(registry)
    aborted = Counter("aborted", "x", ["reason"], registry=registry)
    slot = EngineSlot()
    slot.set(FakeEngine())
    args = [slot, settings, metrics, aborted]
    if "features" in inspect.signature(servicer_module.InferenceServicer.__init__).parameters:
        args.append(Counter("features", "x", ["feature"], registry=registry))
    servicer = servicer_module.InferenceServicer(*args)
    queue = list(range(requests))
    tokens = 0
    size = 0

    async def client():
        nonlocal tokens, size
        while queue:
            number = queue.pop()
            async with contextlib.aclosing(servicer.GenerateOpenAI(request(number), Context())) as parts:
                async for body in parts:
                    size += len(body.data)
            tokens += OUTPUT

    # A warm-up pass, then the measured one.
    await asyncio.gather(*(client() for _ in range(streams)))
    queue.extend(range(requests))
    tokens = size = 0
    started = time.process_time()
    await asyncio.gather(*(client() for _ in range(streams)))
    cpu = time.process_time() - started
    print(f"{'after' if AFTER else 'before'}: {cpu * 1e6 / tokens:.2f} µs/token "
          f"({tokens} tokens, {size / tokens:.1f} bytes/token, {cpu:.2f} s)", flush=True)


if __name__ == "__main__":
    positional = [a for a in sys.argv[1:] if a.isdigit()]
    requests = int(positional[0]) if positional else 300
    streams = int(positional[1]) if len(positional) > 1 else 32
    import uvloop
    uvloop.install()
    asyncio.run(main(requests, streams))
