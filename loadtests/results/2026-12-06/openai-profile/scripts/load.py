"""Interleaved rounds of N streaming OpenAI /v1/completions requests (128 tokens each) at each
held mesh's edge (state files in argv): CPU per token of each process, and of each of the
worker's threads, from /proc; with --profile, py-spy (raw, nonblocking, 250 Hz) records the
worker during each round too.

    load.py [--profile] [--rounds N] [--seconds S] [--streams C] OUT NAME=STATE.json ...
"""
import argparse, json, re, subprocess, sys, time
from pathlib import Path

from loadtests.runner import RunConfig, run
from loadtests.token_cost import TICKS, cpu_seconds

SPY = Path(sys.executable).parent / "py-spy"
_NAMES: dict[int, dict[int, str]] = {}


def thread_cpu(pid):
    """CPU seconds of each thread of the process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def thread_names(pid):
    """Python thread names by thread id (py-spy dump, once per process)."""
    if pid not in _NAMES:
        text = subprocess.run([str(SPY), "dump", "--pid", str(pid), "--nonblocking"],
                              capture_output=True, text=True).stdout
        _NAMES[pid] = {int(m.group(1)): m.group(2) for m in
                       re.finditer(r'^Thread (\d+) \(\w+\): "([^"]*)"', text, re.M)}
    return _NAMES[pid]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--perf", action="store_true", help="perf record (cpu-clock) the worker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("out", type=Path)
    parser.add_argument("targets", nargs="+")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    targets = []
    for item in args.targets:
        label, state = item.split("=", 1)
        targets.append((label, json.loads(Path(state).read_text())))
    rows = []
    for number in range(args.rounds):
        for label, info in targets:
            worker = info["worker"][0]
            config = RunConfig(
                target="openai", address=info["edge"], model=info.get("model", ""),
                concurrency=args.streams, processes=2, duration=args.seconds, warmup=2.0,
                requests=5000, prompt_words="16", output_tokens="128", seed=number + 1,
                cpus=info.get("cores", ""), label=f"{label} r{number + 1}",
            )
            procs = {k: info[k] for k in ("worker", "engine", "gateway", "envoy", "api_server")
                     if k in info}
            names = thread_names(worker)
            recorder = None
            if args.profile:
                raw = args.out / f"{label}-r{number + 1}.txt"
                recorder = subprocess.Popen(
                    [str(SPY), "record", "--pid", str(worker), "--duration",
                     str(int(args.seconds + 3)), "--rate", "250", "--format", "raw",
                     "--threads", "--nonblocking", "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=open(raw.with_suffix(".log"), "w"))
            if args.perf:
                data = args.out / f"{label}-r{number + 1}.perf.data"
                recorder = subprocess.Popen(
                    ["perf", "record", "-e", "cpu-clock", "-F", "499", "-g", "-p", str(worker),
                     "-o", str(data), "--", "sleep", str(int(args.seconds + 3))],
                    stdout=subprocess.DEVNULL, stderr=open(data.with_suffix(".log"), "w"))
            before = {k: cpu_seconds(p) for k, p in procs.items()}
            threads_before = thread_cpu(worker)
            started = time.monotonic()
            result = run(config, show_progress=False)
            wall = time.monotonic() - started
            after = {k: cpu_seconds(p) for k, p in procs.items()}
            threads_after = thread_cpu(worker)
            if recorder is not None:
                recorder.wait(60)
            by_thread: dict[str, float] = {}
            for tid, value in threads_after.items():
                thread = names.get(tid, "other (short-lived)")
                by_thread[thread] = by_thread.get(thread, 0) + value - threads_before.get(tid, 0)
            tokens = result["tokens_received"]
            cpu = {k: after[k] - before[k] for k in procs}
            row = {
                "target": label, "round": number + 1, "requests": result["requests"],
                "errors": result["errors"], "tokens": tokens, "wall_s": round(wall, 1),
                "tokens_per_second": round(result["tokens_per_second"]),
                "tokens_per_message": round(tokens / result["messages_received"], 3)
                if result.get("messages_received") else None,
                "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
                "cpu_us_per_token": {k: round(v * 1e6 / tokens, 1) for k, v in cpu.items()},
                "worker_threads_us_per_token": {
                    k: round(v * 1e6 / tokens, 1)
                    for k, v in sorted(by_thread.items(), key=lambda i: -i[1]) if v > 0
                },
                "load_average": result.get("load_average_start"),
                "worker_thread_ids": {str(k): v for k, v in names.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "rounds.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
