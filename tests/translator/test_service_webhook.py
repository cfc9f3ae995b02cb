"""The translator process serves the admission webhook. (Its Kubernetes side, the template writer
and the namespace's tenant, is tested against the API-server emulator in tests/kubernetes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


from tessera.shared.natsserver import free_port



def review(uid: str) -> dict:
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"containers": [{"name": "main", "image": "pytorch",
                                 "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}}}]},
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": "ml", "operation": "CREATE", "object": pod}}


def test_translator_process_answers_admission_reviews(nats_url):
    port, probe = free_port(), free_port()
    env = dict(os.environ, TESSERA_NATS_URL=nats_url, TESSERA_WEBHOOK_PORT=str(port),
               TESSERA_WEBHOOK_HOST="127.0.0.1", TESSERA_HTTP_PORT=str(probe))
    proc = subprocess.Popen([str(Path(sys.executable).parent / "tessera-translator")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps(review("u-1")).encode()
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/mutate", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    answer = json.loads(r.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "webhook never answered"
                time.sleep(0.2)
        assert answer["response"]["uid"] == "u-1"
        assert answer["response"]["allowed"] is True
        assert answer["response"]["patchType"] == "JSONPatch"
    finally:
        proc.terminate()
        proc.wait(20)
