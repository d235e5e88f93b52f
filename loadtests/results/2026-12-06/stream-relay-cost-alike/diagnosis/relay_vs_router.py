import glob, sys, os, json, threading, time, urllib.request
sys.path[:0] = ["/work/main/services", "/work/main"]
from pathlib import Path
from loadtests.token_cost import *
from loadtests.token_cost import private_mesh, second_envoy, Bench, interleaved, summary_row, compare, markdown, mesh_path, other_path, OUTPUT_TOKENS

ROUNDS = int(os.environ.get("ROUNDS", "3"))
C = int(os.environ.get("C", "64"))
def sampler(admin, stop, out):
    while not stop.is_set():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=(upstream_rq_active|upstream_rq_pending_active|downstream_rq_active|flow_control|upstream_cx_active)", timeout=2).read().decode()
            out.append((time.time(), {l.split(":")[0]: l.split(":")[1].strip() for l in text.splitlines() if ":" in l and l.split(":")[1].strip() not in ("0",)}))
        except Exception as e:
            out.append((time.time(), str(e)))
        stop.wait(0.5)

def main():
    bench = Bench(Path("/tmp/gap/out"), False)
    with private_mesh() as lm, second_envoy(lm, lm.run_dir, stream_relay=True, worker_routing="least_request") as (other, pid), second_envoy(lm, lm.run_dir, worker_routing="least_request") as (plain, plain_pid):
        mesh = mesh_path(lm)
        from dataclasses import replace as _r
        paths = [_r(other_path(mesh, plain, plain_pid), label='second envoy router'), other_path(mesh, other, pid)]
        cores = lm.mesh_cores(lm.settings.worker_count(), os.cpu_count() or 1)
        configs = [bench.config(target=p.target, address=p.address, model=p.model, concurrency=C, processes=2, duration=bench.round_seconds, output_tokens=OUTPUT_TOKENS, stream_interval=0, structured_json="", cpus=cores, label=f"{p.label} c={C}") for p in paths]
        stop = threading.Event(); samples = []
        t = threading.Thread(target=sampler, args=(other.admin_port, stop, samples), daemon=True); t.start()
        from loadtests.token_cost import measured_run, combined_run
        from dataclasses import replace
        per = {}
        for n in range(ROUNDS):
            for cfg, p in zip(configs, paths):
                def delay(pids):
                    tot = 0
                    for pid in pids:
                        for t in __import__("glob").glob(f"/proc/{pid}/task/*/schedstat"):
                            try: tot += int(open(t).read().split()[1])
                            except Exception: pass
                    return tot
                pids = {k: v for k, v in p.processes.items()}
                before = {k: delay(v) for k, v in pids.items()}
                r = measured_run(replace(cfg, seed=n + 1), p)
                after = {k: delay(v) for k, v in pids.items()}
                print("RUNDELAY", p.label, n, {k: round((after[k]-before[k])/1e9, 2) for k in pids}, flush=True)
                per.setdefault(p.label, []).append(r)
                print(p.label, n, r["tokens_per_second"], r.get("ttft_ms", {}).get("p50_ms") if isinstance(r.get("ttft_ms"), dict) else "", r["cpu_seconds"], flush=True)
        runs = {k: combined_run(v) for k, v in per.items()}
        stop.set()
        group = [summary_row(runs[p.label], p, C) for p in paths]
        print(markdown(group, {str(C): compare(group)}))
        import shutil, glob
        for f in glob.glob(str(lm.run_dir / "envoy-*.log")): shutil.copy(f, "/tmp/gap/")
        Path("/tmp/gap/samples.json").write_text(json.dumps(samples))
        for name in runs:
            print(name, [round(r.get("tokens_per_second",0)) for r in []], runs[name].get("cpu_seconds_per_round"), runs[name].get("requests_completed", ""), runs[name].get("server_ttft_mean_ms"))

if __name__ == '__main__':
    main()
