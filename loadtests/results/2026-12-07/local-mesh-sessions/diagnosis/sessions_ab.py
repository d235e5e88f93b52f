"""Two private meshes at once, alike but for how supervisord starts their programs: each in a
session of its own (supervise_sessions.py, beside this file) or all in supervisord's (as
shipped, the local mesh's way); interleaved rounds at 32 and 64 streams. Per round:
tokens/s, tokens per message, TTFT p50, the worker's intake p50 and CPU µs per token of the
worker, gateway and Envoy.

Run from the repository's root as a module (it spawns the generator's processes):
    cp <this dir>/sessions_ab.py loadtests/_sessions.py && python -m loadtests._sessions 3
"""
import contextlib, os, subprocess, sys
from pathlib import Path
from loadtests import first_token_stages
from loadtests.scenarios import Bench, private_mesh
from loadtests.token_cost import OUTPUT_TOKENS, measured_run, mesh_path
import tokenmesh.localmesh.mesh as mesh_module


# This file runs as loadtests/_sessions.py; the launcher stays in the results.
LAUNCHER = (
    Path(__file__).resolve().parents[1]
    / "loadtests/results/2026-12-07/local-mesh-sessions/diagnosis/supervise_sessions.py"
)


@contextlib.contextmanager
def program_sessions():
    """LocalMesh.start runs supervisord through supervise_sessions.py (a session a program)."""
    real = mesh_module.subprocess.run

    def run(command, *args, **kwargs):
        if str(command[0]).endswith("supervisord"):
            command = [sys.executable, str(LAUNCHER), *command[1:]]
        return real(command, *args, **kwargs)

    mesh_module.subprocess.run = run
    try:
        yield
    finally:
        mesh_module.subprocess.run = real


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    bench = Bench(out=Path("/tmp/probe/sessions"), quick=False)
    with contextlib.ExitStack() as stack:
        with program_sessions():
            own = stack.enter_context(private_mesh())
        shared = stack.enter_context(private_mesh())
        meshes = {"sessions": own, "one group": shared}
        for name, m in meshes.items():
            w = m.pid("worker-0")
            print(name, "worker session", os.getsid(w), "envoy session", os.getsid(m.pid("envoy")), flush=True)
        cores = own.mesh_cores(own.settings.worker_count(), os.cpu_count() or 1)
        for streams in (32, 64):
            for r in range(rounds):
                for name, m in meshes.items():
                    path = mesh_path(m)
                    cfg = bench.config(target="llm", address=path.address, model="", concurrency=streams,
                                       processes=2, duration=5, output_tokens=OUTPUT_TOKENS, cpus=cores,
                                       label=name, seed=r + 1, request_ids=True)
                    res = measured_run(cfg, path)
                    s = first_token_stages.summary(res["stage_rows"], len(res["firsts"]))
                    t = res["tokens_received"]
                    cpu = {k: round(1e6 * v / t, 1) for k, v in res["cpu_seconds"].items()}
                    print(f"c={streams} r{r} {name:9} tok/s {res['tokens_per_second']:6.0f} tpm {t / res['messages_received']:.2f} "
                          f"ttft {res['ttft_ms']['p50_ms']:6.1f} intake {s.get('to_handler', {}).get('p50_ms')} cpu/tok {cpu}", flush=True)


if __name__ == "__main__":
    main()
