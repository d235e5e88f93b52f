"""The mesh's own Envoy against a second Envoy with the same settings (tests/harness/meshes.py
second_envoy: a session of its own), interleaved rounds of 64 streams: each Envoy's CPU per
token from /proc/<pid>/stat and from schedstat (ns on a CPU), and the worker's.

Run from the repository's root as a module: cp <this file> loadtests/_eab.py &&
python -m loadtests._eab 3"""
import os, sys
from pathlib import Path
from loadtests.scenarios import Bench, private_mesh
from loadtests.token_cost import mesh_path, OUTPUT_TOKENS, cpu_seconds
from loadtests.runner import run
from tests.harness.meshes import second_envoy

def sched(pids):
    total = 0
    for p in pids:
        for t in Path(f"/proc/{p}/task").iterdir():
            try: total += int((t / "schedstat").read_text().split()[0])
            except FileNotFoundError: pass
    return total / 1e9

def main():
    bench = Bench(out=Path("/tmp/probe/eab"), quick=False)
    with private_mesh() as mesh, second_envoy(mesh, mesh.run_dir) as (other, other_pid):
        path = mesh_path(mesh)
        own = path.processes["envoy"][0]
        cores = mesh.mesh_cores(mesh.settings.worker_count(), os.cpu_count() or 1)
        targets = {"own": (path.address, own), "second": (f"127.0.0.1:{other.edge_port}", other_pid)}
        for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
            for name, (address, pid) in targets.items():
                for ids in (False,):
                    cfg = bench.config(target="llm", address=address, model="", concurrency=64,
                                       processes=2, duration=5, output_tokens=OUTPUT_TOKENS, cpus=cores,
                                       label="r", seed=r + 1, request_ids=ids)
                    c0 = cpu_seconds([pid]); w0 = cpu_seconds(path.processes["worker"]); s0 = sched([pid]); sw0 = sched(path.processes["worker"])
                    res = run(cfg, show_progress=False)
                    c1 = cpu_seconds([pid]); w1 = cpu_seconds(path.processes["worker"]); s1 = sched([pid]); sw1 = sched(path.processes["worker"])
                    t = res["tokens_received"]
                    print(f"r{r} {name:6} ids={ids!s:5} tok/s {res['tokens_per_second']:7.0f} tpm {t/res['messages_received']:.2f} ttft {res['ttft_ms']['p50_ms']:6.1f} envoy {1e6*(c1-c0)/t:5.1f} us/tok worker {1e6*(w1-w0)/t:5.1f} | schedstat envoy {1e6*(s1-s0)/t:5.1f} worker {1e6*(sw1-sw0)/t:5.1f}", flush=True)

if __name__ == "__main__":
    main()
