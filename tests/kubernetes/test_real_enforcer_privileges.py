"""The enforcer's securityContext, as the real kubelet and containerd apply it, is enough to see into and
kill a workload of another uid on the node (defect 10 of issue 22).

tests/enforcer/test_enforcer_capabilities.py tries the enforcer's own code under the manifest's
capabilities as ``setpriv`` sets them; this is the other half: a pod with deploy/k8s/enforcer.yaml's
container securityContext, pod securityContext and ``hostPID`` (busybox in the enforcer's place, as
no enforcer image is built here) started on the real node, where containerd turns the manifest into
the process's credentials (capabilities, no_new_privs, the RuntimeDefault seccomp filter). From it,
a process of uid 65534 outside any container is read (``/proc/<pid>/fd``, ``/proc/<pid>/maps``) and
killed. What busybox does not show: the pidfd calls the enforcer signals with (pidfd_open,
pidfd_send_signal), which containerd's default seccomp profile allows.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "enforcer.yaml"
WORKLOAD_UID = 65534
CAPABILITY_BITS = {"DAC_READ_SEARCH": 2, "KILL": 5, "SYS_PTRACE": 19}  # linux/capability.h


def enforcer_pod(namespace: str, node: str, image: str) -> dict:
    [daemonset] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    template = daemonset["spec"]["template"]["spec"]
    [enforcer] = [c for c in template["containers"] if c["name"] == "enforcer"]
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "enforcer-privileges", "namespace": namespace},
        "spec": {
            "nodeName": node, "terminationGracePeriodSeconds": 1, "dnsPolicy": "Default",
            "hostPID": template["hostPID"], "securityContext": copy.deepcopy(template["securityContext"]),
            "containers": [{"name": "enforcer", "image": image, "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"],
                            "securityContext": copy.deepcopy(enforcer["securityContext"])}],
        },
    }


def test_the_enforcers_security_context_sees_and_kills_another_uids_process(kube_cluster, kube_node, kube_namespace):
    def inside(*argv: str) -> subprocess.CompletedProcess:
        return kube_cluster.kubectl("exec", "-n", kube_namespace, "enforcer-privileges", "--", *argv, check=False)

    pod = enforcer_pod(kube_namespace, kube_node.name, kube_node.image("busybox"))
    capabilities = pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
    place = Path(tempfile.mkdtemp(prefix="privileges-", dir="/tmp"))
    place.chmod(0o755)
    held = place / "accounting"
    held.write_bytes(b"\0" * 4096)
    held.chmod(0o644)
    workload = subprocess.Popen(
        ["setpriv", f"--reuid={WORKLOAD_UID}", f"--regid={WORKLOAD_UID}", "--clear-groups", "/usr/bin/python3", "-c",
         "import sys, time; f = open(sys.argv[1], 'rb'); print('ready', flush=True); time.sleep(600)", str(held)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert workload.stdout.readline().strip() == "ready"
        kube_cluster.kubectl("create", "-f", "-", stdin=json.dumps(pod))
        waited = kube_cluster.kubectl("wait", "-n", kube_namespace, "pod/enforcer-privileges",
                                      "--for=condition=Ready", "--timeout=90s", check=False)
        assert waited.returncode == 0, (
            kube_cluster.kubectl("describe", "-n", kube_namespace, "pod/enforcer-privileges").stdout[-3000:])

        status = dict(line.split(":\t", 1) for line in inside("cat", "/proc/self/status").stdout.splitlines()
                      if ":\t" in line)
        assert int(status["CapEff"], 16) == sum(1 << CAPABILITY_BITS[c] for c in capabilities), status["CapEff"]
        assert (status["Uid"].split()[0], status["NoNewPrivs"].strip(), status["Seccomp"].strip()) == ("0", "1", "2")

        pid = workload.pid  # the host's pid: the pod is in the host's pid namespace
        fds = inside("ls", f"/proc/{pid}/fd")
        assert fds.returncode == 0, fds.stderr
        links = [inside("readlink", f"/proc/{pid}/fd/{fd}").stdout.strip() for fd in fds.stdout.split()]
        assert str(held) in links, links
        maps = inside("cat", f"/proc/{pid}/maps")
        assert maps.returncode == 0 and "python" in maps.stdout, maps.stderr
        killed = inside("kill", "-9", str(pid))
        assert killed.returncode == 0, killed.stderr
        assert workload.wait(30) == -9
    finally:
        workload.kill()
        workload.wait()
        workload.stdout.close()
        kube_cluster.kubectl("delete", "-n", kube_namespace, "pod/enforcer-privileges", "--ignore-not-found",
                             "--timeout=60s", check=False)
        shutil.rmtree(place, ignore_errors=True)
