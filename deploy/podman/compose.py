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

Every wait on Podman here is bounded. podman-compose 1.6 starts each container only once the ones
it depends on run (``podman wait --condition=running``, retried for ever), so one container that
fails to start (netavark without iptables: "No such file or directory") used to leave `up` waiting
for ever with the rest ``Created``. `up` watches the set while podman-compose works: the first
container Podman could not start ends it at once, with that container's name and Podman's own
message (``ComposeFailed``), and so does a podman-compose that has not finished in ``UP_TIMEOUT_S``;
either way podman-compose is killed with every process it started. Only the commands passed through
to podman-compose as they are (``ps``, ``logs -f``, ...) run as long as they run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Iterable

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
# How long each step may take before it is a failure (2 shared cores; a healthy `up -d` of the
# 16 containers takes about 20 s here, `down` about 30 s with its stop grace periods).
UP_TIMEOUT_S = 300
DOWN_TIMEOUT_S = 300
PODMAN_TIMEOUT_S = 60  # one query: image exists, ps, inspect
POLL_S = 2  # how often `up` looks at what podman-compose said while it works
STATES_EVERY_S = 10  # ... and at the containers' states, when it said nothing wrong (2 podman calls)


class ComposeFailed(RuntimeError):
    """The set did not come up (or go down) in time; the message names the containers and what
    Podman said about each."""


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


def podman(environment: dict[str, str], *args: str, timeout: float = PODMAN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """One ``podman`` command, killed (``podmanhost.Overran``) when it has not answered in ``timeout``."""
    return podmanhost.run_bounded(["podman", *args], timeout, env=environment, what=f"podman {' '.join(args)}")


def missing_images(environment: dict[str, str]) -> list[str]:
    tags = sorted({svc["image"] for svc in services().values()})
    return [t for t in tags if podman(environment, "image", "exists", t).returncode != 0]


def container_states(environment: dict[str, str]) -> list[dict]:
    """This set's containers as ``podman inspect`` has them: [{"Name", "State": {"Status", "Error", ...}}]."""
    names = podman(environment, "ps", "-a", "--format", "{{.Names}}", "--filter",
                   f"label=io.podman.compose.project={PROJECT}").stdout.split()
    if not names:
        return []
    # One may be removed between the two calls: inspect then fails for it and still lists the others.
    inspected = podman(environment, "container", "inspect", *names).stdout
    try:
        found = json.loads(inspected or "[]")
    except json.JSONDecodeError:
        return []
    return sorted(found, key=lambda c: c.get("Name", ""))


# What `podman start` prints when it cannot start a container (podman-compose passes it through):
# the container's full id, then Podman's own reason.
START_ERROR = re.compile(r'Error: unable to start container "([0-9a-f]{12,64})": (.*)')


def not_started(states: Iterable[dict], start_errors: dict[str, str] | None = None) -> list[dict]:
    """The containers Podman tried to start and could not, each with Podman's reason as its
    ``State.Error``: from `podman start`'s own error (``start_errors``: id -> message, what
    podman-compose printed), or the one Podman kept in the container's state."""
    broken = []
    for c in states:
        state = c.get("State", {})
        said = next((message for cid, message in (start_errors or {}).items() if c.get("Id", "").startswith(cid)), "")
        if state.get("Status") != "running" and (said or state.get("Error")):
            broken.append({**c, "State": {**state, "Error": said or state["Error"]}})
    return broken


def describe(states: Iterable[dict]) -> str:
    lines = []
    for c in states:
        state = c.get("State", {})
        line = f"  {c.get('Name', '?')}: {state.get('Status', '?')}"
        if state.get("Error"):
            line += f": podman says: {state['Error']}"
        lines.append(line)
    return "\n".join(lines)


def _hint(states: Iterable[dict]) -> str:
    if any("netavark" in c.get("State", {}).get("Error", "") for c in states):
        return ("\n(netavark sets up the compose network with iptables: 'make container-tools' installs it; "
                "deploy/compose/README.md, \"Troubleshooting\")")
    return ""


def write_secrets() -> None:
    """The NATS users' passwords and the manager's keys, once; readable by the services' uid 10001.

    Podman bind-mounts a compose secret file as it is, and these are written 0600 for the user who ran
    the CLI; the services run as uid 10001, so the files are made world-readable (a machine one
    person uses: see deploy/compose/README.md, "Limits of this setup")."""
    commands = []
    if not (AUTH_DIR / "nats.conf").exists():
        commands.append([str(BIN / "tessera"), "nats-auth", "--out", str(AUTH_DIR),
                         "--profile", str(ROOT / "profiles" / "demo.yaml")])
    if not SECRET_KEYS.exists():
        commands.append([str(BIN / "tessera"), "secret-key", "--out", str(SECRET_KEYS)])
    for argv in commands:
        done = podmanhost.run_bounded(argv, 120, stdout=None, stderr=subprocess.PIPE)
        if done.returncode != 0:
            raise ComposeFailed(f"{' '.join(argv[1:3])} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    for path in [SECRET_KEYS, *sorted((AUTH_DIR / "passwords").iterdir())]:
        path.chmod(0o644)


def compose_argv(*args: str) -> list[str]:
    argv = [str(BIN / "podman-compose"), "--project-name", PROJECT]
    for file in FILES:
        argv += ["-f", str(file)]
    return [*argv, *args]


def podman_compose(*args: str, environment: dict[str, str] | None = None) -> int:
    """Any other podman-compose command, as the user typed it (``logs -f`` runs until Ctrl-C)."""
    return subprocess.run(compose_argv(*args), env=environment or env()).returncode


def stop_stale_dns(environment: dict[str, str]) -> None:
    """Stops an aardvark-dns left from an earlier set, so the next `up` starts a fresh one.

    Bookworm's aardvark-dns (1.4) can outlive the set whose names it serves, bound to the gateway
    address of a bridge that `down` deleted; told about the next set's containers it still answers
    nothing, and every service fails with "Name or service not known" for nats-1. It is stopped
    (by its pid file) only when no container of ours runs and it serves no network but this set's."""
    pid_file = AARDVARK_DIR / "aardvark.pid"
    if not pid_file.exists():
        return
    running = podman(environment, "ps", "-q").stdout.split()
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


def _pump(stream: IO[str], kept: deque, start_errors: dict[str, str], echo: bool) -> None:
    for line in stream:
        kept.append(line)
        failed = START_ERROR.search(line)
        if failed:
            start_errors[failed.group(1)] = failed.group(2).strip()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def up(environment: dict[str, str] | None = None, timeout: float = UP_TIMEOUT_S, echo: bool = True) -> None:
    """``podman-compose up -d``, watched: returns once it has started every container, or raises
    ``ComposeFailed`` as soon as Podman could not start one (naming it, with Podman's message), or when
    podman-compose has not finished in ``timeout`` seconds. podman-compose's output is passed on
    (``echo``) and its end quoted in the error.

    podman-compose starts the containers one after the other, each once those it depends on run
    (``podman wait --condition=running``, retried for ever); a container whose start failed never
    runs, so the first failure is the end of `up`, and podman-compose is killed with its waits."""
    environment = environment or env()
    missing = missing_images(environment)
    if missing:
        raise podmanhost.PodmanMissing(f"images not built: {', '.join(missing)}: run 'make images' first")
    write_secrets()
    stop_stale_dns(environment)
    said: deque[str] = deque(maxlen=60)
    start_errors: dict[str, str] = {}
    started = time.monotonic()
    proc = subprocess.Popen(compose_argv("up", "-d"), env=environment, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader = threading.Thread(target=_pump, args=(proc.stdout, said, start_errors, echo), daemon=True)
    reader.start()

    def failed(why: str, states: list[dict]) -> ComposeFailed:
        """The error: ``why``, each container Podman could not start with its reason, the others
        not running, a hint, and podman-compose's last lines (less the ids it prints, and the
        systemd noise of a machine without systemd)."""
        broken = not_started(states, dict(start_errors))
        named = {c["Name"] for c in broken}
        idle = [f"{c['Name']} ({c.get('State', {}).get('Status', '?')})" for c in states
                if c["Name"] not in named and c.get("State", {}).get("Status") != "running"]
        tail = "".join(line for line in said if "systemd" not in line and not re.fullmatch(r"[0-9a-f]{64}\s*", line))
        return ComposeFailed(
            f"compose up: {why} ({time.monotonic() - started:.0f} s after podman-compose began)"
            + (f"\n{describe(broken)}" if broken else "")
            + (f"\nnot running either: {', '.join(idle)}" if idle else "")
            + _hint(broken)
            + (f"\npodman-compose's last lines:\n{tail.rstrip()}" if tail.strip() else ""))

    looked = started
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            overran = time.monotonic() - started > timeout
            if not (start_errors or overran or time.monotonic() - looked >= STATES_EVERY_S):
                continue
            looked = time.monotonic()
            states = container_states(environment)
            broken = not_started(states, dict(start_errors))
            if broken:
                raise failed(f"podman could not start {len(broken)} container(s); podman-compose, which waits "
                             f"for ever for a container that never runs, was stopped", states)
            if overran:
                raise failed(f"podman-compose up -d did not finish in {timeout:.0f} s and was stopped", states)
    finally:
        if proc.poll() is None:  # failed, overran or interrupted: it and its `podman wait`s go
            podmanhost.kill_group(proc)
        reader.join(timeout=5)  # the pipe closes once its writers are gone; one outside the group is not waited for
        if not reader.is_alive():
            proc.stdout.close()
    states = container_states(environment)
    never = [c["Name"] for c in states if c.get("State", {}).get("Status") == "created"]
    if code != 0 or not_started(states, dict(start_errors)) or never:
        raise failed(f"podman-compose up -d exited {code}" + (f"; never started: {', '.join(never)}" if never else ""),
                     states)


def down(*args: str, environment: dict[str, str] | None = None, timeout: float = DOWN_TIMEOUT_S,
         capture: bool = False) -> subprocess.CompletedProcess:
    """``podman-compose down ARGS``; ``ComposeFailed`` when it has not finished in ``timeout`` seconds."""
    environment = environment or env()
    pipe = subprocess.PIPE if capture else None
    try:
        done = podmanhost.run_bounded(compose_argv("down", *args), timeout, env=environment, stdout=pipe,
                                      stderr=pipe, what="podman-compose down")
    except podmanhost.Overran as exc:
        raise ComposeFailed(f"compose down: {exc}\n{describe(container_states(environment))}") from None
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
        return podman_compose(*argv)
    except (podmanhost.PodmanMissing, podmanhost.Overran, ComposeFailed) as exc:
        print(f"compose: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
