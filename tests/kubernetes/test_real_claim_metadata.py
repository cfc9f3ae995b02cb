"""A person labels and annotates Tessera's ResourceClaims with kubectl, on the real
control plane.

Found on the real server: ``kubectl label`` / ``kubectl annotate`` (a JSON merge patch of the
metadata) of a claim made from the translator's template was refused, ``spec: Invalid value: ...:
field is immutable``. The claim's opaque device parameters are a RawExtension, which the API server
keeps as the bytes the client sent; kubernetes_asyncio sent them with json.dumps' spaces, and a
merge patch re-encodes the object compactly, so the spec no longer compared equal to itself. Every
body the services send now leaves ``tessera.shared.kubeapi`` compact (as Go's encoder writes it).

The template is the translator's (its service account, `gpupods`), the claim the resourceclaim
controller's copy of it; kubectl runs as the admin, as a person would. (The template itself only
the translator may change: deploy/k8s's tessera-claim-templates policy.)
"""

from __future__ import annotations

import json

import pytest

from tessera.shared.events import ClaimSpec

from gpupods import GpuPods


@pytest.fixture
async def pods(kube_cluster):
    made = GpuPods(kube_cluster)
    try:
        yield made
    finally:
        await made.close()


async def test_kubectl_labels_and_annotates_a_tessera_claim(kube_cluster, kube_namespace, pods):
    _, claim = await pods.create(kube_namespace, "train", ClaimSpec(memory_mib=10240, cores=20))
    name = claim["metadata"]["name"]
    labelled = kube_cluster.kubectl("label", "-n", kube_namespace, "resourceclaim", name, "team=vision", check=False)
    assert labelled.returncode == 0, labelled.stderr
    annotated = kube_cluster.kubectl("annotate", "-n", kube_namespace, "resourceclaim", name, "owner=ada", check=False)
    assert annotated.returncode == 0, annotated.stderr
    stored = json.loads(kube_cluster.kubectl("get", "-n", kube_namespace, "resourceclaim", name, "-o", "json").stdout)
    assert stored["metadata"]["labels"]["team"] == "vision" and stored["metadata"]["annotations"]["owner"] == "ada"
    assert stored["spec"] == claim["spec"]  # the translator's parameters, unchanged
