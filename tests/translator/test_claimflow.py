"""The translator's pure decisions on the Kubernetes path: tenants of namespaces, which
ResourceClaims are Tessera's and what they ask for, and what the reconciler repairs."""

from __future__ import annotations

import pytest

from tessera.shared.events import ClaimRecord, ClaimSpec
from tessera.shared.kubeclaims import KubeClaimRef, is_tessera_claim
from tessera.translator import claimflow, dra

UID = "6f1c2a4e-8b3d-4c5e-9f7a-1b2c3d4e5f60"


TWO_GPUS = ClaimSpec(gpus=2, memory_mib=8000, cores=30)


def claim(spec: ClaimSpec = TWO_GPUS, uid: str = UID, **metadata) -> dict:
    doc = dra.resource_claim(spec, "trainer-main-x7k2p", "ml")
    doc["metadata"].update(uid=uid, ownerReferences=[
        {"apiVersion": "v1", "kind": "Pod", "name": "trainer", "uid": "0d2f3c4b-1111-2222-3333-444455556666",
         "controller": True, "blockOwnerDeletion": True}], **metadata)
    return doc


def test_tenant_comes_from_the_label_then_the_annotation():
    assert claimflow.namespace_tenant({"metadata": {"labels": {"tessera.io/tenant": "alpha"},
                                                    "annotations": {"tessera.io/tenant": "beta"}}}) == "alpha"
    assert claimflow.namespace_tenant({"metadata": {"annotations": {"tessera.io/tenant": "beta"}}}) == "beta"
    assert claimflow.namespace_tenant({"metadata": {"labels": {"team": "x"}}}) is None
    assert claimflow.namespace_tenant(None) is None


def test_a_namespace_without_a_valid_tenant_is_explained():
    missing = claimflow.tenant_problem("ml", None)
    assert 'namespace "ml" names no Tessera tenant' in missing
    assert "kubectl label namespace ml tessera.io/tenant=<tenant>" in missing
    assert "not a tenant name" in claimflow.tenant_problem("ml", "Team_A")
    assert claimflow.tenant_problem("ml", "team-a") is None


def test_a_webhook_claim_is_recognised_and_its_spec_recovered():
    spec = ClaimSpec(gpus=2, memory_mib=8000, cores=30, use_types=["H100"], gpu_policy="spread", priority=1)
    doc = claim(spec)
    assert is_tessera_claim(doc)
    assert claimflow.recover_spec(doc) == spec
    assert claimflow.tessera_id(doc) == f"k8s-{UID}"
    assert claimflow.claim_ref(doc) == KubeClaimRef(namespace="ml", name="trainer-main-x7k2p", uid=UID,
                                                    pod="trainer", pod_uid="0d2f3c4b-1111-2222-3333-444455556666")


def test_claims_of_other_device_classes_are_not_ours():
    doc = claim()
    doc["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    assert not is_tessera_claim(doc)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda d: d["spec"]["devices"].pop("config"), "exactly one opaque config"),
        (lambda d: d["spec"]["devices"]["config"][0]["opaque"]["parameters"].update(cores=300),
         "parameters.cores"),
        (lambda d: d["spec"]["devices"]["requests"][0]["exactly"].update(count=5), "asks for [5] devices"),
    ],
    ids=["no-config", "bad-parameter", "count-disagrees"],
)
def test_an_unrecoverable_claim_says_why(change, fragment):
    doc = claim()
    change(doc)
    with pytest.raises(claimflow.Unrecoverable) as info:
        claimflow.recover_spec(doc)
    assert fragment in str(info.value)


def record(cid: str, state="requested", kube=True, **extra) -> ClaimRecord:
    ref = KubeClaimRef(namespace="ml", name="x", uid=cid[4:]) if kube else None
    return ClaimRecord(claim=cid, tenant="alpha", state=state, spec=ClaimSpec(), kube=ref, **extra)


def test_reconcile_requests_unrecorded_claims_and_releases_orphans():
    other = "7a8b9c0d-1e2f-4a5b-8c6d-7e8f9a0b1c2d"
    gone = "k8s-00000000-1111-4222-8333-444444444444"
    live, fresh = claim(uid=UID), claim(uid=other)
    records = [
        record(f"k8s-{UID}", "allocated"),
        record(gone, "running"),                                  # its ResourceClaim is gone: release
        record("k8s-99999999-1111-4222-8333-444444444444", "released"),  # over already
        record("c-0123456789abcdef", kube=False),                 # a CLI claim: none of our business
        record("k8s-88888888-1111-4222-8333-444444444444", release_requested=True),  # marked, maybe not sent
    ]
    repairs = claimflow.reconcile([live, fresh], records)
    assert repairs.request == [fresh]
    assert [r.claim for r in repairs.release] == [gone]
    assert [r.claim for r in repairs.resend] == ["k8s-88888888-1111-4222-8333-444444444444"]


def test_a_claim_being_deleted_is_not_requested():
    doc = claim(deletionTimestamp="2026-12-01T08:00:00Z")
    assert claimflow.reconcile([doc], []).request == []
