"""The auditor's tenant side: after faults of a tenant's pod syncer, its two API servers and the
ledger agree.

Read from what an outside tool may read: the tenant's API server, the host's (the tenant's host
namespace), and the ledger's claims (`auditor.Auditor.ledger_claims`). Once the syncer has caught up:
- every tenant pod bound to the virtual node and not being deleted has exactly one host pod (the
  host pod's uid annotation names it), and no tenant pod is left half-deleted;
- no host pod of the tenant stands for a tenant pod that is gone, deleting, or another pod of that
  name now;
- the ledger holds exactly the claims of the live host pods, as the host's claims name them
  (``k8s-<ResourceClaim uid>``), no more and no fewer.
It never imports the syncer: the names it reads are the public labels and annotations of
docs/tenant-pods.md.
"""

from __future__ import annotations

from collections import defaultdict

from tessera.shared.kubeapi import KubeApi
from tessera.shared.kubeclaims import claim_id

TENANT = "tenantpods.tessera.dev/tenant"  # label of a mirrored object: whose it is
UID = "tenantpods.tessera.dev/uid"  # annotation: the tenant pod it stands for


async def tenant_findings(tenant_api: KubeApi, host_api: KubeApi, tenant: str, host_namespace: str, node: str,
                          ledger: set[str]) -> list[str]:
    """What is wrong now (empty: the tenant's pods, their host pods and the ledger agree)."""
    found: list[str] = []
    tenant_pods, _ = await tenant_api.list("/api/v1/pods", field_selector=f"spec.nodeName={node}")
    host_pods, _ = await host_api.list(f"/api/v1/namespaces/{host_namespace}/pods", label_selector=f"{TENANT}={tenant}")
    live = {p["metadata"]["uid"]: p for p in tenant_pods if not p["metadata"].get("deletionTimestamp")}
    for pod in tenant_pods:
        if pod["metadata"].get("deletionTimestamp"):
            found.append(f"tenant pod {_name(pod)}: still deleting")
    hosts: dict[str, list[dict]] = defaultdict(list)
    for host in host_pods:
        hosts[(host["metadata"].get("annotations") or {}).get(UID, "")].append(host)
    for uid, pod in live.items():
        if len(hosts.get(uid, [])) != 1:
            found.append(f"tenant pod {_name(pod)}: {len(hosts.get(uid, []))} host pods")
    for uid, made in hosts.items():
        if uid not in live:
            found += [f"host pod {h['metadata']['name']}: its tenant pod is gone" for h in made]
    held: set[str] = set()
    for host in host_pods:
        if host["metadata"].get("deletionTimestamp"):
            continue
        for status in (host.get("status") or {}).get("resourceClaimStatuses") or []:
            claim = await host_api.get(f"/apis/resource.k8s.io/v1/namespaces/{host_namespace}/resourceclaims/"
                                       f"{status['resourceClaimName']}")
            if claim is not None:
                held.add(claim_id(claim["metadata"]["uid"]))
    found += [f"ledger: {c} is no live host pod's claim" for c in sorted(ledger - held)]
    found += [f"ledger: {c}, a live host pod's claim, is in no ledger" for c in sorted(held - ledger)]
    return found


def _name(pod: dict) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
