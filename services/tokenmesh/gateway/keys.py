"""`python -m tokenmesh.gateway.keys add --tenant acme --file keys.json`: a new API key (the
operators' command-line front end of the keys file)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenmesh.gateway.core.tenancy.auth import KeysFile, hash_key, new_key


def add_key(path: Path, tenant: str) -> str:
    """Add a new random key for tenant (created if new; the file too) and return the key.
    Only its hash is stored. The file is replaced atomically, so a gateway watching it reads
    either the old or the new version, never half of one."""
    document: dict[str, Any] = (
        json.loads(path.read_text()) if path.exists() else {"defaults": {}, "tenants": {}}
    )
    key = new_key()
    entry = document.setdefault("tenants", {}).setdefault(tenant, {})
    entry.setdefault("key_sha256", []).append(hash_key(key))
    KeysFile.model_validate(document)  # what a gateway would refuse is not written
    text = json.dumps(document, indent=2) + "\n"
    directory = path.resolve().parent
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as out:
        out.write(text)
    if path.exists():
        os.chmod(out.name, path.stat().st_mode & 0o777)
    os.replace(out.name, path)
    return key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmesh.gateway.keys", description="Manage the gateway's keys file."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="add a new random key for a tenant; prints it once")
    add.add_argument("--tenant", required=True, help="tenant id (created when new)")
    add.add_argument("--file", required=True, type=Path, help="the keys file (JSON)")
    hashed = commands.add_parser("hash", help="print the SHA-256 to store for a key from stdin")
    hashed.set_defaults(command="hash")
    args = parser.parse_args(argv)
    if args.command == "hash":
        print(hash_key(sys.stdin.read().strip()))
        return 0
    try:
        key = add_key(args.file, args.tenant)
    except (OSError, ValueError) as exc:
        print(f"keys file {args.file} not changed: {exc}", file=sys.stderr)
        return 1
    print(key)
    print(
        f"added a key for tenant {args.tenant!r} to {args.file}; it is shown only now "
        "(the file keeps its SHA-256)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
