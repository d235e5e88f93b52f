"""What the load generator sends: prompt and output length distributions, the requests they
make from a seed (optionally after shared prefixes), and the open loop's Poisson schedule."""

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
    # The shared prefix the prompt starts with (Workload.prefixes), -1: none.
    prefix: int = -1
    # The x-request-id the request carries (llm target; "": none, Envoy makes one).
    request_id: str = ""


@dataclass(frozen=True)
class Workload:
    prompt_words: Lengths
    output_tokens: Lengths
    seed: int
    # Context documents per request (the gateway reranks them), 0: none.
    documents: int = 0
    # Shared prefixes: each request is one of `prefixes` prefixes of prefix_words words, then a
    # suffix of its own (prompt_words words); 0: every prompt is its own.
    prefixes: int = 0
    prefix_words: int = 0
    # The share of requests that take prefix 0 (skew); the rest spread evenly over the others.
    # 0: every prefix equally.
    prefix_share: float = 0.0
    # The words' seed (0: seed): one seed with several text seeds gives the same arrivals,
    # lengths and prefix choices with different text, so no run reuses another's KV cache.
    text_seed: int = 0

    def __post_init__(self) -> None:
        if self.prefixes < 0 or (self.prefixes > 0) != (self.prefix_words > 0):
            raise ValueError("prefixes and prefix_words go together, both positive or both 0")
        if not 0 <= self.prefix_share < 1:
            raise ValueError(f"prefix_share is in [0, 1), not {self.prefix_share}")
        if self.prefix_share and self.prefixes < 2:
            raise ValueError("a prefix_share needs at least 2 prefixes")
        if self.text_seed < 0:
            raise ValueError("text_seed must not be negative")

    def requests(self, shard: int = 0) -> Iterator[RequestSpec]:
        """An endless, reproducible sequence of requests; shards of one run draw from
        different seeds derived from the run's."""
        if self.prefixes or self.text_seed:
            yield from self._shared_requests(shard)
            return
        rng = random.Random(f"{self.seed}:requests:{shard}")
        index = 0
        while True:
            words = self.prompt_words.draw(rng)
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            yield RequestSpec(index, prompt, self.output_tokens.draw(rng))
            index += 1

    def shared_prefixes(self) -> list[str]:
        """The prefixes, the same in every shard (from the text seed)."""
        rng = random.Random(f"{self.text_seed or self.seed}:prefixes")
        return [
            " ".join(rng.choice(WORDS) for _ in range(self.prefix_words))
            for _ in range(self.prefixes)
        ]

    def prefix_index(self, rng: random.Random) -> int:
        """Which prefix a request takes: 0 with probability prefix_share, else any other
        evenly (any of them, without a share)."""
        if not self.prefix_share:
            return rng.randrange(self.prefixes)
        if rng.random() < self.prefix_share:
            return 0
        return rng.randrange(1, self.prefixes)

    def _shared_requests(self, shard: int) -> Iterator[RequestSpec]:
        """Lengths and prefix choices from the seed, words from the text seed; a suffix starts
        with the request's shard and index, so no two requests of a run are alike."""
        shape = random.Random(f"{self.seed}:requests:{shard}")
        text = random.Random(f"{self.text_seed or self.seed}:text:{shard}")
        prefixes = self.shared_prefixes()
        index = 0
        while True:
            chosen = self.prefix_index(shape) if prefixes else -1
            words = " ".join(text.choice(WORDS) for _ in range(self.prompt_words.draw(shape)))
            max_tokens = self.output_tokens.draw(shape)
            own = f"request {shard}.{index}: {words}"
            prompt = words if chosen < 0 else f"{prefixes[chosen]} {own}"
            yield RequestSpec(index, prompt, max_tokens, chosen)
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
