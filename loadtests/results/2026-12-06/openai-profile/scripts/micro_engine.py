"""The worker's own Python per engine output on the engine's thread, without vLLM: the tree's
real VllmEngine._produce (and after #32 _generate) over a fake AsyncLLM.generate yielding
vLLM-like DELTA outputs of one token each (128 a request), C requests at once, each posting to
a list. Tokenizing and the sampling parameters are faked (constant). CPU µs per token."""
import asyncio, sys, time
from types import SimpleNamespace

from tokenmesh.v1 import inference_pb2
from tokenmesh.worker import engine as engine_module
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.requests import validate

OUTPUT = 128
PIECES = [" ab", "cd", " efg", "h", " ij", "klm", "n", " op"]
AFTER = hasattr(engine_module.VllmEngine, "_generate")


class FakeLLM:
    async def generate(self, engine_input, params, request_id):
        for i in range(OUTPUT):
            await asyncio.sleep(0)
            last = i == OUTPUT - 1
            completion = SimpleNamespace(
                index=0, token_ids=[1000 + i % 50], text=PIECES[i % len(PIECES)],
                finish_reason="length" if last else None, logprobs=None)
            yield SimpleNamespace(outputs=[completion], finished=last, prompt_logprobs=None)


class Activity:
    def request_started(self): pass
    def request_ended(self): pass


def fake_engine():
    fake = SimpleNamespace()
    fake._llm = FakeLLM()
    fake.activity = Activity()
    made = {"prompt_token_ids": list(range(17))}

    async def tokenize(spec, *rest):
        return made, OUTPUT
    fake._tokenize = tokenize
    params = object()
    if AFTER:
        fake._parsers = SimpleNamespace(for_request=lambda options: None)
        fake._sampling = SimpleNamespace(params=lambda *a, **k: params)
        fake._generate = lambda *a: engine_module.VllmEngine._generate(fake, *a)
        fake._post_end = engine_module.VllmEngine._post_end
    else:
        fake._sampling_params = lambda spec, mt: params
    return fake


def request(number):
    r = inference_pb2.InferenceRequest(prompt=f"word {number} " * 8)
    r.sampling.max_tokens = OUTPUT
    r.sampling.ignore_eos = True
    return r


async def main(requests, streams):
    settings = WorkerSettings()
    fake = fake_engine()
    specs = [validate(request(n), settings) for n in range(streams)]
    posted = [0]

    def post(item):
        posted[0] += 1
    queue = []

    async def client():
        while queue:
            spec = specs[queue.pop() % streams]
            await engine_module.VllmEngine._produce(fake, spec, post)

    for measured in (False, True):
        queue.extend(range(requests))
        posted[0] = 0
        started = time.process_time()
        await asyncio.gather(*(client() for _ in range(streams)))
        cpu = time.process_time() - started
    tokens = requests * OUTPUT
    assert posted[0] == requests * (OUTPUT + 1), posted
    print(f"{'after' if AFTER else 'before'} engine loop: {cpu * 1e6 / tokens:.2f} µs/token", flush=True)


if __name__ == "__main__":
    import uvloop
    uvloop.install()
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300, 32))
