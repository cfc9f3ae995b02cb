#!/usr/bin/env python3
"""The real node's images, built here with no registry: OCI image archives that containerd imports
(`ctr -n k8s.io images import`).

- ``pause``: the pod sandbox image (containerd's ``pinned_images.sandbox``), one static binary
  compiled from tools/kube/pause/pause.c with gcc.
- ``busybox``: a test image, Debian's static busybox (``busybox-static``: /bin/busybox) with a link
  for each of its applets under /bin.

Each archive is deterministic (fixed times, owners and order) and cached per machine under
``${TESSERA_CACHE:-~/.cache/tessera}/node-images/`` by the digest of what went into it; a cached
one is not built again. Standard library only.

    tools/kube/images.py [pause|busybox ...]    # prints "<name> <image ref> <archive>" per image
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
PAUSE_SOURCE = HERE / "pause" / "pause.c"
BUSYBOX = Path("/bin/busybox")
REFS = {"pause": "tessera.local/pause:3.10", "busybox": "tessera.local/busybox:1.35"}
DIRS = ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "run")


def cache_dir() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")) / "node-images"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer(files: dict[str, bytes | str]) -> bytes:
    """An uncompressed tar of ``files``: path -> bytes (an executable) or str (a symlink target);
    plus the usual empty directories, all owned by root, time 0."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in DIRS:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for path in sorted(files):
            content = files[path]
            info = tarfile.TarInfo(path)
            if isinstance(content, str):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, content, 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o755
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def oci_archive(ref: str, files: dict[str, bytes | str], config: dict) -> bytes:
    """An OCI image layout as a tar (what `ctr images import` reads), naming the image ``ref``."""
    layer = _layer(files)
    gz = gzip.compress(layer, mtime=0)
    image_config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [_sha(layer)]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "tools/kube/images.py"}],
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _sha(image_config), "size": len(image_config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": _sha(gz), "size": len(gz)}],
    }, sort_keys=True).encode()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": _sha(manifest), "size": len(manifest),
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": ref,
                                       "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}],
    }, sort_keys=True).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)]
        entries += [(f"blobs/sha256/{_sha(b)[7:]}", b) for b in (gz, image_config, manifest)]
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _compile_pause() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O2", "-static", "-s",
                        "-o", str(binary), str(PAUSE_SOURCE)], check=True)
        return binary.read_bytes()


def _busybox_files() -> dict[str, bytes | str]:
    if not BUSYBOX.exists():
        raise SystemExit("tools/kube/images.py: /bin/busybox is missing: tests/kubernetes/install-node.sh "
                         "installs Debian's busybox-static")
    applets = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True, text=True).stdout.split()
    files: dict[str, bytes | str] = {"bin/busybox": BUSYBOX.read_bytes()}
    files.update({f"bin/{a}": "busybox" for a in applets if a != "busybox"})
    return files


def _inputs(name: str) -> bytes:
    me = Path(__file__).read_bytes()
    if name == "pause":
        return me + PAUSE_SOURCE.read_bytes()
    return me + (BUSYBOX.read_bytes() if BUSYBOX.exists() else b"")


def build(name: str) -> Path:
    """The archive of image ``name`` (``pause`` or ``busybox``), built unless cached."""
    ref = REFS[name]
    key = hashlib.sha256(_inputs(name)).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.tar"
    if path.exists():
        return path
    if name == "pause":
        files: dict[str, bytes | str] = {"pause": _compile_pause()}
        config = {"Entrypoint": ["/pause"], "User": "65535:65535"}
    else:
        files = _busybox_files()
        config = {"Cmd": ["sh"], "Env": ["PATH=/bin"]}
    data = oci_archive(ref, files, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.rename(path)
    return path


def main(argv: list[str]) -> int:
    for name in argv or list(REFS):
        if name not in REFS:
            print(f"tools/kube/images.py: no image '{name}' (have: {', '.join(REFS)})", file=sys.stderr)
            return 2
        print(name, REFS[name], build(name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
