"""The servers the kit starts (a control plane's etcd and components, a node's containerd and kubelet,
PostgreSQL), stopped however the run ends.

They run in sessions of their own, so that a terminal's Ctrl-C reaches pytest alone and its fixtures
stop them in order; nothing else stops them. pytest answers SIGINT (KeyboardInterrupt) by tearing
every fixture down, but SIGTERM, which CI's timeout and `kill` send, ends it on the spot with every
server left running. `pytest_sessionstart` makes SIGTERM and SIGHUP interrupt the run as SIGINT does,
and what a teardown could not stop (a second interrupt cut it short) is killed, with its process
group, when the interpreter exits (`spawn` keeps the list). A test that swallows the cancellation
the interrupt sends it is interrupted again, harder, after a grace.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import subprocess
import threading
import time
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


STUCK_AFTER_SECONDS = float(os.environ.get("TESSERA_TEST_STUCK_SECONDS", "30"))  # (its own test waits less)
_progress = 0  # a count of the run's steps: fixtures torn down, test phases reported
_stuck = threading.Event()
_session = None


def _interrupt(signum, frame) -> None:
    """What Ctrl-C does now: asyncio's handler while a test's event loop runs (it cancels the test's
    task, then interrupts), pytest's KeyboardInterrupt otherwise; and no test starts after this one.
    Once: a second SIGTERM (make passes its own on to pytest, which had it already as one of the
    process group) would cut the teardown short. But a test whose code swallows the cancellation (a
    wait loop that catches CancelledError) runs on, or hangs the closing of its event loop, with its
    servers: a watchdog stops the stuck loop whenever the run makes no step for
    ``STUCK_AFTER_SECONDS``."""
    name = signal.Signals(signum).name
    for again in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(again, _unstick)
    if _session is not None:
        _session.shouldstop = f"{name} received"
    threading.Thread(target=_watch, name="interrupt-watchdog", daemon=True).start()
    on_sigint = signal.getsignal(signal.SIGINT)
    if callable(on_sigint):
        on_sigint(signal.SIGINT, frame)
    else:  # (SIGINT ignored, as in a job a script started in the background)
        raise KeyboardInterrupt(f"{name} received")


def _watch() -> None:
    while True:
        seen = _progress
        time.sleep(STUCK_AFTER_SECONDS)
        if _progress == seen:
            _stuck.set()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)


def _unstick(signum, frame) -> None:
    """A second SIGTERM or SIGHUP is ignored, unless it is the watchdog's. Then the event loop the
    stuck code runs in is stopped: where it was run (the test, or the closing of its loop) fails
    with "Event loop stopped before Future completed", and the run goes on to its teardown."""
    if not _stuck.is_set():
        return
    _stuck.clear()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # stuck outside any event loop: only an exception moves it
        raise KeyboardInterrupt(f"no step for {STUCK_AFTER_SECONDS:.0f} s after the interrupt") from None
    loop.call_soon_threadsafe(loop.stop)


def pytest_sessionstart(session) -> None:
    global _session
    if threading.current_thread() is threading.main_thread():
        _session = session
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _interrupt)


def pytest_fixture_post_finalizer(fixturedef, request) -> None:
    global _progress
    _progress += 1


def pytest_runtest_logreport(report) -> None:
    global _progress
    _progress += 1
