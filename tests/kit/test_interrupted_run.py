"""An interrupted run stops the servers the kit started: a run that CI's timeout ends with SIGTERM,
or that Ctrl-C ends with SIGINT, leaves no kube-apiserver, kubelet, containerd or PostgreSQL behind.

The kit starts its servers in sessions of their own (so that a terminal's Ctrl-C reaches pytest
alone, which stops them in order): nothing stops them but the fixtures' teardown. A planted run
(tests/kit/interrupted_run.py, in a pytest of its own with tests/conftest.py in effect) starts them
and waits; it is sent the signal (SIGTERM twice, as when make passes on the one its process group
had), and once it has exited every server it started must be gone and the node's network removed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANTED = Path(__file__).with_name("interrupted_run.py")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited and waiting to be reaped, is not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def start_planted(tmp_path: Path, pids_file: Path, test: str) -> tuple[subprocess.Popen, Path]:
    """The planted run of ``test`` (a name in tests/kit/interrupted_run.py), and its log."""
    # (the outer run's PYTEST_ADDOPTS, a --basetemp for one, is not the planted run's)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env |= {"TESSERA_INTERRUPTED_RUN_PIDS": str(pids_file), "TESSERA_KUBE_VERSIONS": "v1.36",
            "TESSERA_TEST_STUCK_SECONDS": "5"}
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-k", test,
                                str(PLANTED)],
                               cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=ctrl_c_as_in_a_terminal)
    return run, log


def wait_for_pids(run: subprocess.Popen, log: Path, pids_file: Path) -> dict:
    deadline = time.monotonic() + 180
    while not pids_file.exists():
        assert run.poll() is None, f"the planted run ended before its servers ran:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no servers after 180 s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    return json.loads(pids_file.read_text())


def ctrl_c_as_in_a_terminal() -> None:
    """SIGINT handled as a terminal's foreground job has it (this run may be a background job, whose
    children inherit SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("signals", [[signal.SIGTERM, signal.SIGTERM], [signal.SIGINT]], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_run_leaves_no_server_running(tmp_path, signals):
    pids_file = tmp_path / "pids.json"
    run, log = start_planted(tmp_path, pids_file, "waits_to_be_interrupted")
    pids: dict[str, int] = {}
    try:
        started = wait_for_pids(run, log, pids_file)
        pids, bridge = started["pids"], started["bridge"]
        assert {"plane kube-apiserver", "node kubelet", "node containerd", "postgres"} <= set(pids), pids
        assert all(running(pid) for pid in pids.values()), pids

        for signum in signals:  # to pytest alone, as a CI runner's timeout or a terminal's Ctrl-C reaches it
            run.send_signal(signum)  # (SIGTERM twice: make, sent it with its process group, passes it on)
            time.sleep(0.5)
        run.wait(120)
        left = {name: pid for name, pid in pids.items() if running(pid)}
        assert not left, f"still running after the interrupted run exited {run.returncode}: {left}\n" \
                         f"{log.read_text()[-4000:]}"
        assert run.returncode == 2, log.read_text()[-4000:]  # pytest's "interrupted"
        # the node's teardown ran to its end: its pods' bridge is gone
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode, \
            f"the node's bridge {bridge} is still there:\n{log.read_text()[-4000:]}"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        for pid in pids.values():  # (what a failing run left: not the next test's to meet)
            if running(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_test_that_swallows_the_cancellation_is_still_interrupted(tmp_path):
    """The interrupt's first step cancels the running test's task; a test whose code catches that
    cancellation (a wait loop that ignores CancelledError) would run on, its servers with it, until
    the CI runner's kill. The run must still end, interrupted, with its fixtures torn down."""
    pids_file = tmp_path / "pids.json"
    run, log = start_planted(tmp_path, pids_file, "swallows_the_cancellation")
    pid = None
    try:
        started = wait_for_pids(run, log, pids_file)
        pid = started["pids"]["postgres"]
        for _ in range(2):  # (SIGTERM twice: make passes on the one its process group had)
            run.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        try:
            run.wait(150)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run went on 150 s after SIGTERM:\n{log.read_text()[-4000:]}")
        assert run.returncode == 2, log.read_text()[-4000:]  # pytest's "interrupted"
        assert not running(pid), f"PostgreSQL was left running:\n{log.read_text()[-4000:]}"
        # torn down, not killed at exit: PostgreSQL removes its pid file only when it shuts down
        assert not Path(started["postmaster_pid"]).exists(), \
            f"PostgreSQL was killed, not stopped by its fixture:\n{log.read_text()[-4000:]}"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if pid and running(pid):
            os.killpg(pid, signal.SIGKILL)
