"""Generate Python code (messages, stubs, type stubs) from protos/ into services/, or check it."""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from google.api import httpbody_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "services"
PACKAGE_DIR = Path("tokenmesh") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# google/api/*.proto (HttpBody, the HTTP annotations) as googleapis-common-protos ships them.
GOOGLE_APIS = Path(httpbody_pb2.__file__).parent.parent.parent


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every proto into out_root; return the generated files."""
    out_root.mkdir(parents=True, exist_ok=True)
    # grpc_tools ships the well-known types (google/protobuf/*.proto) next to its module.
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"-I{GOOGLE_APIS}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    package = out_root / PACKAGE_DIR
    (package / "__init__.py").write_text(
        '"""Generated protobuf and gRPC code for tokenmesh.v1."""\n'
    )
    return sorted(p for p in package.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Names of committed generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = OUT_ROOT / PACKAGE_DIR
        names = {p.name for p in fresh} | {
            p.name for p in committed.iterdir() if p.name.endswith(GENERATED_SUFFIXES)
        }
        return sorted(
            name
            for name in names
            if not (committed / name).exists()
            or not (Path(tmp) / PACKAGE_DIR / name).exists()
            or not filecmp.cmp(committed / name, Path(tmp) / PACKAGE_DIR / name, shallow=False)
        )


def descriptor_set(path: Path) -> None:
    """Write a self-contained descriptor set (for Envoy's gRPC-JSON transcoder and tools)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"-I{GOOGLE_APIS}",
        "--include_imports",
        "--include_source_info",
        f"--descriptor_set_out={path}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("generated code is stale, run `make proto`: " + ", ".join(stale))
            return 1
        print("generated code is up to date")
        return 0
    for path in generate(OUT_ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
