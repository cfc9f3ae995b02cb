"""`make images`: every image the compose set runs, built with Podman on this machine.

The five Tessera images come from services/<name>/Dockerfile with the repository root as context,
tagged as deploy/compose/compose.yaml names them (tessera/<name>:0.1.0). Those Dockerfiles are
written from one template (deploy/images/dockerfiles.py, `make dockerfiles`); one that is not what
the template writes is refused here, before anything is built. Their base is the upstream
python:3.11-slim-bookworm when it can be pulled (or is already here); on a machine that reaches no
registry it is python-base.Containerfile built on Debian's minbase (podmanhost.debian_base), passed
as ``--build-arg PYTHON_IMAGE=``. The images compose.local.yaml swaps in (nats, prometheus, the
Jaeger stand-in) are built from deploy/compose/local/*.Containerfile, tagged as that file names them.

Builds use the host network (apt and pip inside them), and see the host's CA bundle over the base
image's own (/etc/ssl/certs/ca-certificates.crt, mounted for the build only, never part of an
image), so that a TLS-inspecting proxy in front of PyPI is trusted as the host trusts it: Debian's
pip (the venv's first) reads that file, and pip 25.3 (which the Dockerfiles install) the system
store. A mount point that does not exist in the base would be left in the image as an empty file,
which is why no pip.conf is mounted. Each image's build log goes to
var/images/<image>.log; a summary (seconds, size) is printed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "images"))
import dockerfiles  # noqa: E402
import podmanhost  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
LOCAL = COMPOSE / "local"
LOGS = ROOT / "var" / "images"
UPSTREAM_PYTHON = "docker.io/library/python:3.11-slim-bookworm"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PYTHON_BASE = Path(__file__).parent / "python-base.Containerfile"
# compose.local.yaml's services -> the Containerfile of the image it names for them
LOCAL_IMAGES = {"nats-1": "nats", "prometheus": "prometheus", "jaeger": "otlp-sink"}


@dataclass
class Built:
    name: str
    tag: str
    seconds: float
    size: int


class Builder:
    def __init__(self) -> None:
        self.podman = podmanhost.find_tools("podman")["podman"]
        self.env = podmanhost.configure()
        self.built: list[Built] = []
        LOGS.mkdir(parents=True, exist_ok=True)

    def run(self, args, stdin=None, timeout: float = 120) -> subprocess.CompletedProcess:
        """One podman command; ``podmanhost.Overran`` (it and what it started killed) after ``timeout``."""
        return podmanhost.run_bounded([self.podman, *args], timeout, env=self.env,
                                      stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                      what=f"podman {' '.join(args[:2])}")

    def build(self, name: str, tag: str, containerfile: Path, context: Path, build_args: dict[str, str],
              trust_host_ca: bool = True) -> None:
        args = ["build", "--network", "host", "--pull=never", "-f", str(containerfile), "-t", tag]
        if trust_host_ca and CA_BUNDLE.exists():
            args += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        log = LOGS / f"{name}.log"
        shown = containerfile.relative_to(ROOT) if containerfile.is_relative_to(ROOT) else containerfile.name
        print(f"building {tag} ({shown}) ... log: {log.relative_to(ROOT)}", flush=True)
        started = time.monotonic()
        with log.open("w") as out:
            done = podmanhost.run_bounded(["nice", "-n", "10", self.podman, *args, str(context)], 1800, env=self.env,
                                          stdout=out, stderr=subprocess.STDOUT, what=f"podman build {tag}")
        seconds = time.monotonic() - started
        if done.returncode != 0:
            tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
            raise SystemExit(f"{tag}: podman build failed (exit {done.returncode}) after {seconds:.0f} s; "
                             f"the end of {log}:\n{tail}")
        size = int(self.run(["image", "inspect", "--format", "{{.Size}}", tag]).stdout.strip() or 0)
        self.built.append(Built(name, tag, seconds, size))
        print(f"  {tag}: {seconds:.0f} s, {size / 1e6:.0f} MB", flush=True)

    # --- bases ------------------------------------------------------------------------------------

    def debian(self) -> str:
        if not hasattr(self, "_debian"):
            started = time.monotonic()
            self._debian = podmanhost.debian_base(self.run)
            seconds = time.monotonic() - started
            size = int(self.run(["image", "inspect", "--format", "{{.Size}}", self._debian]).stdout.strip() or 0)
            self.built.append(Built("debian-base", self._debian, seconds, size))
            print(f"Debian base: {self._debian} ({seconds:.0f} s; 0 s: already built)", flush=True)
        return self._debian

    def python_base(self) -> str:
        """The upstream image if it is here or can be pulled, else one built from Debian's packages."""
        if self.run(["image", "exists", UPSTREAM_PYTHON]).returncode == 0:
            return UPSTREAM_PYTHON
        pulled = self.run(["pull", "-q", UPSTREAM_PYTHON], timeout=300)
        if pulled.returncode == 0:
            return UPSTREAM_PYTHON
        reason = (pulled.stderr.strip().splitlines() or ["no reason given"])[-1]
        print(f"cannot pull {UPSTREAM_PYTHON} ({reason}): building a Python base from Debian's packages", flush=True)
        debian = self.debian()
        digest = hashlib.sha256(PYTHON_BASE.read_bytes() + debian.encode()).hexdigest()[:12]
        tag = f"localhost/tessera/python-base:3.11-bookworm-{digest}"
        if self.run(["image", "exists", tag]).returncode != 0:
            self.build("python-base", tag, PYTHON_BASE, PYTHON_BASE.parent, {"DEBIAN_IMAGE": debian},
                       trust_host_ca=False)  # apt over http; it installs the CA bundle path itself
        return tag


def service_images() -> dict[str, str]:
    """Tessera service -> the tag compose.yaml gives its image (from the Dockerfile it builds)."""
    out = {}
    for svc in yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"].values():
        if "build" in svc:
            out[svc["build"]["dockerfile"].split("/")[1]] = svc["image"]
    return out


def local_images() -> dict[str, str]:
    """Containerfile name under deploy/compose/local -> the tag compose.local.yaml runs it as."""
    services = yaml.safe_load((COMPOSE / "compose.local.yaml").read_text())["services"]
    return {containerfile: services[svc]["image"] for svc, containerfile in LOCAL_IMAGES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="only these images (service names, nats, prometheus, otlp-sink)")
    args = parser.parse_args(argv)
    services, local = service_images(), local_images()
    unknown = set(args.names) - set(services) - set(local)
    if unknown:
        parser.error(f"no such image: {', '.join(sorted(unknown))} (known: {', '.join([*services, *local])})")
    wanted = set(args.names) or set(services) | set(local)
    generated = {image.service: image.path() for image in dockerfiles.IMAGES}
    if set(services) - set(generated):
        parser.error(f"compose.yaml builds {', '.join(sorted(set(services) - set(generated)))}, which "
                     f"deploy/images/dockerfiles.py has no entry for: add one")
    stale = [path for path in dockerfiles.stale() if path.parent.name in wanted]
    if stale:
        print(f"make images: {', '.join(str(p.relative_to(ROOT)) for p in stale)} not what the template writes: "
              f"run 'make dockerfiles' (or edit deploy/images/ instead of the generated file)", file=sys.stderr)
        return 1
    try:
        builder = Builder()
        if wanted & (set(services) | {"otlp-sink"}):
            python = builder.python_base()
            print(f"PYTHON_IMAGE={python}", flush=True)
        for service, tag in services.items():
            if service in wanted:
                builder.build(service, tag, generated[service], ROOT, {"PYTHON_IMAGE": python})
        for name, tag in local.items():
            if name not in wanted:
                continue
            with tempfile.TemporaryDirectory(prefix=f"{name}-context-") as context:
                shutil.copy(LOCAL / f"{name}.Containerfile", context)
                if name == "otlp-sink":
                    shutil.copy(LOCAL / "otlp_sink.py", context)
                    build_args = {"PYTHON_IMAGE": python}
                else:
                    build_args = {"DEBIAN_IMAGE": builder.debian()}
                if name == "nats":
                    from tessera.shared.natsserver import find_binary  # the pinned wheel's server, in the venv

                    shutil.copy(find_binary(), Path(context) / "nats-server")
                builder.build(name, tag, Path(context) / f"{name}.Containerfile", Path(context), build_args)
    except (podmanhost.PodmanMissing, podmanhost.Overran) as exc:
        print(f"make images: {exc}", file=sys.stderr)
        return 1
    print(f"\n{'image':<58} {'build s':>8} {'size MB':>8}  (size: the whole image, base layers included)")
    for b in builder.built:
        print(f"{b.tag:<58} {b.seconds:>8.0f} {b.size / 1e6:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
