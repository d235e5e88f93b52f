"""The tokenmesh load generator.

  python -m loadtests run --target llm --address 127.0.0.1:8080 --mode open --rate 20
  python -m loadtests run --target worker --address 127.0.0.1:50061 --concurrency 32
  python -m loadtests bench [--scenarios transport,engine,...] [--quick]

`run` drives one gRPC (or REST/SSE) target and writes a JSON result, a Markdown summary and
latency CDF plots; `bench` runs the named scenarios (see loadtests/scenarios.py), each on its
own private mesh, into loadtests/results/<date>/. All traffic goes to 127.0.0.1; every run is
bounded in duration and request count.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from loadtests import report
from loadtests.runner import RunConfig, run
from loadtests.targets import KINDS

RESULTS = Path(__file__).resolve().parent / "results"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", choices=KINDS, default="llm", help="what the address speaks")
    parser.add_argument("--address", default="127.0.0.1:8080")
    parser.add_argument("--mode", choices=("closed", "open"), default="closed")
    parser.add_argument("--concurrency", type=int, default=8, help="closed loop: streams")
    parser.add_argument("--rate", type=float, default=10.0, help="open loop: requests/s")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--requests", type=int, default=1000, help="most measured requests")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds not measured")
    parser.add_argument(
        "--prompt-words", default="16", help="N, uniform:A:B or normal:MEAN:SD (after a prefix)"
    )
    parser.add_argument("--output-tokens", default="64", help="N, uniform:A:B or normal:MEAN:SD")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prefixes", type=int, default=0, help="shared prompt prefixes (0: none)")
    parser.add_argument("--prefix-words", type=int, default=0, help="words in each prefix")
    parser.add_argument(
        "--prefix-share", type=float, default=0.0, help="share of requests on prefix 0 (skew)"
    )
    parser.add_argument("--text-seed", type=int, default=0, help="the words' seed (0: --seed)")
    parser.add_argument("--processes", type=int, default=1, help="generator processes")
    parser.add_argument(
        "--cpus", default="", help='cores the generator keeps to, e.g. "1" (off the engines\')'
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--documents", type=int, default=0, help="context documents (rerank)")
    parser.add_argument("--model", default="", help="the openai target's model name")
    parser.add_argument("--count-bytes", action="store_true", help="bytes on the wire")
    parser.add_argument("--slow-streams", type=int, default=0)
    parser.add_argument("--slow-interval", type=float, default=1.0, help="seconds per read")
    parser.add_argument("--slow-tokens", type=int, default=16, help="tokens per slow stream")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=None, help="result directory")


def config_from(args: argparse.Namespace) -> RunConfig:
    names = RunConfig.__dataclass_fields__
    return RunConfig(**{name: value for name, value in vars(args).items() if name in names})


def run_command(args: argparse.Namespace) -> int:
    config = config_from(args)
    result = run(config)
    out = args.out or RESULTS / datetime.now(UTC).strftime("%Y-%m-%d") / "adhoc"
    name = (config.label or f"{config.target}-{config.mode}").replace(" ", "-")
    report.write_json(result, out / f"{name}.json")
    table = report.markdown_table([result])
    (out / f"{name}.md").write_text(table)
    report.plot_cdfs([result], "ttft", out / f"{name}-ttft-cdf.png", f"TTFT: {name}")
    report.plot_cdfs([result], "itl", out / f"{name}-itl-cdf.png", f"inter-token gap: {name}")
    print(table)
    print(f"results in {out}", file=sys.stderr)
    brief = {key: result[key] for key in ("requests", "errors", "status", "tokens_per_second")}
    print(json.dumps({**brief, "generator": result["generator"]}, indent=1))
    return 0 if result["requests"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(commands.add_parser("run", help="drive one target"))
    bench = commands.add_parser("bench", help="run the benchmark scenarios")
    bench.add_argument("--scenarios", default="all", help="comma-separated names, or all")
    bench.add_argument("--quick", action="store_true", help="seconds per run (a smoke test)")
    bench.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "run":
        return run_command(args)
    from loadtests.scenarios import bench_command

    return bench_command(args.scenarios, args.quick, args.out)


if __name__ == "__main__":
    sys.exit(main())
