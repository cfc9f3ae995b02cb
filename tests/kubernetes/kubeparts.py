"""The resourceclaim controller, played on the emulator for the tests of faults only it can give
(test_emulated_faults.py): `make_claims(apiserver, pod)` makes the pod's ResourceClaims as
Kubernetes' resourceclaim controller does (one per template entry, from the template in the pod's
namespace, owned by the pod, annotated ``resource.kubernetes.io/pod-claim-name``) and names them in
the pod's ``status.resourceClaimStatuses``. Every other test has the real controller
(tests/kit/kubecluster.py).
"""

from __future__ import annotations

from translator_harness import resourceclaim_controller

POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


async def make_claims(apiserver, pod: dict) -> list[dict]:
    """The pod's ResourceClaims as Kubernetes' resourceclaim controller makes them, named in the
    pod's ``status.resourceClaimStatuses``; the claims made."""
    made = await resourceclaim_controller(apiserver, pod)
    statuses = [{"name": c["metadata"]["annotations"][POD_CLAIM_NAME], "resourceClaimName": c["metadata"]["name"]}
                for c in made]
    if statuses:
        meta = pod["metadata"]
        await apiserver.patch("v1", "pods", meta["name"], {"status": {"resourceClaimStatuses": statuses}},
                              meta["namespace"], kind="merge", subresource="status")
    return made
