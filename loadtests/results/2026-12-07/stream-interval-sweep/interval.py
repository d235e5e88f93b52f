"""How much merging the first token needs: the mesh's edge at stream_interval 1, 2, 3, 4 and 8
against vLLM's server placed as the mesh, interleaved rounds at 64 and 32 streams: tokens/s,
TTFT p50 / p99, tokens a message, CPU µs per token (worker + gateway + Envoy; API server).

Run from the repository's root as a module: cp <this file> loadtests/_interval.py &&
python -m loadtests._interval 2"""
import os, sys
from dataclasses import replace
from pathlib import Path
from loadtests.scenarios import Bench, openai_server, private_mesh
from loadtests.token_cost import OUTPUT_TOKENS, measured_run, mesh_path, sse_path


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    bench = Bench(out=Path("/tmp/probe/interval"), quick=False)
    with private_mesh() as mesh, openai_server(placed=True) as (address, server):
        cores = mesh.mesh_cores(mesh.settings.worker_count(), os.cpu_count() or 1)
        edge = replace(mesh_path(mesh), access_log=None, worker_log=None)
        paths = [(f"interval {i}", replace(edge, interval=i)) for i in (1, 2, 3, 4, 8)]
        paths.append(("vLLM placed", sse_path(address, server, placed=True)))
        for streams in (64, 32):
            for r in range(rounds):
                for label, path in paths:
                    cfg = bench.config(target=path.target, address=path.address, model=path.model,
                                       concurrency=streams, processes=2, duration=5,
                                       output_tokens=OUTPUT_TOKENS, stream_interval=path.interval,
                                       cpus=cores, label=label, seed=r + 1)
                    res = measured_run(cfg, path)
                    t = res["tokens_received"]
                    cpu = {k: round(1e6 * v / t, 1) for k, v in res["cpu_seconds"].items()}
                    front = sum(v for k, v in cpu.items() if k != "engine")
                    print(f"c={streams} r{r} {label:12} tok/s {res['tokens_per_second']:6.0f} "
                          f"tpm {t / max(res['messages_received'], 1):.2f} ttft {res['ttft_ms']['p50_ms']:6.1f} / {res['ttft_ms']['p99_ms']:6.1f} "
                          f"front {front:6.1f} us/tok {cpu}", flush=True)


if __name__ == "__main__":
    main()
