"""The names Kubernetes and Tessera share: claim ids from uids, device names and indices."""

import pytest

from tessera.shared.events import ClaimId
from tessera.shared.kubeclaims import claim_id, device_index, device_name, is_kube_claim

import msgspec

UID = "0f8e6c1a-2b3d-4e5f-8a9b-0c1d2e3f4a5b"


def test_claim_id_is_deterministic_and_a_valid_claim_id():
    cid = claim_id(UID)
    assert cid == claim_id(UID.upper()) == f"k8s-{UID}"
    assert msgspec.json.decode(msgspec.json.encode(cid), type=ClaimId) == cid
    assert is_kube_claim(cid) and not is_kube_claim("c-123")


@pytest.mark.parametrize("bad", ["", "abc", UID + "0", "../" + UID])
def test_a_uid_the_api_server_never_assigns_is_refused(bad):
    with pytest.raises(ValueError, match="not a UUID"):
        claim_id(bad)


def test_device_names_round_trip_and_foreign_names_are_refused():
    assert device_index(device_name(7)) == 7
    for bad in ["gpu-", "gpu-01", "nvidia-0", "gpu-7/../0", "gpu--1"]:
        with pytest.raises(ValueError, match="device name"):
            device_index(bad)
