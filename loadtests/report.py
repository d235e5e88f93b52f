"""A load test's outputs: the JSON result file, a Markdown summary table and matplotlib PNGs
(latency CDFs from the HDR histograms, throughput against concurrency)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from loadtests.stats import Latencies

COLUMNS = (
    "run",
    "conc/rate",
    "req",
    "err",
    "tokens/s",
    "TTFT p50",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "ITL p99.9",
    "worker ITL p50/p99",
    "E2E p99",
    "gen CPU",
)


# The vector extensions vLLM's CPU kernels use: without AVX-512 the same engine is several
# times slower per token, so results from machines that differ here do not compare.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def processor() -> dict[str, Any]:
    """The CPU's model name and which of VECTOR_FLAGS it has, from /proc/cpuinfo."""
    model, flags = "", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"cpu_model": model, "cpu_flags": [f for f in VECTOR_FLAGS if f in flags]}


def write_json(result: dict[str, Any], path: Path) -> None:
    """Indented, except the per-request timeline: one compact row per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1)
    if "timeline" in result:
        rows = ",\n  ".join(json.dumps(row) for row in result["timeline"])
        body = body[:-2] + f',\n "timeline": [\n  {rows}\n ]\n}}'
    path.write_text(body + "\n")


def emit(result: dict[str, Any], out: Path | None) -> None:
    """Print a focused benchmark's result as JSON, and write it to `out` when given."""
    text = json.dumps(result, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def row(result: dict[str, Any]) -> list[str]:
    config = result["config"]
    load_point = (
        f"c={config['concurrency']}" if config["mode"] == "closed" else f"{config['rate']:g}/s"
    )
    cpu = max(result["generator"]["cpu_fraction_per_process"])
    saturated = " (!)" if result["generator"]["saturated"] else ""
    worker = result.get("server_itl_ms") or {"count": 0}
    server = f"{worker['p50_ms']:.2f}/{worker['p99_ms']:.2f}" if worker["count"] else "n/a"
    return [
        result["label"] or config["target"],
        load_point,
        str(result["requests"]),
        str(result["errors"]),
        f"{result['tokens_per_second']:,.0f}",
        f"{result['ttft_ms']['p50_ms']:.1f}",
        f"{result['ttft_ms']['p99_ms']:.1f}",
        f"{result['itl_ms']['p50_ms']:.2f}",
        f"{result['itl_ms']['p99_ms']:.2f}",
        f"{result['itl_ms']['p99.9_ms']:.2f}",
        server,
        f"{result['e2e_ms']['p99_ms']:.0f}",
        f"{cpu:.0%}{saturated}",
    ]


def markdown_table(results: Iterable[dict[str, Any]]) -> str:
    """One row per run; latencies in ms, generator CPU as a share of one core ((!) when the
    generator itself may have been the bottleneck). Worker ITL: the gaps between the worker's
    own emission times (Token.emitted_unix_nanos), for comparison with the client's."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(result)) + " |" for result in results]
    return "\n".join(lines) + "\n"


def new_plot() -> tuple[Any, Any]:
    """A figure and its axes, drawn without a display (matplotlib imported only when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.2))


def save_plot(figure: Any, axes: Any, path: Path, title: str, grid: str = "major") -> None:
    """Title, grid and legend, then the PNG at path; the figure is closed."""
    import matplotlib.pyplot as plt

    axes.set_title(title)
    axes.grid(True, which=grid, alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_cdfs(results: Sequence[dict[str, Any]], metric: str, path: Path, title: str) -> None:
    """CDF of one latency (ttft, itl or e2e) for each run, from its stored HDR histogram."""
    figure, axes = new_plot()
    for result in results:
        points = Latencies.decode(result["histograms"][metric]).cdf()
        if points:
            xs, ys = zip(*points, strict=True)
            axes.step(xs, ys, where="post", label=result["label"] or result["config"]["target"])
    axes.set_xscale("log")
    axes.set_xlabel(f"{metric.upper()} (ms, log scale)")
    axes.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
    save_plot(figure, axes, path, title, grid="both")


def plot_throughput(
    series: dict[str, list[tuple[int, float]]], path: Path, title: str, engine: float | None = None
) -> None:
    """tokens/s against concurrency, one line per target; the engine's in-process figure as
    a horizontal line when known."""
    figure, axes = new_plot()
    ticks: set[int] = set()
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ticks.update(xs)
        axes.plot(xs, ys, marker="o", label=name, linestyle="--" if "vLLM" in name else "-")
    if engine:
        axes.axhline(engine, linestyle="--", color="black", label="vLLM in-process (no gRPC)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(ticks), [str(tick) for tick in sorted(ticks)])
    axes.set_xlabel("concurrent streams (engine: batch size)")
    axes.set_ylabel("tokens/s")
    save_plot(figure, axes, path, title)


def plot_timeline(result: dict[str, Any], path: Path, title: str, marker: float | None) -> None:
    """Each request's TTFT against when it was sent (scenario 6: the reranker killed at
    `marker` seconds)."""
    figure, axes = new_plot()
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for start, ttft, _e2e, status, warning in result["timeline"]:
        if ttft < 0:
            continue
        name = status if status != "OK" else (warning.split(":")[0] or "healthy")
        if "circuit open" in warning:
            name = "degraded, circuit open"
        xs, ys = groups.setdefault(name, ([], []))
        xs.append(start)
        ys.append(ttft * 1e3)
    for name, (xs, ys) in sorted(groups.items()):
        axes.scatter(xs, ys, s=6, label=name)
    if marker is not None:
        axes.axvline(marker, color="red", linestyle="--", label="reranker stopped")
    axes.set_yscale("log")
    axes.set_xlabel("request sent at (s into the measurement)")
    axes.set_ylabel("TTFT (ms, log scale)")
    save_plot(figure, axes, path, title)
