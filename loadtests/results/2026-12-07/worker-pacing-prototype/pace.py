"""Probe of the prototype in pacing.diff (apply it first): a mesh whose worker paces its streams while its server loop is behind
(PACE_LAG s of delivery lag, then each stream waits lag*PACE_FACTOR, at most PACE_CAP, before
its next message) against one that does not, and vLLM's server placed; interleaved rounds."""
import contextlib, os, sys
from dataclasses import replace
from pathlib import Path
from loadtests.scenarios import Bench, openai_server, private_mesh
from loadtests.token_cost import OUTPUT_TOKENS, measured_run, mesh_path, sse_path
from tests.harness.meshes import environment


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    pace = dict(a.split("=", 1) for a in sys.argv[2:]) or {"PACE_LAG": "0.002"}
    bench = Bench(out=Path("/tmp/probe/pace"), quick=False)
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(private_mesh())
        with environment(pace):
            paced = stack.enter_context(private_mesh())
        address, server = stack.enter_context(openai_server(placed=True))
        cores = plain.mesh_cores(plain.settings.worker_count(), os.cpu_count() or 1)
        paths = [("plain", replace(mesh_path(plain), access_log=None, worker_log=None)),
                 ("paced " + ",".join(f"{k}={v}" for k, v in pace.items()), replace(mesh_path(paced), access_log=None, worker_log=None)),
                 ("vLLM placed", sse_path(address, server, placed=True))]
        for streams in (64, 32, 8):
            for r in range(rounds):
                for label, path in paths:
                    cfg = bench.config(target=path.target, address=path.address, model=path.model,
                                       concurrency=streams, processes=2 if streams >= 32 else 1, duration=5,
                                       output_tokens=OUTPUT_TOKENS, cpus=cores, label=label, seed=r + 1)
                    res = measured_run(cfg, path)
                    t = res["tokens_received"]
                    cpu = {k: round(1e6 * v / t, 1) for k, v in res["cpu_seconds"].items()}
                    front = sum(v for k, v in cpu.items() if k != "engine")
                    print(f"c={streams} r{r} {label:28} tok/s {res['tokens_per_second']:6.0f} "
                          f"tpm {t / max(res['messages_received'], 1):.2f} ttft {res['ttft_ms']['p50_ms']:6.1f} / {res['ttft_ms']['p99_ms']:6.1f} "
                          f"itl p50/p99 {res['itl_ms']['p50_ms']:.1f}/{res['itl_ms']['p99_ms']:.1f} front {front:6.1f} us/tok", flush=True)


if __name__ == "__main__":
    main()
