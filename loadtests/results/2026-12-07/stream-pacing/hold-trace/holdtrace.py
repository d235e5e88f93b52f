"""Ad-hoc: the worker's stream hold and loop lag, scraped every 50 ms during runs at 8, 32, 64 streams."""
import json, os, sys, threading, time, urllib.request
from dataclasses import replace
from pathlib import Path
from loadtests.scenarios import Bench, private_mesh
from loadtests.token_cost import OUTPUT_TOKENS, measured_run, mesh_path


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("tokenmesh_worker_stream_hold_seconds", "tokenmesh_worker_loop_lag_seconds"):
            if line.startswith(name + " "):
                out[name.split("_")[3]] = float(line.split()[1])
    return out


def main():
    out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out=out, quick=False)
    with private_mesh() as mesh:
        cores = mesh.mesh_cores(mesh.settings.worker_count(), os.cpu_count() or 1)
        path = replace(mesh_path(mesh), access_log=None, worker_log=None)
        port = path.metrics["worker"]
        for streams in (8, 32, 64):
            samples = []
            stop = threading.Event()
            def sample():
                while not stop.wait(0.05):
                    samples.append(scrape(port))
            t = threading.Thread(target=sample); t.start()
            cfg = bench.config(target=path.target, address=path.address, model=path.model,
                               concurrency=streams, processes=2 if streams >= 32 else 1, duration=8,
                               output_tokens=OUTPUT_TOKENS, cpus=cores, label=f"c={streams}", seed=1)
            res = measured_run(cfg, path)
            stop.set(); t.join()
            holds = sorted(s.get("hold", 0) for s in samples)
            lags = sorted(s.get("lag", 0) for s in samples)
            q = lambda v, p: round(1000 * v[int(p * (len(v) - 1))], 2)
            row = {"streams": streams, "samples": len(samples),
                   "hold_ms": {p: q(holds, p) for p in (0.1, 0.25, 0.5, 0.75, 0.9)},
                   "share_at_cap": round(sum(h >= 0.05 for h in holds) / len(holds), 2),
                   "share_zero": round(sum(h == 0 for h in holds) / len(holds), 2),
                   "lag_ms": {p: q(lags, p) for p in (0.1, 0.5, 0.9)},
                   "tokens_per_message": round(res["tokens_received"] / max(res["messages_received"], 1), 2),
                   "ttft_p50_ms": res["ttft_ms"]["p50_ms"]}
            print(json.dumps(row), flush=True)
            (out / f"trace-{streams}.json").write_text(json.dumps({"row": row, "samples": samples}))


if __name__ == "__main__":
    main()
