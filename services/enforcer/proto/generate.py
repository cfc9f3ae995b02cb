"""Generates the enforcer's Python gRPC modules from the kubelet API .proto files in this directory.

The .proto files are the contract with the kubelet; the generated modules under
services/enforcer/src are committed so that an install (a wheel, the image) needs no protoc. This
script is the one way they are made: `make protos` runs it, and `--check` (run by the test suite)
regenerates into a scratch directory and fails if the committed modules differ, so a .proto edited
without regenerating is caught.

    python services/enforcer/proto/generate.py           # write the modules
    python services/enforcer/proto/generate.py --check   # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def protos(root: Path) -> list[Path]:
    return sorted(root.rglob("*.proto"))


def expected(root: Path, proto: Path) -> list[str]:
    """The modules (relative to the output root) one .proto file generates."""
    stem = proto.relative_to(root).with_suffix("")
    return [f"{stem}_pb2.py", f"{stem}_pb2_grpc.py"]


def generate(root: Path, out: Path) -> None:
    from grpc_tools import protoc  # a build tool: only needed here

    files = [str(p.relative_to(root)) for p in protos(root)]
    code = protoc.main(["protoc", f"-I{root}", f"--python_out={out}", f"--grpc_python_out={out}", *files])
    if code != 0:
        raise SystemExit(f"protoc failed ({code}) on {', '.join(files)}")


def stale(root: Path, src: Path) -> list[str]:
    """The generated modules under ``src`` that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as scratch:
        generate(root, Path(scratch))
        wrong = []
        for proto in protos(root):
            for name in expected(root, proto):
                fresh, committed = Path(scratch) / name, src / name
                if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                    wrong.append(name)
        return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed modules are stale")
    parser.add_argument("--protos", type=Path, default=HERE, help="root of the .proto tree")
    parser.add_argument("--src", type=Path, default=SRC, help="where the modules live")
    args = parser.parse_args(argv)
    if args.check:
        wrong = stale(args.protos, args.src)
        if wrong:
            print("stale generated gRPC modules (run 'make protos'): " + ", ".join(wrong), file=sys.stderr)
            return 1
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        generate(args.protos, Path(scratch))
        for proto in protos(args.protos):
            for name in expected(args.protos, proto):
                target = args.src / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(scratch) / name, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
