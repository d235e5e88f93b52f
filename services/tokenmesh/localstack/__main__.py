"""`python -m tokenmesh.localstack up|down|status|logs` (what make up/down/status/logs run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmesh.localstack.stack import Stack, StackSettings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=("up", "down", "status", "logs", "config"))
    command = parser.parse_args().command
    stack = Stack(StackSettings(), root=Path.cwd())
    if command in ("status", "down", "logs") and stack.settings_path.exists():
        # The settings the stack was started with (its ports, TLS), whatever this shell's
        # TOKENMESH_STACK_* variables say.
        saved = StackSettings.model_validate_json(stack.settings_path.read_text())
        stack = Stack(saved, root=Path.cwd())
    if command == "config":
        print(stack.supervisord_config())
        return 0
    return int(getattr(stack, command)())


if __name__ == "__main__":
    sys.exit(main())
