"""deploy/k8s as the real kube-apiserver takes it: every object (cert-manager's aside, whose CRDs a
test cluster has not installed) passes the server's own validation and admission, with the
Tessera CRD in place; nothing is left to a hand-written schema."""

from __future__ import annotations

import yaml

from kit.kubecluster import DEPLOY, apply, manifests

SHIPPED = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def test_the_shipped_manifests_are_accepted_by_the_real_server(kube_cluster):
    apply(kube_cluster, manifests("namespace.yaml") + manifests("crds/tenantcontrolplanes.yaml"))
    kube_cluster.kubectl("wait", "--for=condition=Established", "crd/tenantcontrolplanes.tessera.io", "--timeout=60s")
    docs = [d for name in SHIPPED for d in manifests(name) if not d["apiVersion"].startswith("cert-manager.io/")]
    # --dry-run=server: validated and admitted exactly as an apply would be, nothing created (the
    # Deployments' pods would only wait for nodes this control plane does not have)
    done = kube_cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(docs))
    assert done.stdout.count("(server dry run)") == len(docs), done.stdout
