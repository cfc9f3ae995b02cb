"""A PostgreSQL server the tests own: started once per session on a free port in a temporary data
directory, removed at the end. Nothing depends on a server the machine happens to run.

The superuser `postgres` is trusted on loopback (the admin URL carries no password, as the
control-plane manager's setting does); every other role must present its SCRAM password, so a
tenant role's password is checked for real. PostgreSQL refuses to run as root: under root the
server runs as the `postgres` system user that Debian's package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tessera.shared.natsserver import free_port, wait_for_port

from kit import processes

INSTALL = "make datastore-tools"


def _bindir() -> Path:
    """The newest installed server's bin directory (Debian's layout, or the one on PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("postgres")
    if on_path:
        return Path(on_path).resolve().parent
    raise RuntimeError(f"the PostgreSQL server is not installed: run `{INSTALL}` (Debian's postgresql package)")


@dataclass(frozen=True)
class Postgres:
    port: int
    datadir: Path

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


def _run_as() -> tuple[dict, int | None]:
    if os.geteuid() != 0:
        return {}, None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError as exc:
        raise RuntimeError(f"PostgreSQL cannot run as root and there is no 'postgres' user: run `{INSTALL}`") from exc
    return {"user": user.pw_uid, "group": user.pw_gid}, user.pw_uid


def start_postgres() -> tuple[Postgres, subprocess.Popen]:
    bindir = _bindir()
    as_user, uid = _run_as()
    # not under pytest's basetemp: that directory is 0700 root, which the server's user cannot enter
    datadir = Path(tempfile.mkdtemp(prefix="tessera-pg-"))
    if uid is not None:
        os.chown(datadir, uid, -1)
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(datadir / "data"), "-U", "postgres", "--auth=trust",
         "--encoding=UTF8", "--locale=C", "--no-sync"],
        check=True, capture_output=True, **as_user,
    )
    (datadir / "data" / "pg_hba.conf").write_text(
        "local all all trust\n"
        "host all postgres 127.0.0.1/32 trust\n"
        "host all all 127.0.0.1/32 scram-sha-256\n"
    )
    port = free_port()
    proc = processes.spawn(
        [str(bindir / "postgres"), "-D", str(datadir / "data"), "-p", str(port), "-h", "127.0.0.1",
         "-k", str(datadir), "-c", "fsync=off", "-c", "max_connections=200", "-c", "log_min_messages=warning"],
        datadir / "postgres.log", **as_user,
    )
    try:
        wait_for_port(port, 30, proc)
        _wait_accepting(Postgres(port, datadir), proc)
    except Exception:
        stop_postgres(Postgres(port, datadir), proc)
        raise
    return Postgres(port, datadir), proc


def _wait_accepting(server: Postgres, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """The port opens before recovery ends: until then every login is "the database system is
    starting up" (a test that connects first in its session saw it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(server.admin_url, connect_timeout=5).close()
            return
        except psycopg.OperationalError as exc:
            if "starting up" not in str(exc) or proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not accept connections: {exc}") from None
            time.sleep(0.1)


def stop_postgres(server: Postgres, proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # "fast" shutdown: SIGTERM's "smart" one waits for every client
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(server.datadir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    try:
        server, proc = start_postgres()
    except RuntimeError as exc:
        pytest.fail(str(exc))  # never a skip: CI would pass with the datastore untested
    try:
        yield server
    finally:
        stop_postgres(server, proc)
