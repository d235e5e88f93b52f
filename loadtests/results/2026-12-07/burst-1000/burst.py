"""Ad-hoc: a burst of N new streams at once on a private mesh: when each request left Envoy for
the worker (arrival -> upstream sent), from the edge's access log; and the client's TTFT."""
import json, os, sys, time
from dataclasses import replace
from pathlib import Path
from loadtests import first_token_stages as fts
import contextlib
from loadtests.scenarios import Bench, openai_server, private_mesh
from loadtests.token_cost import measured_run, mesh_path, sse_path
from tests.harness.meshes import environment


def pct(values, q):
    values = sorted(values)
    return round(fts.percentile(values, q), 1) if values else None


def main():
    out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    env = dict(a.split("=", 1) for a in sys.argv[4:])
    bench = Bench(out=out, quick=False)
    results = []
    with contextlib.ExitStack() as stack:
        with environment(env):
            mesh = stack.enter_context(private_mesh())
        address, server = stack.enter_context(openai_server(placed=True))
        vllm = sse_path(address, server, placed=True)
        cores = mesh.mesh_cores(mesh.settings.worker_count(), os.cpu_count() or 1)
        path = mesh_path(mesh)
        warm = bench.config(target=path.target, address=path.address, model=path.model,
                            concurrency=8, duration=3, output_tokens="16", cpus=cores, label="warm")
        measured_run(warm, replace(path, access_log=None, worker_log=None))
        for r in range(rounds):
            log = fts.EdgeLog(path.access_log)
            cfg = bench.config(target=path.target, address=path.address, model=path.model,
                               concurrency=n, requests=n, processes=2, warmup=0.0, duration=120.0,
                               timeout=120.0, output_tokens="16", cpus=cores, request_ids=True,
                               label=f"burst {n}", seed=r + 1)
            res = measured_run(cfg, replace(path, access_log=None, worker_log=None))
            time.sleep(3)
            lines = fts.edge_times(log.lines())
            sent = [t.upstream_sent_us / 1000 for t in lines.values()]
            prep = [t.prepare_us / 1000 for t in lines.values()]
            row = {"round": r, "requests": res["requests"], "errors": res.get("errors"),
                   "edge_lines": len(lines),
                   "arrival_to_sent_ms": {"p50": pct(sent, .5), "p99": pct(sent, .99), "max": pct(sent, 1)},
                   "prepare_ms": {"p50": pct(prep, .5), "p99": pct(prep, .99)},
                   "client_ttft_ms": {k: res["ttft_ms"].get(k) for k in ("p50_ms", "p99_ms", "max_ms")},
                   "start_spread_ms": res.get("generator", {}).get("start_spread_ms"),
                   "cpu_seconds": {k: round(v, 2) for k, v in res["cpu_seconds"].items()}}
            print(json.dumps(row), flush=True)
            results.append(row)
            vcfg = bench.config(target=vllm.target, address=vllm.address, model=vllm.model,
                                concurrency=n, requests=n, processes=2, warmup=0.0, duration=120.0,
                                timeout=120.0, output_tokens="16", cpus=cores,
                                label=f"vLLM burst {n}", seed=r + 1)
            vres = measured_run(vcfg, vllm)
            vrow = {"round": r, "vllm_placed": True, "requests": vres["requests"], "errors": vres.get("errors"),
                    "client_ttft_ms": {k: vres["ttft_ms"].get(k) for k in ("p50_ms", "p99_ms", "max_ms")},
                    "cpu_seconds": {k: round(v, 2) for k, v in vres["cpu_seconds"].items()}}
            print(json.dumps(vrow), flush=True)
            results.append(vrow)
    (out / f"burst-{n}.json").write_text(json.dumps({"env": env, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
