"""The translator process serves the admission webhook, and its template writer creates the
ResourceClaimTemplates the patched pod points at (against kmock's Kubernetes emulator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from tessera.shared.natsserver import free_port

from tessera.translator import dra
from tessera.translator.hami import translate
from tessera.translator.kube import TemplateWriter
from tessera.translator.webhook import ContainerClaim, make_app


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


async def test_template_writer_creates_templates_and_tolerates_existing_ones(kmock):
    kmock.resources["resource.k8s.io/v1/resourceclaimtemplates"] = {}
    spec = translate({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000})
    template = dra.resource_claim_template(spec, "tessera-main-abc", "ml")
    claim = ContainerClaim(namespace="ml", pod="train", container="main", index=0, spec=spec,
                           template_name="tessera-main-abc", template=template)
    writer = TemplateWriter.for_url(str(kmock.url).rstrip("/"))
    try:
        await writer("ml", [claim])
        await writer("ml", [claim])  # a retry of the same admission: already there, still fine
    finally:
        await writer.close()
    posts = [r for r in kmock if r.method == "POST"]
    assert posts and all("/namespaces/ml/resourceclaimtemplates" in str(r.url) for r in posts)
    names = {o.raw["metadata"]["name"] for _, o in kmock.objects.items() if not o.deleted}
    assert names == {"tessera-main-abc"}


async def test_webhook_creates_the_template_in_the_pods_namespace(kmock):
    """The real webhook wired to the real writer: the template lands where the pod is, not under
    the AdmissionReview's uid, and the patched pod points at it."""
    kmock.resources["resource.k8s.io/v1/resourceclaimtemplates"] = {}
    writer = TemplateWriter.for_url(str(kmock.url).rstrip("/"))
    try:
        async with TestClient(TestServer(make_app(writer))) as client:
            resp = await client.post("/mutate", json=review("0df28fbd-1a3c-4b3e-9d1b-3c8f2a7e5b10"))
            answer = await resp.json()
    finally:
        await writer.close()
    assert answer["response"]["allowed"] is True, answer["response"].get("status")
    posts = [str(r.url) for r in kmock if r.method == "POST"]
    assert posts and all("/namespaces/ml/resourceclaimtemplates" in url for url in posts), posts
    (template,) = [o.raw for _, o in kmock.objects.items() if not o.deleted]
    assert template["metadata"]["namespace"] == "ml"
    assert template["metadata"]["name"].startswith("tessera-main-")
