"""A local Tessera: an embedded nats-server and the five services as separate processes.

`tessera up`, `tessera demo` and the end-to-end tests all start the system this way, so what the
tests exercise is what a newcomer runs. Each service is its own OS process (its console script),
configured only through its environment; stopping sends SIGTERM to every process, waits, and kills
what is left, so a clean shutdown leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera.shared import identities
from tessera.shared import profile as profiles
from tessera.shared import secretkeys
from tessera.shared.natsserver import NatsCluster, NatsServer, die_with_parent, free_port
from tessera.shared.runner import is_ready, why_not_ready

SERVICES = ("controlplane", "capacity", "translator", "placement")


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path
    http_port: int
    metrics_port: int = 0  # its /metrics listener (tessera.shared.metrics; 0: none)

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class LocalCluster:
    """Start with ``start()``, stop with ``stop()``; ``url`` is the NATS URL clients should use."""

    workdir: Path
    profile: Path
    nats_url: str | None = None  # reuse an existing server (TESSERA_NATS_URL) instead of embedding one
    otlp_endpoint: str | None = None
    placement_replicas: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    heartbeat_seconds: float = 2.0
    lost_after_seconds: float = 10.0
    # 3: a JetStream cluster of three members on loopback (same authorization), streams and
    # buckets at R3, every client given every member's URL.
    nats_servers: int = 1
    nats: NatsServer | NatsCluster | None = None
    processes: list[ServiceProcess] = field(default_factory=list)
    passwords: dict[str, str] = field(default_factory=dict)  # NATS user -> password (embedded server)

    @property
    def url(self) -> str:
        """The URL the CLI and tests use: for the embedded server, the operator's identity."""
        return self.url_for(identities.OPERATOR)

    def url_for(self, user: str) -> str:
        if self.nats_url:
            return self.nats_url
        assert self.nats is not None, "cluster not started"
        return self.nats.url.replace("nats://", f"nats://{user}:{self.passwords[user]}@")  # every member

    def _secured_nats(self) -> NatsServer:
        """The embedded server with config-file authorization (`tessera.shared.identities`): one user
        per service (per node for enforcers) and the operator in account TESSERA, and one account per
        tenant that the control-plane manager writes into tenants.conf and reloads (tenant
        credentials work in `make up` exactly as against a production server). The plain passwords
        stay in passwords/ (0600); the server config holds bcrypt hashes."""
        auth = self.workdir / "nats-auth"
        if self.nats_servers > 1:  # each member has its own pid file (its own config includes nats.conf)
            self.passwords = identities.write_auth_dir(auth, self.nodes())
            return NatsCluster(self.workdir / "nats", auth, self.nats_servers)
        self.passwords = identities.write_auth_dir(auth, self.nodes(), pid_file=str(auth / "nats.pid"))
        conf = auth / "nats.conf"
        return NatsServer(self.workdir / "nats", config_file=conf)

    @property
    def secret_key_file(self) -> Path:
        """The manager's sealing keys (0600), in its state directory: made on the first start and
        kept with the state, since the secrets in NATS are sealed with them."""
        return self.workdir / "state" / "controlplane" / "secret-keys"

    def nodes(self) -> list[str]:
        return [n.node for n in profiles.load(self.profile)]

    def start(self, *, progress=lambda msg: None) -> "LocalCluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.nats_url:
            progress("starting nats-server with JetStream and authorization")
            self.nats = self._secured_nats().start()
            for name, url in (("nats-url", self.url), ("nats-url-viewer", self.url_for(identities.VIEWER))):
                url_file = self.workdir / name  # (the viewer's: what the read-only commands use)
                url_file.write_text(url + "\n")
                url_file.chmod(0o600)
        nodes = self.nodes()  # fail on a bad profile before starting anything else
        for name in SERVICES:
            replicas = self.placement_replicas if name == "placement" else 1
            for i in range(replicas):
                self.spawn(name, instance=f"{name}-{i}" if replicas > 1 else name)
        for node in nodes:
            self.spawn("enforcer", instance=f"enforcer-{node}", env={"TESSERA_NODE": node})
        progress(f"started {len(self.processes)} service processes for {len(nodes)} nodes")
        return self

    def service_env(self, name: str, instance: str, http_port: int, node: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        user = identities.user_for(name, node)
        env.update(
            TESSERA_NATS_URL=self.url_for(user if user in self.passwords else name),
            TESSERA_HTTP_PORT=str(http_port),
            TESSERA_INSTANCE=instance,
            TESSERA_PROFILE=str(self.profile),
            TESSERA_STATE_DIR=str(self.workdir / "state" / instance),
            TESSERA_HEARTBEAT_SECONDS=str(self.heartbeat_seconds),
            TESSERA_LOST_AFTER_SECONDS=str(self.lost_after_seconds),
            PYTHONUNBUFFERED="1",
        )
        if self.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.otlp_endpoint
        if name == "controlplane":
            secretkeys.write_key_file(self.secret_key_file)  # (an existing one is kept)
            env[secretkeys.KEY_FILE_SETTING] = str(self.secret_key_file)
        if self.nats_servers > 1:
            env["TESSERA_STREAM_REPLICAS"] = str(min(self.nats_servers, 3))
        if name == "controlplane" and self.nats is not None:
            auth = self.workdir / "nats-auth"
            # A cluster: the manager reloads its first member (the tenants' accounts reach the others
            # on their next reload; platform identities are the same everywhere).
            pid = self.nats.pid_file() if isinstance(self.nats, NatsCluster) else auth / "nats.pid"
            env.update(TESSERA_CP_NATS_AUTH_FILE=str(auth / "tenants.conf"),
                       TESSERA_CP_NATS_PID_FILE=str(pid),
                       TESSERA_CP_NATS_TENANT_URL=self.nats.url.split(",")[0])
        env.update(self.extra_env)
        return env

    def spawn(self, name: str, *, instance: str, env: dict[str, str] | None = None) -> ServiceProcess:
        port = free_port()
        full_env = self.service_env(name, instance, port, (env or {}).get("TESSERA_NODE"))
        if "TESSERA_METRICS_PORT" not in self.extra_env:  # every service's, apart from the probes
            full_env["TESSERA_METRICS_PORT"] = str(free_port())
        full_env.update(env or {})
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{instance}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [_script(f"tessera-{name}")],
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal reaches `tessera up`, which stops us
                preexec_fn=die_with_parent,
            )
        sp = ServiceProcess(instance, proc, log_path, port, int(full_env.get("TESSERA_METRICS_PORT") or 0))
        self.processes.append(sp)
        return sp

    def find(self, instance: str) -> ServiceProcess:
        for sp in self.processes:
            if sp.name == instance:
                return sp
        raise KeyError(instance)

    def dead(self) -> list[ServiceProcess]:
        return [sp for sp in self.processes if not sp.alive()]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every service answers 200 on /readyz (or fail naming those that don't)."""
        deadline = time.monotonic() + timeout
        waiting = {sp.name: sp for sp in self.processes}
        while waiting and time.monotonic() < deadline:
            for name, sp in list(waiting.items()):
                if not sp.alive():
                    raise RuntimeError(f"{name} exited with {sp.proc.returncode}; see {sp.log_path}")
                if is_ready(sp.http_port):
                    del waiting[name]
            time.sleep(0.1)
        if waiting:
            why = "; ".join(f"{name}: {why_not_ready(sp.http_port)}" for name, sp in sorted(waiting.items()))
            raise RuntimeError(f"not ready after {timeout:.0f}s: {', '.join(sorted(waiting))} ({why})")

    def stop_process(self, sp: ServiceProcess, *, timeout: float = 10.0) -> int:
        if sp.alive():
            sp.proc.send_signal(signal.SIGTERM)
            try:
                sp.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                sp.proc.kill()
                sp.proc.wait()
        return sp.proc.returncode

    def stop(self, *, timeout: float = 10.0) -> dict[str, int]:
        """SIGTERM everything at once, wait, then SIGKILL stragglers; returns exit codes."""
        for sp in self.processes:
            if sp.alive():
                sp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: dict[str, int] = {}
        for sp in self.processes:
            try:
                sp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                sp.proc.kill()
                sp.proc.wait()
            codes[sp.name] = sp.proc.returncode
        if self.nats is not None:
            self.nats.stop()
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
