"""The gap a moved stream's caller sees: from the last token before its worker's engine died to
the first from the next worker, p50 and p99, with the next worker's prefix cache cold (it never
saw the prompt) and warm (it had prefilled every prompt).

    python -m loadtests.resumption_gap [--rounds 2] [--prompt-words 300] [--path direct|relay]
        [--kill engine] [--json FILE]

Starts its own mesh on free ports (1 gateway, 2 workers, the token path `--path` names), then
runs the engine_kill scenario (tests/harness/chaos.py: 16 gRPC + 16 OpenAI streams of 1,000
tokens through the edge, the engine core of the worker with more of them SIGKILLed once both
generate) in interleaved rounds, cold then warm, each with prompts of its own of about
`prompt-words` words; each round waits for the killed worker to rejoin. `--kill worker` kills
the worker itself instead, which moves streams on the gateway path (the gateways relay them)
and on `--path relay` (the direct path through the edge's stream relay, stream_relay, the
default; the mesh's default routing); on the direct path without it they break. All traffic
goes to 127.0.0.1; every stream has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

from tests.harness.chaos import Row, ScenarioMesh, clients_first, kill_an_engine
from tests.harness.meshes import environment, own_mesh

WORDS = [
    *("engine", "token", "stream", "worker", "prefix", "cache", "batch", "decode", "prefill"),
    *("model", "answer", "mesh", "edge", "gateway", "envoy", "route", "health", "kernel"),
    *("tensor", "layer", "weight", "memory", "queue", "request", "deadline"),
]


def prompts(round_: int, words: int, seed: int) -> list[str]:
    """32 prompts of about `words` words, distinct within and across rounds."""
    rng = random.Random(seed * 1000 + round_)
    return [
        f"round {round_} stream {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        for i in range(32)
    ]


async def measure(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    direct, relay = args.path != "gateway", args.path == "relay"
    path = {
        "TOKENMESH_LOCALMESH_DIRECT_TOKEN_PATH": str(direct).lower(),
        "TOKENMESH_LOCALMESH_STREAM_RELAY": str(relay).lower(),
    }
    with environment(path), own_mesh(gateways=1, workers=2) as local_mesh:
        if local_mesh is None:
            raise SystemExit("the mesh did not come up")
        settings = local_mesh.settings
        if (settings.direct_token_path, settings.stream_relay) != (direct, relay):
            raise SystemExit(f"the mesh is not on the {args.path} token path")
        mesh = ScenarioMesh(local_mesh)
        with clients_first(local_mesh):
            for round_ in range(args.rounds):
                for warm in (False, True):
                    texts = prompts(2 * round_ + warm, args.prompt_words, args.seed)
                    name = f"round {round_ + 1} {'warm' if warm else 'cold'}"
                    whole = args.kill == "worker"
                    row = await kill_an_engine(mesh, name, texts.__getitem__, warm, whole)
                    print(f"{name}: {row.notes.get('gap')} {row.violations}", file=sys.stderr)
                    rows.append(row)
    return rows


def summary(rows: list[Row]) -> dict[str, dict[str, float | int | None]]:
    """Each condition's gaps over every round: the rows' own figures pooled by taking, per
    condition, the median of the rounds' p50 and the largest p99."""
    found: dict[str, dict[str, float | int | None]] = {}
    for condition in ("cold", "warm"):
        gaps = [r.notes["gap"] for r in rows if r.notes.get("prefix_caches") == condition]
        p50s = sorted(g["p50_ms"] for g in gaps if g["p50_ms"] is not None)
        p99s = [g["p99_ms"] for g in gaps if g["p99_ms"] is not None]
        found[condition] = {
            "rounds": len(gaps),
            "moved": sum(int(g["moved"] or 0) for g in gaps),
            "p50_ms": p50s[len(p50s) // 2] if p50s else None,
            "p99_ms": max(p99s) if p99s else None,
        }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--path", choices=("direct", "relay", "gateway"), default="direct")
    parser.add_argument("--kill", choices=("engine", "worker"), default="engine")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not 1 <= args.rounds <= 10 or not 1 <= args.prompt_words <= 800:
        parser.error("--rounds 1..10, --prompt-words 1..800 (a prompt and 1,000 tokens fit 2,048)")
    rows = asyncio.run(measure(args))
    result = {
        "path": args.path,
        "kill": args.kill,
        "summary": summary(rows),
        "rows": [asdict(row) for row in rows],
    }
    print(json.dumps(result["summary"], indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
