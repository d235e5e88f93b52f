"""summary.md and the plots of one `make bench` run, from its JSON files alone (so every
figure in a report can be traced to raw data and re-derived).

    python -m loadtests.summary loadtests/results/<date>
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

from loadtests import report

HOPS = ("worker", "envoy>worker", "gateway>envoy>worker", "edge>gateway>envoy>worker")


def load_dir(directory: Path) -> list[dict[str, Any]]:
    return (
        [report.load(path) for path in sorted(directory.glob("*.json"))]
        if directory.is_dir()
        else []
    )


def parse_label(label: str) -> tuple[str, int]:
    name, _, c = label.rpartition(" c=")
    return name, int(c)


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def times(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def share(a: float | None, b: float | None) -> str:
    return f"{a / b:.0%}" if a and b else "n/a"


def transport_section(runs: list[dict[str, Any]], out: Path, engine: dict[str, Any] | None) -> str:
    if not runs:
        return ""
    by = {parse_label(r["label"]): r for r in runs}
    concurrency = sorted({c for _, c in by})
    ordered = [by[(hop, c)] for c in concurrency for hop in HOPS if (hop, c) in by]
    lines = ["## 1. Transport overhead: every hop on one engine\n", report.markdown_table(ordered)]
    lines.append(
        "\nAdded by each hop over the previous one (ms; TTFT p50/p99, ITL p50/p99), and "
        "tokens/s as a share of the direct worker's:\n"
    )
    lines.append("| c | hop | ΔTTFT p50 | ΔTTFT p99 | ΔITL p50 | ΔITL p99 | tokens/s | of worker |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for c in concurrency:
        for previous, hop in itertools.pairwise(HOPS):
            a, b = by.get((previous, c)), by.get((hop, c))
            w = by.get(("worker", c))
            if not (a and b and w):
                continue
            lines.append(
                f"| {c} | +{hop.split('>')[0]} | "
                f"{b['ttft_ms']['p50_ms'] - a['ttft_ms']['p50_ms']:+.2f} | "
                f"{b['ttft_ms']['p99_ms'] - a['ttft_ms']['p99_ms']:+.2f} | "
                f"{b['itl_ms']['p50_ms'] - a['itl_ms']['p50_ms']:+.2f} | "
                f"{b['itl_ms']['p99_ms'] - a['itl_ms']['p99_ms']:+.2f} | "
                f"{b['tokens_per_second']:,.0f} | "
                f"{b['tokens_per_second'] / w['tokens_per_second']:.0%} |"
            )
    series: dict[str, list[tuple[int, float]]] = {}
    for hop in HOPS:
        points = [(c, r["tokens_per_second"]) for (h, c), r in by.items() if h == hop]
        if points:
            series[hop] = points
    if engine:
        series["vLLM in-process (no gRPC)"] = [
            (int(b), v) for b, v in engine["tokens_per_second_by_batch"].items()
        ]
    report.plot_throughput(series, out / "throughput-vs-concurrency.png", "tokens/s by path")
    middle = 32 if 32 in concurrency else concurrency[-1]
    chosen = [by[(hop, middle)] for hop in HOPS if (hop, middle) in by]
    report.plot_cdfs(chosen, "ttft", out / f"transport-ttft-cdf-c{middle}.png", f"TTFT, c={middle}")
    report.plot_cdfs(chosen, "itl", out / f"transport-itl-cdf-c{middle}.png", f"ITL, c={middle}")
    lines.append(
        f"\n![tokens/s](throughput-vs-concurrency.png) "
        f"![TTFT CDF](transport-ttft-cdf-c{middle}.png) "
        f"![ITL CDF](transport-itl-cdf-c{middle}.png)\n"
    )
    return "\n".join(lines) + "\n"


def engine_section(transport: list[dict[str, Any]], engine: dict[str, Any] | None) -> str:
    if not engine:
        return ""
    by = {parse_label(r["label"]): r for r in transport}
    lines = [
        "## 2. The physical limit: vLLM in-process vs the mesh\n",
        f"{engine['what']}; load average {engine['load_average_start']} at its start.\n",
        "| streams (batch) | engine tokens/s | worker gRPC | share | edge (full mesh) | share |",
        "|---|---|---|---|---|---|",
    ]
    for batch, limit in engine["tokens_per_second_by_batch"].items():
        w = by.get(("worker", int(batch)))
        e = by.get(("edge>gateway>envoy>worker", int(batch)))
        wt = w["tokens_per_second"] if w else None
        et = e["tokens_per_second"] if e else None
        lines.append(
            f"| {batch} | {limit:,.0f} | {fmt(wt, 0)} | {share(wt, limit)} | {fmt(et, 0)} | "
            f"{share(et, limit)} |"
        )
    return "\n".join(lines) + "\n"


def rest_section(runs: list[dict[str, Any]], out: Path, title: str, plot: str) -> str:
    if not runs:
        return ""
    speed = [r for r in runs if " bytes " not in r["label"]]
    wire = {r["label"].split(" bytes")[0]: r["wire_bytes"] for r in runs if r["wire_bytes"]}
    lines = [f"## {title}\n", report.markdown_table(speed)]
    lines.append("\nBytes on the wire per token (server → client; all framing included):\n")
    lines.append("| path | bytes/token | request bytes | tokens counted |")
    lines.append("|---|---|---|---|")
    for name, counted in wire.items():
        lines.append(
            f"| {name} | {counted['received_per_token']} | {counted['sent']:,} | "
            f"{counted['tokens']:,} |"
        )
    lines.append(f"\n({next(iter(wire.values()))['counted_by']}.)\n" if wire else "")
    by = {r["label"]: r for r in speed}
    lines.append("| c | gRPC ÷ SSE tokens/s | gRPC ÷ REST tokens/s | TTFT p99 gRPC / REST / SSE |")
    lines.append("|---|---|---|---|")
    for c in sorted({parse_label(label)[1] for label in by}):
        grpc, rest, sse = (
            by.get(f"{name} c={c}") for name in ("edge gRPC", "edge REST-JSON", "vLLM OpenAI SSE")
        )
        tps = [r["tokens_per_second"] if r else None for r in (grpc, rest, sse)]
        ttft = " / ".join(fmt(r["ttft_ms"]["p99_ms"]) if r else "n/a" for r in (grpc, rest, sse))
        lines.append(f"| {c} | {times(tps[0], tps[2])} | {times(tps[0], tps[1])} | {ttft} |")
    report.plot_cdfs(speed, "ttft", out / plot, "TTFT by protocol")
    lines.append(f"![TTFT by protocol]({plot})\n")
    return "\n".join(lines) + "\n"


def many_section(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return ""
    r = runs[0]
    complete = r["status"].get("OK", 0)
    return (
        "## 4. Many streams, one connection\n\n"
        + report.markdown_table(runs)
        + f"\n{complete} of {r['config']['concurrency']} streams completed, "
        f"{r['errors']} errors (status counts: {r['status']}).\n\n"
    )


def slow_section(runs: list[dict[str, Any]], notes: dict[str, Any]) -> str:
    if not runs:
        return ""
    lines = ["## 5. Slow consumers\n", report.markdown_table(runs)]
    for r in runs:
        if r.get("slow_streams"):
            lines.append(f"\nSlow readers: {r['slow_streams']}.")
    rss = notes.get("slow_rss_bytes")
    if rss:
        lines.append("\n| process | RSS before (MiB) | peak | after |\n|---|---|---|---|")
        for name in rss["before"]:
            lines.append(
                f"| {name} | {rss['before'][name] / 2**20:.0f} | {rss['peak'][name] / 2**20:.0f} "
                f"| {rss['after'][name] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n\n"


def degraded_section(runs: list[dict[str, Any]], notes: dict[str, Any], out: Path) -> str:
    info = notes.get("degraded")
    if not runs or not info:
        return ""
    report.plot_timeline(
        runs[0], out / "degraded-timeline.png", "TTFT as the reranker stops",
        info["reranker_stopped_at_s"],
    )  # fmt: skip
    lines = [
        "## 6. Degraded mode: the reranker stopped halfway\n",
        report.markdown_table(runs),
        f"\nReranker stopped at {info['reranker_stopped_at_s']} s into the measurement; first "
        f"request answered with the circuit open {info['circuit_open_after_s']} s later; "
        f"errors: {info['errors']} of {info['requests']}.\n",
        "| phase | requests | TTFT p50 | TTFT p99 | max |",
        "|---|---|---|---|---|",
    ]
    for phase, p in info["ttft_ms"].items():
        lines.append(f"| {phase} | {p['count']} | {p['p50_ms']} | {p['p99_ms']} | {p['max_ms']} |")
    lines.append("\n![TTFT timeline](degraded-timeline.png)\n")
    return "\n".join(lines) + "\n"


def key_ratios(out: Path, engine: dict[str, Any] | None) -> dict[str, Any]:
    """The closing figures: mesh vs engine tokens/s, per-hop TTFT, gRPC vs SSE."""
    transport = {parse_label(r["label"]): r for r in load_dir(out / "transport")}
    # The side-by-side run, when there is one, is the fair comparison.
    rest = {r["label"]: r for r in load_dir(out / "rest")}
    rest |= {r["label"]: r for r in load_dir(out / "versus")}
    ratios: dict[str, Any] = {}
    if engine and transport:
        best = max(engine["tokens_per_second_by_batch"].values())
        edge = max(
            (r["tokens_per_second"] for (hop, _), r in transport.items() if hop == HOPS[-1]),
            default=0.0,
        )
        worker = max(
            (r["tokens_per_second"] for (hop, _), r in transport.items() if hop == HOPS[0]),
            default=0.0,
        )
        ratios["engine_best_tokens_per_second"] = best
        ratios["mesh_edge_best_share_of_engine"] = round(edge / best, 3) if best else None
        ratios["worker_grpc_best_share_of_engine"] = round(worker / best, 3) if best else None
    if transport:
        c = min(c for _, c in transport)
        per_hop = {}
        for previous, hop in itertools.pairwise(HOPS):
            a, b = transport.get((previous, c)), transport.get((hop, c))
            if a and b:
                per_hop[hop] = {
                    "ttft_p50_ms": round(b["ttft_ms"]["p50_ms"] - a["ttft_ms"]["p50_ms"], 2),
                    "ttft_p99_ms": round(b["ttft_ms"]["p99_ms"] - a["ttft_ms"]["p99_ms"], 2),
                }
        ratios[f"ttft_added_per_hop_c{c}"] = per_hop
    for c in (8, 32):
        grpc, sse = rest.get(f"edge gRPC c={c}"), rest.get(f"vLLM OpenAI SSE c={c}")
        if grpc and sse and sse["tokens_per_second"]:
            ratios[f"grpc_over_sse_tokens_per_second_c{c}"] = round(
                grpc["tokens_per_second"] / sse["tokens_per_second"], 2
            )
    wire = {label: r["wire_bytes"] for label, r in rest.items() if r["wire_bytes"]}
    grpc_bytes = wire.get("edge gRPC bytes c=8")
    for name, label in (("sse", "vLLM OpenAI SSE bytes c=8"), ("rest", "edge REST-JSON bytes c=8")):
        other = wire.get(label)
        if grpc_bytes and other:
            ratios[f"grpc_bytes_per_token_vs_{name}"] = {
                "grpc": grpc_bytes["received_per_token"],
                name: other["received_per_token"],
                "reduction": round(
                    1 - grpc_bytes["received_per_token"] / other["received_per_token"], 3
                ),
            }
    return ratios


def write_summary(out: Path) -> str:
    notes = json.loads((out / "notes.json").read_text()) if (out / "notes.json").exists() else {}
    engine = notes.get("engine")
    transport = load_dir(out / "transport")
    machine = notes.get("machine", {})
    ratios = key_ratios(out, engine)
    (out / "key_ratios.json").write_text(json.dumps(ratios, indent=1) + "\n")
    text = (
        f"# Benchmark run {out.name}\n\n"
        f"Machine: {machine.get('cpus')} CPUs, {machine.get('memory_gib')} GiB, no GPU, tiny "
        f"model; load average (1/5/15 min) {machine.get('load_average_at_start')} at the start, "
        f"{machine.get('load_average_at_end')} at the end (each run's own is in its JSON). "
        "Latencies in ms; gen CPU is the generator's busiest process as a share of one core, "
        "(!) when over 90 % (the generator may be the bottleneck).\n\n"
        "Key ratios (key_ratios.json):\n\n```json\n"
        + json.dumps(ratios, indent=1)
        + "\n```\n\n"
        + transport_section(transport, out, engine)
        + engine_section(transport, engine)
        + rest_section(
            load_dir(out / "rest"),
            out,
            "3. gRPC vs REST/JSON vs vLLM's OpenAI SSE (run one after another)",
            "rest-ttft-cdf.png",
        )
        + rest_section(
            load_dir(out / "versus"),
            out,
            "3b. The same side by side: all three up, interleaved rounds, the same machine load",
            "versus-ttft-cdf.png",
        )
        + many_section(load_dir(out / "many"))
        + slow_section(load_dir(out / "slow"), notes)
        + degraded_section(load_dir(out / "degraded"), notes, out)
    )
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(write_summary(Path(sys.argv[1])))
