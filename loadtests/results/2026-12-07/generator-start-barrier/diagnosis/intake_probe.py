"""Rounds of 64 streams on one private mesh; per round: the generator's start spread, the
round's wall time and the machine's CPU (/proc/stat), tokens/s, tokens per message, TTFT and
the worker's intake (to_handler) p50, and each worker thread's CPU (by py-spy's thread names).

Run from the repository's root as a module (it spawns the generator's processes):
    cp <this file> loadtests/_probe.py && python -m loadtests._probe 8 64
"""
import json, os, re, subprocess, sys, time
from dataclasses import replace
from pathlib import Path

from loadtests import first_token_stages
from loadtests.scenarios import Bench, private_mesh
from loadtests.token_cost import mesh_path, measured_run, OUTPUT_TOKENS, descendants

TICKS = os.sysconf("SC_CLK_TCK")

def threads(pid):
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            f = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[int(task.name)] = (int(f[11]) + int(f[12])) / TICKS
    return out

def names(pid):
    spy = Path(sys.executable).parent / "py-spy"
    text = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
    return {int(m.group(1), 16) if m.group(1).startswith("0x") else int(m.group(1)): m.group(2)
            for m in re.finditer(r'Thread (\S+) \((?:active|idle)[^)]*\): "([^"]+)"', text)}, text

def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    streams = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    bench = Bench(out=Path("/tmp/probe/out"), quick=False)
    with private_mesh() as mesh:
        path = mesh_path(mesh)
        wpid = path.processes["worker"][0]
        tid_names, dump = names(wpid)
        Path("/tmp/probe/dump.txt").write_text(dump)
        cores = mesh.mesh_cores(mesh.settings.worker_count(), os.cpu_count() or 1)
        for r in range(rounds):
            cfg = bench.config(target="llm", address=path.address, model="", concurrency=streams,
                               processes=2, duration=bench.round_seconds, output_tokens=OUTPUT_TOKENS,
                               cpus=cores, label=f"r{r}", request_ids=True, seed=r + 1)
            if r == 0:
                for name, pids in path.processes.items():
                    for p in pids:
                        try:
                            print(name, p, sorted(os.sched_getaffinity(p)), [sorted(os.sched_getaffinity(int(t.name))) for t in Path(f"/proc/{p}/task").iterdir()][:12], flush=True)
                        except Exception as e:
                            print(name, p, e)
            stat0 = Path("/proc/stat").read_text().split("\n")[:3]
            wall0 = time.monotonic()
            before = threads(wpid)
            eng_before = {p: threads(p) for p in path.processes["engine"]}
            res = measured_run(cfg, path)
            after = threads(wpid)
            wall = time.monotonic() - wall0
            stat1 = Path("/proc/stat").read_text().split("\n")[:3]
            def diff(a, b):
                return [int(y) - int(x) for x, y in zip(a.split()[1:], b.split()[1:])]
            cpus = {l0.split()[0]: diff(l0, l1) for l0, l1 in zip(stat0, stat1)}
            eng = {p: sum(threads(p).values()) - sum(eng_before[p].values()) for p in path.processes["engine"]}
            per = {}
            for tid, v in after.items():
                d = v - before.get(tid, 0)
                if d > 0.05:
                    per[tid_names.get(tid, str(tid))] = round(d, 2)
            s = first_token_stages.summary(res["stage_rows"], len(res["firsts"]))
            print(json.dumps({"round": r, "spread": res["generator"].get("start_spread_ms"), "wall": round(wall, 1), "stat_user_sys_idle_steal": {k: [v[0], v[2], v[3], v[7]] for k, v in cpus.items()}, "tok_s": res["tokens_per_second"],
                              "tpm": round(res["tokens_received"] / max(res.get("messages_received", 0), 1), 2),
                              "ttft_p50": res["ttft_ms"].get("p50_ms"),
                              "to_handler": s.get("to_handler"), "handler_first": s.get("handler_first"),
                              "cpu": res["cpu_seconds"], "worker_threads": per,
                              "engine": {k: round(v, 2) for k, v in eng.items()}}), flush=True)

if __name__ == "__main__":
    main()
