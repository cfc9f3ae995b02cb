"""`compose.py up` never waits for ever on Podman (issue 27), checked without Podman.

podman-compose 1.6 starts a container only once those it depends on run, by ``podman wait
--condition=running``, retried for ever; on a machine without iptables netavark fails every start,
and `make compose-test` hung with all 16 containers ``Created``. Here a stand-in podman-compose
prints what Podman's `podman start` printed there, then waits the way podman-compose did (a child
``sleep`` holding its output open, like its ``podman wait``), and a stand-in podman reports the
containers: `up` must end within seconds with the container's name and Podman's message, and leave
nothing running. Without any error it must still end, at its timeout. The real set runs in
tests/compose (`make compose-test`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "podman"))
import compose  # noqa: E402
import podmanhost  # noqa: E402

NATS_ID = "c2ac82a7d92994c2cd4a48535bead92a0e836cd7a47da364ffdc64e70d6af068"
NETAVARK = "netavark: No such file or directory (os error 2)"


def gone(pid: int) -> bool:
    """No such process, or one that has exited and waits only to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def pids(path: Path) -> list[int]:
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """A directory for the stand-in podman and podman-compose; the environment that finds them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setattr(compose, "BIN", bin_dir)
    monkeypatch.setattr(compose, "write_secrets", lambda: None)  # nothing to write for stand-ins
    monkeypatch.setattr(compose, "stop_stale_dns", lambda environment: None)  # never the machine's own
    monkeypatch.setattr(compose, "POLL_S", 0.2)
    return bin_dir, {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def fake_podman(bin_dir: Path, containers: list[dict]) -> None:
    names = " ".join(c["Name"] for c in containers)
    write(bin_dir / "podman", f"""#!/bin/sh
case "$1 $2" in
  "image exists") exit 0 ;;
  "ps -a") echo "{names}" ;;
  "container inspect") cat <<'EOF'
{json.dumps(containers)}
EOF
  ;;
esac
""")


def fake_compose(bin_dir: Path, pid_file: Path, say: str) -> None:
    """podman-compose that says ``say``, then waits for ever with a child holding its output."""
    write(bin_dir / "podman-compose", f"""#!/bin/sh
{say}
sleep 600 &
echo $$ $! > {pid_file}
exec sleep 600
""")


def test_a_container_that_cannot_start_ends_up_at_once_with_its_name_and_podmans_message(stand_ins, tmp_path):
    bin_dir, environment = stand_ins
    fake_podman(bin_dir, [
        {"Id": NATS_ID, "Name": "tessera_nats-1_1", "State": {"Status": "created", "Error": ""}},
        {"Id": "f" * 64, "Name": "tessera_placement_1", "State": {"Status": "created", "Error": ""}},
    ])
    pid_file = tmp_path / "compose.pids"
    fake_compose(bin_dir, pid_file, f"""echo 'Error: unable to start container "{NATS_ID}": {NETAVARK}' >&2""")
    started = time.monotonic()
    with pytest.raises(compose.ComposeFailed) as failed:
        compose.up(environment, timeout=120, echo=False)
    assert time.monotonic() - started < 30, "it waited on podman-compose instead of reading what Podman said"
    message = str(failed.value)
    assert f"tessera_nats-1_1: created: podman says: {NETAVARK}" in message, message
    assert "not running either: tessera_placement_1 (created)" in message, message
    assert "iptables" in message and "make container-tools" in message, message
    assert all(gone(pid) for pid in pids(pid_file)), "podman-compose or its child outlived `up`"


def test_a_podman_compose_that_never_finishes_is_stopped_at_the_timeout(stand_ins, tmp_path):
    bin_dir, environment = stand_ins
    fake_podman(bin_dir, [{"Id": NATS_ID, "Name": "tessera_nats-1_1", "State": {"Status": "created", "Error": ""}}])
    pid_file = tmp_path / "compose.pids"
    fake_compose(bin_dir, pid_file, "echo starting")
    started = time.monotonic()
    with pytest.raises(compose.ComposeFailed) as failed:
        compose.up(environment, timeout=2, echo=False)
    assert time.monotonic() - started < 20
    message = str(failed.value)
    assert "did not finish in 2 s" in message and "tessera_nats-1_1 (created)" in message, message
    assert all(gone(pid) for pid in pids(pid_file))


def test_a_command_whose_child_holds_its_output_is_killed_with_the_child(tmp_path):
    """subprocess.run(timeout=...) kills only the command, then waits for the pipe its child holds."""
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(podmanhost.Overran, match="no answer in 1 s"):
        podmanhost.run_bounded(["sh", "-c", f"sleep 600 & echo $$ $! > {pid_file}; echo waiting; wait"], 1)
    assert time.monotonic() - started < 10
    assert all(gone(pid) for pid in pids(pid_file))
