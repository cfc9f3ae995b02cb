"""The servers the kit starts (a control plane's etcd and components, a node's containerd and kubelet,
PostgreSQL), stopped however the run ends.

They run in sessions of their own, so that a terminal's Ctrl-C reaches pytest alone and its fixtures
stop them in order; nothing else stops them. pytest answers SIGINT (KeyboardInterrupt) by tearing
every fixture down, but SIGTERM, which CI's timeout and `kill` send, ends it on the spot with every
server left running. `pytest_sessionstart` makes SIGTERM and SIGHUP interrupt the run as SIGINT does,
and what a teardown could not stop (a second interrupt cut it short) is killed, with its process
group, when the interpreter exits (`spawn` keeps the list).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from pathlib import Path

_started: list[subprocess.Popen] = []
_lock = threading.Lock()


def spawn(argv: list[str], log: Path, *, append: bool = False, **popen) -> subprocess.Popen:
    """``argv`` in a session of its own, its output to ``log``; killed at exit if still running."""
    with open(log, "ab" if append else "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    with _lock:
        _started[:] = [p for p in _started if p.poll() is None]
        _started.append(proc)
    return proc


@atexit.register
def _kill_leftovers() -> None:
    with _lock:
        for proc in _started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        _started.clear()


def _interrupt(signum, frame) -> None:
    """What Ctrl-C does now: asyncio's handler while a test's event loop runs (it cancels the test's
    task, then interrupts), pytest's KeyboardInterrupt otherwise. Once: a second SIGTERM (make
    passes its own on to pytest, which had it already as one of the process group) would cut the
    teardown short."""
    for again in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(again, signal.SIG_IGN)
    on_sigint = signal.getsignal(signal.SIGINT)
    if callable(on_sigint):
        on_sigint(signal.SIGINT, frame)
    else:  # (SIGINT ignored, as in a job a script started in the background)
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


def pytest_sessionstart(session) -> None:
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _interrupt)
