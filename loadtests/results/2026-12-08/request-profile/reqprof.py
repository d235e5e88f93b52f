"""Ad-hoc: py-spy on the gateway and worker while 64 closed-loop streams of 16 tokens run
(per-request costs dominate), and the CPU each process spends per request."""
import contextlib, json, os, sys
from dataclasses import replace
from pathlib import Path
from loadtests.profiles import profile_services
from loadtests.scenarios import Bench, private_mesh
from loadtests.token_cost import measured_run, mesh_path
from tests.harness.meshes import environment


def main():
    out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20
    env = dict(a.split("=", 1) for a in sys.argv[3:])
    bench = Bench(out=out, quick=False)
    with contextlib.ExitStack() as stack:
        with environment(env):
            mesh = stack.enter_context(private_mesh())
        cores = mesh.mesh_cores(mesh.settings.worker_count(), os.cpu_count() or 1)
        path = replace(mesh_path(mesh), access_log=None, worker_log=None)
        warm = bench.config(target=path.target, address=path.address, model=path.model,
                            concurrency=8, duration=3, output_tokens="16", cpus=cores, label="warm")
        measured_run(warm, path)
        cfg = bench.config(target=path.target, address=path.address, model=path.model,
                           concurrency=64, processes=2, duration=seconds, output_tokens="16",
                           cpus=cores, label="c64 16 tokens")
        res = measured_run(cfg, path)
        row = {"requests": res["requests"], "errors": res.get("errors"),
               "tokens_per_s": res.get("tokens_per_s"),
               "ttft": {k: res["ttft_ms"].get(k) for k in ("p50_ms", "p99_ms")},
               "cpu_ms_per_request": {k: round(1000 * v / max(res["requests"], 1), 3)
                                      for k, v in res["cpu_seconds"].items()}}
        print(json.dumps(row), flush=True)
        services = {name: path.processes[name][0] for name in ("worker", "gateway")}
        import subprocess
        from loadtests.profiles import where_time_goes
        from loadtests.runner import run
        (out / "profiles").mkdir(exist_ok=True)
        spies = {name: subprocess.Popen(["nice", "-n", "-15", ".venv/bin/py-spy", "record", "--pid", str(pid),
                  "--duration", str(int(seconds + 4)), "--rate", "97", "--format", "raw", "--threads",
                  "--nonblocking", "--output", str(out / "profiles" / f"{name}.txt")],
                  stdout=subprocess.DEVNULL, stderr=open(out / "profiles" / f"{name}.log", "w"))
                 for name, pid in services.items()}
        run(cfg, show_progress=False)
        for spy in spies.values():
            spy.wait(60)
        prof = {name: where_time_goes(out / "profiles" / f"{name}.txt", top=60) for name in services}
        (out / "result.json").write_text(json.dumps({"env": env, "run": row, "profiles": prof}, indent=1))
        print(json.dumps(prof, indent=1)[:6000])


if __name__ == "__main__":
    main()
