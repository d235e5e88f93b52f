"""Where a service's time goes: py-spy samples a process during a run, and its collapsed
stacks are summed by thread, by the library of the innermost known frame and by the frames of
the packages that matter here (loadtests/token_cost.py --profile)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtests.runner import RunConfig, run
from tokenmesh.common.processes import stop_process

# Only frames of these packages are listed as where a service's time goes (the rest is the
# interpreter, asyncio and the standard library, shown by their callers).
PROFILED_PACKAGES = ("tokenmesh", "grpc", "google/protobuf", "prometheus_client", "opentelemetry")
# Each sample is put down to the innermost frame that names one of these (first match wins
# per frame; py-spy --native shows gRPC's C core and Cython, upb and uvloop by library name).
CATEGORIES = (
    ("gRPC (C core, Cython, grpc.aio)", ("grpc", "cygrpc", "libgrpc")),
    ("protobuf (upb)", ("protobuf", "upb")),
    ("vLLM", ("vllm/",)),
    ("metrics, logs, traces", ("prometheus_client", "opentelemetry", "logging/")),
    ("event loop (uvloop, asyncio)", ("uvloop", "asyncio/", "selectors")),
    ("tokenmesh", ("tokenmesh/",)),
    ("interpreter, libc, kernel", ("libpython", "libc", "python3", "_PyEval", "syscall")),
)


@contextmanager
def sampling(name: str, process: int, seconds: float, out: Path) -> Iterator[Path]:
    """py-spy records one process (every thread, on-CPU samples only, without pausing it)
    while the block runs. Python frames only: --native needs py-spy to pause the process, and
    then it samples idle threads as if they ran (tried: each of the worker's six threads got
    the same 16 %)."""
    raw = out / f"{name}.txt"
    log = raw.with_suffix(".py-spy.log")
    spy = Path(sys.executable).parent / "py-spy"
    command = [str(spy), "record", "--pid", str(process), "--duration", str(int(seconds)),
               "--rate", "200", "--format", "raw", "--threads", "--nonblocking",
               "--output", str(raw)]  # fmt: skip
    with log.open("w") as output:
        recorder = subprocess.Popen(command, stdout=output, stderr=output)
        try:
            yield raw
        finally:
            # py-spy ends on its own after `seconds` and writes its profile then.
            with contextlib.suppress(subprocess.TimeoutExpired):
                recorder.wait(seconds + 30)
            stop_process(recorder, 10)


def where_time_goes(raw: Path, top: int = 25) -> dict[str, Any]:
    """From py-spy's collapsed stacks: each thread's share of the samples, and the share of the
    frames of PROFILED_PACKAGES (inclusive: a frame and what it calls), largest first."""
    if not raw.exists():
        log = raw.with_suffix(".py-spy.log")
        return {"error": log.read_text().strip() if log.exists() else "py-spy wrote nothing"}
    threads: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    categories: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        threads[frames[0]] += count
        categories[category(frames[1:])] += count
        seen = set()
        for frame in frames[1:]:
            if any(package in frame for package in PROFILED_PACKAGES) and frame not in seen:
                seen.add(frame)
                inclusive[frame] += count
    share = {frame: round(100 * n / total, 1) for frame, n in inclusive.most_common(top)}
    return {
        "samples": total,
        "threads_percent": {t: round(100 * n / total, 1) for t, n in threads.most_common(8)},
        "innermost_library_percent": {
            name: round(100 * n / total, 1) for name, n in categories.most_common()
        },
        "frames_percent": share,
    }


def category(frames: list[str]) -> str:
    """What the innermost frame of a sample that names a known library belongs to."""
    for frame in reversed(frames):
        for name, marks in CATEGORIES:
            if any(mark in frame for mark in marks):
                return name
    return "other"


def profile_services(
    config: RunConfig, processes: dict[str, int], seconds: float, out: Path
) -> dict[str, Any]:
    """py-spy on each of these processes (name → pid) during one run of `config`."""
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        raws = {
            name: stack.enter_context(sampling(name, pid, seconds, out))
            for name, pid in processes.items()
        }
        print(f"[cost] py-spy on {', '.join(processes)}: {config.label}", file=sys.stderr,
              flush=True)  # fmt: skip
        run(config, show_progress=False)
    return {name: where_time_goes(raw) for name, raw in raws.items()}
