"""The physical limit: raw vLLM throughput on the same model and engine settings as a worker,
in-process, no gRPC (vLLM's offline `LLM.generate` on a batch of N prompts, every one asked for
the same number of tokens with ignore_eos). Run it while no mesh is up, so the engine has the
machine the worker had.

    python -m loadtests.engine_bench --batches 1,8,32 --out engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from itertools import islice
from pathlib import Path

from loadtests.workload import Lengths, Workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-llama")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--prompt-words", default="16")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="best of this many per batch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--cpu-bind", default="0", help="the cores the engine's threads use")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # The worker's settings (tokenmesh.worker.engine): the CPU backend reads these at import.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=2048, max_num_seqs=256, dtype="auto")
    sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    workload = Workload(Lengths.parse(args.prompt_words), Lengths.parse("1"), args.seed)
    llm.generate(["warm up"] * 4, sampling, use_tqdm=False)
    results = {}
    load_start = [round(v, 2) for v in os.getloadavg()]
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [spec.prompt for spec in islice(workload.requests(), batch)]
        best = 0.0
        for _ in range(args.rounds):
            started = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            elapsed = time.perf_counter() - started
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            best = max(best, tokens / elapsed)
        results[str(batch)] = round(best, 1)
        print(f"batch {batch}: {best:,.0f} tokens/s", flush=True)
    report = {
        "what": "vLLM LLM.generate in-process, no gRPC; best of rounds per batch",
        "model": args.model,
        "output_tokens": args.output_tokens,
        "cpu_bind": args.cpu_bind,
        "tokens_per_second_by_batch": results,
        "load_average_start": load_start,
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
