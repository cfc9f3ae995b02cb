"""The enforcer container's capabilities (deploy/k8s/enforcer.yaml) are exactly what its work on other
uids' processes takes, tried against the kernel (defect 10 of issue 22).

The enforcer runs as root, not privileged, every capability dropped but those its manifest adds, with
no_new_privs (``allowPrivilegeEscalation: false``), in the host's pid namespace. A workload runs as
another uid (here 65534), so root's uid alone gives it nothing: the enforcer's own code is run
under exactly the manifest's capabilities (``setpriv``, as the container runtime sets them), against a
workload of uid 65534 that holds its claim's accounting file open and maps a ``libcuda.so.1``
without libvgpu (the watchdog's escapee), and must:

- see that the workload holds the file open (``/proc/<pid>/fd``, which the watchdog also reads for
  an open ``/dev/nvidia*``): the directory is the workload's, mode 0500, so listing it takes
  CAP_DAC_READ_SEARCH, and following its links a ptrace read check (CAP_SYS_PTRACE);
- see what it maps (``/proc/<pid>/maps``, a ptrace read check: CAP_SYS_PTRACE);
- kill it (signalling another uid's process: CAP_KILL).

Each capability is then taken away in turn, and the work it is there for must fail without it: none
is given for nothing. Before the change the manifest gave KILL and SYS_PTRACE only, and the enforcer
could not list a workload's descriptors (a static binary with /dev/nvidia0 open went unseen).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "k8s" / "enforcer.yaml"
WORKLOAD_UID = 65534
# what each capability is for: the checks below that must fail without it
NEEDED_FOR = {"KILL": {"kills"}, "SYS_PTRACE": {"sees_fds", "sees_maps", "kills"}, "DAC_READ_SEARCH": {"sees_fds"}}

WORKLOAD = """
import mmap, sys, time
held = open(sys.argv[1], "rb")  # the claim's accounting file, open for the workload's life
lib = open(sys.argv[2], "rb")
mapped = mmap.mmap(lib.fileno(), 0, prot=mmap.PROT_READ)  # the CUDA driver library, no libvgpu
print("ready", flush=True)
time.sleep(600)
"""

# The enforcer's code, as its watchdog and reclaim run it, on the workload ``pid``.
ENFORCER = """
import json, sys
from tessera.enforcer import processes, watchdog
pid, cache = int(sys.argv[1]), sys.argv[2]
seen = watchdog.escape(pid, cache)
me = watchdog._stat(pid)
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
print(json.dumps({
    "uid": status["Uid"].split()[0], "no_new_privs": status["NoNewPrivs"].strip(),
    "effective": int(status["CapEff"], 16),
    "sees_fds": processes.holds_file(pid, cache),
    "sees_maps": seen is not None and seen.kind == watchdog.NO_LIBVGPU,
    "kills": seen is not None and watchdog.kill(watchdog.Escapee("c", pid, me.start_time, seen.kind, seen.reason)),
}))
"""


def container() -> dict:
    [daemonset] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    [enforcer] = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "enforcer"]
    return enforcer


def capability_bits(names) -> int:
    numbers = {"DAC_READ_SEARCH": 2, "KILL": 5, "SYS_PTRACE": 19}  # linux/capability.h
    return sum(1 << numbers[n] for n in names)


def run_enforcer_code(capabilities: list[str]) -> tuple[dict, int]:
    """The enforcer's checks with only ``capabilities``, on a fresh workload of another uid: what they
    found, and how the workload ended (negative: the signal that ended it)."""
    setpriv = shutil.which("setpriv")
    assert setpriv and os.geteuid() == 0, "the capability tests need root and setpriv (util-linux): a set-up failure"
    place = Path(tempfile.mkdtemp(prefix="caps-", dir="/tmp"))
    try:
        place.chmod(0o755)  # the workload's uid reads its files here
        cache, lib = place / "cache", place / "libcuda.so.1"
        cache.write_bytes(b"\0" * 4096)
        lib.write_bytes(b"\0" * 4096)
        for f in (cache, lib):
            f.chmod(0o644)
        workload = subprocess.Popen(
            [setpriv, f"--reuid={WORKLOAD_UID}", f"--regid={WORKLOAD_UID}", "--clear-groups",
             "/usr/bin/python3", "-c", WORKLOAD, str(cache), str(lib)], stdout=subprocess.PIPE, text=True)
        try:
            assert workload.stdout.readline().strip() == "ready"
            bounding = ",".join(["-all"] + [f"+{c.lower()}" for c in capabilities])
            out = subprocess.run(
                [setpriv, f"--bounding-set={bounding}", "--inh-caps=-all", "--no-new-privs",
                 sys.executable, "-c", ENFORCER, str(workload.pid), str(cache)],
                capture_output=True, text=True, timeout=60, check=True)
            found = json.loads(out.stdout)
            if found["kills"]:
                workload.wait(30)
            return found, workload.returncode if workload.returncode is not None else 0
        finally:
            workload.kill()
            workload.wait()
            workload.stdout.close()
    finally:
        shutil.rmtree(place, ignore_errors=True)


def test_the_manifest_runs_the_enforcer_as_root_without_privilege_and_with_named_capabilities():
    sc = container()["securityContext"]
    assert (sc["runAsUser"], sc.get("privileged", False), sc["allowPrivilegeEscalation"]) == (0, False, False)
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == sorted(NEEDED_FOR), "each capability is tried below: name its use"


def test_with_the_manifests_capabilities_the_enforcer_sees_and_stops_another_uids_workload():
    capabilities = container()["securityContext"]["capabilities"]["add"]
    found, ended = run_enforcer_code(capabilities)
    assert (found["uid"], found["no_new_privs"], found["effective"]) == ("0", "1", capability_bits(capabilities))
    assert {k: found[k] for k in ("sees_fds", "sees_maps", "kills")} == {
        "sees_fds": True, "sees_maps": True, "kills": True}, found
    assert ended == -9  # SIGKILL, by the watchdog's kill


@pytest.mark.parametrize("missing", sorted(NEEDED_FOR))
def test_without_any_one_of_them_the_work_it_is_for_fails(missing):
    capabilities = [c for c in container()["securityContext"]["capabilities"]["add"] if c != missing]
    found, ended = run_enforcer_code(capabilities)
    failed = {k for k in ("sees_fds", "sees_maps", "kills") if not found[k]}
    assert failed == NEEDED_FOR[missing], (missing, found)
    assert ended == 0 or "kills" not in failed  # not killed when it could not be
