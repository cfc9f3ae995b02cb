"""`make dockerfiles`: the five services/<name>/Dockerfile, written from one template.

The images differ in a few places only (the enforcer's compiled libvgpu.so stage, placement's C
compiler for its core, the files and variables a runtime needs); everything else, the two-stage
install with the pyproject pins, the unprivileged user, the probe port and the health check, is
service.Dockerfile.in here, once. Each service's differences are one `Image` entry below.

The generated files stay in the tree, where compose.yaml, `make images` (deploy/podman/images.py)
and a plain `docker build -f services/<name>/Dockerfile .` expect them; `--check` (and
tests/deploy/test_dockerfiles_are_generated.py) fails when one is not what this writes.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TEMPLATE = HERE / "service.Dockerfile.in"

TWO_STAGES = ("Stage 1 installs libs/shared and the service, with the exact pins of their pyproject.toml "
              "files, into a virtual environment{compiling}; stage 2 copies only that environment onto a "
              "clean slim base and runs it as an unprivileged user.")
PROBES = "The probe server listens on 0.0.0.0:8080 (/healthz, /readyz)."


@dataclass(frozen=True)
class Image:
    service: str
    summary: str  # what the service does, for the header
    stages: str = ""  # the header's account of the stages, when not the usual two
    compiling: str = ""  # what stage 1 also compiles (words for the usual account)
    native_stage: str = ""  # a stage before `build`
    build_packages: tuple[str, ...] = ()  # Debian packages the build stage needs
    install_note: str = ""  # a comment above the install
    install_checks: tuple[str, ...] = ()  # commands after `pip check`, in the same RUN
    runtime_files: str = ""  # instructions after the venv is copied into the runtime stage
    env: tuple[tuple[str, str], ...] = ()  # variables beyond the probe server's

    def path(self, root: Path = ROOT) -> Path:
        return root / "services" / self.service / "Dockerfile"


ENFORCER_NATIVE = """
# Same Debian release as the runtime, so libvgpu.so links against the glibc it will meet.
FROM ${PYTHON_IMAGE} AS native
RUN apt-get update \\
 && apt-get install -y --no-install-recommends gcc libc6-dev make \\
 && rm -rf /var/lib/apt/lists/*
COPY native/vgpu /src/native/vgpu
RUN make -C /src/native/vgpu
"""

IMAGES = (
    Image("capacity", "per-node GPU inventory, heartbeats, ResourceSlices",
          runtime_files="""\
# The demo fleet, so that the default TESSERA_PROFILE (profiles/demo.yaml, relative) works as is;
# compose mounts the same file over it, Kubernetes uses TESSERA_DISCOVERY=nvml instead.
COPY profiles /opt/tessera/profiles
"""),
    Image("controlplane", "the control-plane manager: tenants, datastores, PKI, host manifests"),
    Image("enforcer", "prepares allocated claims on its node, CDI specs, releases; and the libvgpu.so it "
          "hands to workloads",
          stages="Three stages: native/vgpu compiled with gcc (no CUDA headers needed: include/cuda_types.h "
                 "declares what is used), libs/shared + the service installed with their pyproject pins into "
                 "a virtual environment, and a slim runtime that carries both and runs as an unprivileged user "
                 "by default (the Kubernetes DaemonSet overrides the user to write the node's /var/run/cdi).",
          native_stage=ENFORCER_NATIVE,
          runtime_files="""\
# /usr/local/lib/tessera/libvgpu.so is also the enforcer's built-in fallback for TESSERA_LIBVGPU.
# sim/ is the simulated CUDA driver and NVML, for simulated-hardware runs without a GPU;
# tessera-cdi-hook is the CDI specs' createContainer hook (TESSERA_CDI_HOOK's fallback too).
COPY --from=native /src/native/vgpu/build/libvgpu.so /usr/local/lib/tessera/libvgpu.so
COPY --from=native /src/native/vgpu/build/tessera-cdi-hook /usr/local/lib/tessera/tessera-cdi-hook
COPY --from=native /src/native/vgpu/build/sim/ /usr/local/lib/tessera/sim/
# Mount points owned by the service user, so that named volumes (compose) start out writable by it.
RUN mkdir -p /var/lib/tessera/enforcer /var/run/cdi \\
 && chown -R 10001:10001 /var/lib/tessera /var/run/cdi
""",
          env=(("TESSERA_STATE_DIR", "/var/lib/tessera/enforcer"), ("TESSERA_CDI_DIR", "/var/run/cdi"),
               ("TESSERA_LIBVGPU", "/usr/local/lib/tessera/libvgpu.so"))),
    Image("placement", "node and GPU choice under quota, the compare-and-set allocation ledger",
          compiling=", compiling the fragmentation-aware core (_fgdcore.c: gcc and the base image's Python headers)",
          build_packages=("gcc", "libc6-dev"),
          install_note="(the core's build is optional for pip; in this image it must have happened)",
          install_checks=('/opt/venv/bin/python -c "import tessera.placement._fgdcore"',)),
    Image("translator", "HAMi GPU requests to validated DRA-shaped claims, and the admission webhook"),
)


def _comment(text: str) -> str:
    return "\n".join(f"# {line}" for line in textwrap.wrap(text, width=98, break_on_hyphens=False))


def render(image: Image) -> str:
    name = image.service
    header = "\n".join((
        _comment(f"The {name} image (tessera-{name}: {image.summary})."),
        _comment("Generated by deploy/images/dockerfiles.py from deploy/images/service.Dockerfile.in: edit "
                 "those and run `make dockerfiles`, not this file."),
        "# Build from the repository root, which is the context: tessera.shared lives outside the service.",
        f"#   docker build -f services/{name}/Dockerfile -t tessera/{name}:0.1.0 .",
        _comment(image.stages or f"{TWO_STAGES.format(compiling=image.compiling)} {PROBES}"),
    ))
    packages = ""
    if image.build_packages:
        packages = ("RUN apt-get update \\\n"
                    f" && apt-get install -y --no-install-recommends {' '.join(image.build_packages)} \\\n"
                    " && rm -rf /var/lib/apt/lists/*\n")
    install = (f"# {image.install_note}\n" if image.install_note else "") + " \\\n && ".join((
        f"RUN /opt/venv/bin/pip install /src/libs/shared /src/services/{name}",
        "/opt/venv/bin/pip check",
        *image.install_checks,
    ))
    env = "".join(f" \\\n    {key}={value}" for key, value in image.env)
    text = TEMPLATE.read_text()
    for key, value in (("@HEADER@", header), ("@NATIVE_STAGE@", image.native_stage),
                       ("@BUILD_PACKAGES@", packages), ("@INSTALL@", install),
                       ("@RUNTIME_FILES@", image.runtime_files), ("@ENV@", env), ("@SERVICE@", name)):
        text = text.replace(key, value)
    return text


def stale(root: Path = ROOT) -> list[Path]:
    """The Dockerfiles under ``root`` that are not what the template writes (missing ones included)."""
    return [image.path(root) for image in IMAGES
            if not image.path(root).exists() or image.path(root).read_text() != render(image)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether every Dockerfile is current")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"{path.relative_to(ROOT)} is out of date: run 'make dockerfiles'", file=sys.stderr)
        return 1 if old else 0
    for image in IMAGES:
        image.path().write_text(render(image))
        print(f"wrote {image.path().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
