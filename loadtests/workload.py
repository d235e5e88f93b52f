"""What the load generator sends: prompt and output length distributions, the requests they
make from a seed, and the Poisson arrival schedule of the open loop."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

# Prompt words; a byte-level BPE tokenizer makes one to three tokens of each.
WORDS = ("mesh", "token", "stream", "engine", "batch", "window", "envoy", "gateway", "cache")


@dataclass(frozen=True)
class Lengths:
    """A distribution of lengths: `64` (fixed), `uniform:16:128`, or `normal:64:16` (mean,
    standard deviation); every draw is clipped to [1, 100000]."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Lengths:
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            kind, a, b = parts
            if kind not in ("uniform", "normal"):
                raise ValueError(kind)
            return cls(kind, float(a), float(b))
        except ValueError:
            raise ValueError(
                f"bad length distribution {spec!r}: use N, uniform:LOW:HIGH or normal:MEAN:SD"
            ) from None

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:
            value = rng.gauss(self.a, self.b)
        return min(max(round(value), 1), 100_000)

    def __str__(self) -> str:
        return f"{self.a:g}" if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    prompt_words: Lengths
    output_tokens: Lengths
    seed: int
    # Context documents per request (the gateway reranks them), 0: none.
    documents: int = 0

    def requests(self, shard: int = 0) -> Iterator[RequestSpec]:
        """An endless, reproducible sequence of requests; shards of one run draw from
        different seeds derived from the run's."""
        rng = random.Random(f"{self.seed}:requests:{shard}")
        index = 0
        while True:
            words = self.prompt_words.draw(rng)
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            yield RequestSpec(index, prompt, self.output_tokens.draw(rng))
            index += 1


def poisson_arrivals(rate: float, seed: int, shard: int = 0) -> Iterator[float]:
    """Send times (seconds from the start) of a Poisson process of `rate` requests/s: the gaps
    are exponential with mean 1/rate, independent of how fast the target answers."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"the open loop needs a positive rate, not {rate}")
    rng = random.Random(f"{seed}:arrivals:{shard}")
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        yield at
