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


def ctrl_c_as_in_a_terminal() -> None:
    """SIGINT handled as a terminal's foreground job has it (this run may be a background job, whose
    children inherit SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("signals", [[signal.SIGTERM, signal.SIGTERM], [signal.SIGINT]], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_run_leaves_no_server_running(tmp_path, signals):
    pids_file = tmp_path / "pids.json"
    # (the outer run's PYTEST_ADDOPTS, a --basetemp for one, is not the planted run's)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env |= {"TESSERA_INTERRUPTED_RUN_PIDS": str(pids_file), "TESSERA_KUBE_VERSIONS": "v1.36"}
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(PLANTED)],
                               cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=ctrl_c_as_in_a_terminal)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 180
        while not pids_file.exists():
            assert run.poll() is None, f"the planted run ended before its servers ran:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no servers after 180 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        started = json.loads(pids_file.read_text())
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
