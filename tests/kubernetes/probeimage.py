"""The GPU pod's image on the real node, packed here with no registry: Debian's minimal system (the
container tests' base image, ``debootstrap --variant=minbase``, built once per machine under
``~/.cache/tessera/containers``: tests/containers/runtime.py) with one more layer holding the CUDA
probe (tests/containers/cuda_probe.c, compiled on the host against the simulated driver's API:
same Debian, same glibc) at `PROBE`.

Podman saves the base image as an OCI archive; the probe's layer, a new image config and manifest
are added to it and the index names the image for containerd (``io.containerd.image.name``), which
imports it with ``ctr -n k8s.io images import`` (`KubeNode.ctr`). The archive is deterministic and
cached under ``${TESSERA_CACHE:-~/.cache/tessera}/node-images/`` by the digest of what went into it.
The image holds no driver and no libvgpu: those come into the container from the claim's CDI spec.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "containers"))
from runtime import Podman  # noqa: E402

VGPU = ROOT / "native" / "vgpu"
PROBE_SOURCE = HERE.parent / "containers" / "cuda_probe.c"
PROBE = "/usr/local/bin/cuda_probe"
REF = "tessera.local/cuda-probe:1"


def cache_dir() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")) / "node-images"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def compile_probe(out: Path) -> Path:
    sim = VGPU / "build" / "sim" / "libcuda.so"
    if not sim.exists():
        raise RuntimeError("native/vgpu is not built: run 'make native' (part of 'make test')")
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{VGPU / 'include'}", "-o", str(out),
                    str(PROBE_SOURCE), f"-L{sim.parent}", "-lcuda"], check=True)
    return out


def _layer(path: str, content: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            info = tarfile.TarInfo("/".join(parts[:i]))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        info = tarfile.TarInfo("/".join(parts))
        info.size, info.mode = len(content), 0o755
        tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def _blobs(archive: bytes) -> tuple[dict, dict[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    blobs = {"sha256:" + name.rsplit("/", 1)[1]: data for name, data in files.items() if name.startswith("blobs/")}
    return json.loads(files["index.json"]), blobs


def with_probe(base_archive: bytes, probe: bytes, ref: str = REF) -> bytes:
    """The OCI archive of ``base_archive``'s one image plus a layer with ``probe`` at `PROBE`."""
    index, blobs = _blobs(base_archive)
    [entry] = index["manifests"]
    manifest = json.loads(blobs[entry["digest"]])
    config = json.loads(blobs[manifest["config"]["digest"]])
    layer = _layer(PROBE, probe)
    gz = gzip.compress(layer, mtime=0)
    config["rootfs"]["diff_ids"].append(_sha(layer))
    config.setdefault("history", []).append({"created": "1970-01-01T00:00:00Z",
                                             "created_by": "tests/kubernetes/probeimage.py: the CUDA probe"})
    config.setdefault("config", {})["Env"] = ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"]
    config["created"] = "1970-01-01T00:00:00Z"
    config_blob = json.dumps(config, sort_keys=True).encode()
    manifest["config"] = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _sha(config_blob),
                          "size": len(config_blob)}
    manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _sha(gz),
                               "size": len(gz)})
    manifest_blob = json.dumps(manifest, sort_keys=True).encode()
    new_index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                 "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                "digest": _sha(manifest_blob), "size": len(manifest_blob),
                                "platform": {"architecture": "amd64", "os": "linux"},
                                "annotations": {"io.containerd.image.name": ref,
                                                "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}]}
    keep = [d["digest"] for d in manifest["layers"][:-1]]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        entries = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                   ("index.json", json.dumps(new_index, sort_keys=True).encode())]
        entries += [(f"blobs/sha256/{d[7:]}", blobs[d]) for d in keep]
        entries += [(f"blobs/sha256/{_sha(b)[7:]}", b) for b in (gz, config_blob, manifest_blob)]
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def build(cache: Path | None = None) -> tuple[str, Path]:
    """(image reference, OCI archive) of the probe image, built unless cached."""
    cache = cache or cache_dir()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "no-cdi").mkdir()
        podman = Podman(cdi_dir=Path(tmp) / "no-cdi")
        base = podman.base_image()
        probe = compile_probe(Path(tmp) / "cuda_probe").read_bytes()
        key = hashlib.sha256(base.encode() + probe + Path(__file__).read_bytes()).hexdigest()[:16]
        path = cache / f"cuda-probe-{key}.tar"
        if path.exists():
            return REF, path
        saved = Path(tmp) / "base.tar"
        done = podman("save", "--format", "oci-archive", "-o", str(saved), base)
        if done.code:
            raise RuntimeError(f"podman save {base} exited {done.code}: {done.stderr[-2000:]}")
        data = with_probe(saved.read_bytes(), probe)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.rename(path)
    return REF, path
