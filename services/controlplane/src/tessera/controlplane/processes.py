"""The manager's own long-lived processes (tenants' etcd servers, tenants' control planes): started
detached, found again after a manager restart, stopped within a bound.

They are the tenants' datastores and API servers, so they outlive the manager: each is spawned in a
session of its own (no signal to the manager reaches it) with its output appended to a log file,
and only its pid is remembered, in a file of the caller's. A recorded pid may since have been
reused by another process: ``running`` believes a pid only while the process it names still
carries the mark it was started with (an environment variable naming its owner), so nothing but
the manager's own processes is ever signalled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

MARK = "TESSERA_OWNER"


def spawn(argv: list[str], log: Path, owner: str, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` detached, output appended to ``log``; ``owner`` marks it (see ``running``)."""
    environment = dict(os.environ if env is None else env)
    environment[MARK] = owner
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    return os.posix_spawn(argv[0], argv, environment, setsid=True, file_actions=[
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log), flags, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ])


def reap(pid: int) -> bool:
    """Collect ``pid`` if it is an exited child of this process; whether it has exited."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False  # not our child (started by an earlier manager): /proc says whether it runs
    return done == pid


def running(pid: int, owner: str) -> bool:
    """Whether ``pid`` is alive and is the process started for ``owner``."""
    if pid <= 0:
        return False
    try:  # a child of this process: the kernel says (its environment may not be its own yet)
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done != pid
    except ChildProcessError:
        pass  # started by an earlier manager (or reaped): only its mark makes it ours
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and f"{MARK}={owner}".encode() in environ


async def stop(pid: int, owner: str, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; returns once it is gone (bounded)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not running(pid, owner):
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(int(wait / 0.05)):
            if not running(pid, owner):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"process {pid} ({owner}) did not exit after SIGKILL")


async def stop_together(owned: list[tuple[int, str]], grace: float = 10.0) -> None:
    """Stop many at once: SIGTERM to all now, wait up to ``grace`` for them, SIGKILL what is left, also
    when the wait is cancelled (a service shutting down cancels its clean-up after a grace of its own:
    whatever happens, nothing is left running)."""
    _signal_running(owned, signal.SIGTERM)
    try:
        for _ in range(int(grace / 0.05)):
            if not any(running(pid, owner) for pid, owner in owned):
                return
            await asyncio.sleep(0.05)
    finally:
        _signal_running(owned, signal.SIGKILL)


def _signal_running(owned: list[tuple[int, str]], sig: signal.Signals) -> None:
    for pid, owner in owned:
        if running(pid, owner):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) ``pid`` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server of the manager's could listen on ``port`` now (before one is started there:
    a port taken by another process is a fault the tenant's status names)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
