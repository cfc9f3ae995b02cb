"""`make compose-up` / `make compose-down`: the compose set run by podman-compose on this machine.

compose.yaml plus compose.local.yaml (the images `make images` builds here instead of the three
third-party ones), with Podman configured as podmanhost.py says, under the project name ``tessera``.
Before `up` it writes what the set mounts and git does not keep (the NATS authorization and the
manager's secret keys, with the tessera CLI) and checks that every image is built, so that
podman-compose never falls back to building or pulling one itself. The compose smoke test
(tests/compose) drives the set through these same functions.

    python deploy/podman/compose.py up        # detached; `make compose-up`
    python deploy/podman/compose.py down      # containers and network; `make compose-down`
    python deploy/podman/compose.py down -v   # ... and the volumes (NATS data, enforcer state)
    python deploy/podman/compose.py ps        # anything else is passed to podman-compose
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
import podmanhost  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
FILES = (COMPOSE_DIR / "compose.yaml", COMPOSE_DIR / "compose.local.yaml")
PROJECT = "tessera"  # compose.yaml's `name`
AUTH_DIR = COMPOSE_DIR / "nats-auth"
SECRET_KEYS = COMPOSE_DIR / "controlplane-secret-keys"
BIN = Path(sys.executable).parent  # the venv: tessera and podman-compose are installed there
# netavark's DNS server for rootful networks (a fixed path: not under podmanhost's cache).
AARDVARK_DIR = Path("/run/containers/networks/aardvark-dns")
NETWORK = f"{PROJECT}_default"


def published_ports() -> dict[str, int]:
    """compose.yaml's host-port variables (``${TESSERA_COMPOSE_<WHAT>_PORT:-default}``) -> default."""
    found = re.findall(r"\$\{(TESSERA_COMPOSE_\w+_PORT):-(\d+)\}", FILES[0].read_text())
    return {name: int(default) for name, default in found}


def host_port(environment: dict[str, str], variable: str) -> int:
    """Where the set publishes that port on 127.0.0.1 under ``environment``."""
    return int(environment.get(variable) or published_ports()[variable])


def host_nats_url(environment: dict[str, str]) -> str:
    """The three members' client ports as the host reaches them (TESSERA_NATS_URL for the CLI)."""
    return ",".join(f"nats://127.0.0.1:{host_port(environment, f'TESSERA_COMPOSE_NATS_{n}_PORT')}" for n in (1, 2, 3))


def env() -> dict[str, str]:
    podmanhost.find_tools("podman", "runc")
    podmanhost.require_network_backend()
    return podmanhost.configure()


def services() -> dict[str, dict]:
    """compose.yaml's services with compose.local.yaml's changes (the keys it sets) laid over them."""
    merged = yaml.safe_load(FILES[0].read_text())["services"]
    for name, changes in yaml.safe_load(FILES[1].read_text())["services"].items():
        merged[name] = {**merged[name], **changes}
    return merged


def missing_images(environment: dict[str, str]) -> list[str]:
    tags = sorted({svc["image"] for svc in services().values()})
    return [t for t in tags if subprocess.run(["podman", "image", "exists", t], env=environment).returncode != 0]


def write_secrets() -> None:
    """The NATS users' passwords and the manager's keys, once; readable by the services' uid 10001.

    Podman bind-mounts a compose secret file as it is, and these are written 0600 for the user who ran
    the CLI; the services run as uid 10001, so the files are made world-readable (a machine one
    person uses: see deploy/compose/README.md, "Limits of this setup")."""
    if not (AUTH_DIR / "nats.conf").exists():
        subprocess.run([str(BIN / "tessera"), "nats-auth", "--out", str(AUTH_DIR),
                        "--profile", str(ROOT / "profiles" / "demo.yaml")], check=True)
    if not SECRET_KEYS.exists():
        subprocess.run([str(BIN / "tessera"), "secret-key", "--out", str(SECRET_KEYS)], check=True)
    for path in [SECRET_KEYS, *sorted((AUTH_DIR / "passwords").iterdir())]:
        path.chmod(0o644)


def podman_compose(*args: str, environment: dict[str, str] | None = None, check: bool = True,
                   capture: bool = False, timeout: float | None = None) -> subprocess.CompletedProcess:
    argv = [str(BIN / "podman-compose"), "--project-name", PROJECT]
    for file in FILES:
        argv += ["-f", str(file)]
    return subprocess.run([*argv, *args], env=environment or env(), check=check, capture_output=capture,
                          text=True, timeout=timeout)


def stop_stale_dns(environment: dict[str, str]) -> None:
    """Stops an aardvark-dns left from an earlier set, so the next `up` starts a fresh one.

    Bookworm's aardvark-dns (1.4) can outlive the set whose names it serves, bound to the gateway
    address of a bridge that `down` deleted; told about the next set's containers it still answers
    nothing, and every service fails with "Name or service not known" for nats-1. It is stopped
    (by its pid file) only when no container of ours runs and it serves no network but this set's."""
    pid_file = AARDVARK_DIR / "aardvark.pid"
    if not pid_file.exists():
        return
    running = subprocess.run(["podman", "ps", "-q"], env=environment, capture_output=True, text=True).stdout.split()
    others = [p.name for p in AARDVARK_DIR.iterdir() if p.name not in ("aardvark.pid", NETWORK)]
    if running or others:
        return
    try:
        pid = int(pid_file.read_text().strip())
        if b"aardvark-dns" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGTERM)
            for _ in range(50):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
    except (ValueError, OSError):
        pass  # no such process: only the stale files are left
    for name in ("aardvark.pid", NETWORK):
        (AARDVARK_DIR / name).unlink(missing_ok=True)


def up(environment: dict[str, str] | None = None, timeout: float | None = None) -> None:
    environment = environment or env()
    missing = missing_images(environment)
    if missing:
        raise podmanhost.PodmanMissing(f"images not built: {', '.join(missing)}: run 'make images' first")
    write_secrets()
    stop_stale_dns(environment)
    podman_compose("up", "-d", environment=environment, timeout=timeout)


def down(*args: str, environment: dict[str, str] | None = None, timeout: float | None = None,
         capture: bool = False) -> subprocess.CompletedProcess:
    environment = environment or env()
    done = podman_compose("down", *args, environment=environment, check=False, capture=capture, timeout=timeout)
    stop_stale_dns(environment)
    return done


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if argv == ["up"]:
            up()
            return 0
        if argv[0] == "down":
            return down(*argv[1:]).returncode
        return podman_compose(*argv, check=False).returncode
    except podmanhost.PodmanMissing as exc:
        print(f"compose: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
