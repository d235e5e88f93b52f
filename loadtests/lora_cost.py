"""What LoRA costs the tiny model's engine on this machine: vLLM's AsyncLLM alone (no mesh),
with LoRA off (compiled, as a worker without adapters runs), off but eager, and on (vLLM runs
an engine with LoRA eagerly on CPU) for the model's own requests and for its adapter's.
Each engine is started in a process of its own, one after another in one run, on core 0;
each measures `--rounds` rounds of `--streams` greedy streams of `--tokens` tokens.

    python -m loadtests.lora_cost [--rounds 3 --streams 16 --tokens 256] [--out DIR]

Prints a table (tokens/s, CPU µs per token of the engine's processes, start seconds) and
writes it with every round as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-llama"
ADAPTER = ROOT / "models" / "tiny-llama-lora"
MODES = ("off", "eager", "lora_model", "lora_adapter")


async def measure(mode: str, rounds: int, streams: int, tokens: int) -> dict[str, Any]:
    """One engine in this process: its start time and each round's figures."""
    import psutil
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    lora = mode.startswith("lora")
    args = AsyncEngineArgs(
        model=str(MODEL),
        max_model_len=2048,
        enable_lora=lora,
        max_lora_rank=8 if lora else 16,
        enforce_eager=mode == "eager",
    )
    started = time.monotonic()
    llm = AsyncLLM.from_engine_args(args)
    adapter = None
    if mode == "lora_adapter":
        adapter = LoRARequest(ADAPTER.name, 1, str(ADAPTER))
        await llm.add_lora(adapter)
    start_seconds = time.monotonic() - started
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)

    def cpu() -> float:
        total = 0.0
        for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    async def one(i: int) -> int:
        made = 0
        async for output in llm.generate(
            f"prompt {i} once upon", params, uuid.uuid4().hex, lora_request=adapter
        ):
            made = len(output.outputs[0].token_ids)
        return made

    await asyncio.gather(*(one(i) for i in range(4)))  # warm up
    measured = []
    for _ in range(rounds):
        cpu_before, wall_before = cpu(), time.monotonic()
        made = sum(await asyncio.gather(*(one(i) for i in range(streams))))
        cpu_after, wall_after = cpu(), time.monotonic()
        measured.append(
            {
                "tokens_per_second": round(made / (wall_after - wall_before)),
                "cpu_us_per_token": round((cpu_after - cpu_before) / made * 1e6, 1),
            }
        )
    llm.shutdown()
    return {"mode": mode, "start_seconds": round(start_seconds, 1), "rounds": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one engine, here
    args = parser.parse_args()
    if args.mode:
        result = asyncio.run(measure(args.mode, args.rounds, args.streams, args.tokens))
        print("RESULT " + json.dumps(result), flush=True)
        return
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    results = []
    for mode in MODES:
        command = [sys.executable, "-m", "loadtests.lora_cost", "--mode", mode]
        command += ["--rounds", str(args.rounds), "--streams", str(args.streams)]
        command += ["--tokens", str(args.tokens)]
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=True
        )
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(line.removeprefix("RESULT ")))
    lines = ["| engine | tokens/s | CPU µs per token | start s |", "|---|---|---|---|"]
    for result in results:
        rates = [r["tokens_per_second"] for r in result["rounds"]]
        costs = [r["cpu_us_per_token"] for r in result["rounds"]]
        lines.append(
            f"| {result['mode']} | {min(rates):,} to {max(rates):,} | "
            f"{min(costs)} to {max(costs)} | {result['start_seconds']} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        (args.out / "README.md").write_text(
            "# LoRA's cost to the tiny model's engine (CPU)\n\n"
            f"`python -m loadtests.lora_cost --rounds {args.rounds} --streams {args.streams} "
            f"--tokens {args.tokens}`\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
