"""The admission webhook answers any body with a valid AdmissionReview or a 400, never a server error.

Bodies range from arbitrary bytes and JSON to AdmissionReviews of Pods whose containers carry
arbitrary HAMi resources and annotations. A 200 must be an AdmissionReview v1 answering the
request's uid, and never one that reports an internal error (the webhook's own last resort)."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from tessera.translator.webhook import make_app

from strategies import json_values
from test_hami_rules_never_crash import annotations as hami_annotations
from test_hami_rules_never_crash import resources as hami_resources


def _review(uid, pod, kind, operation, namespace):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": kind, "operation": operation, "namespace": namespace, "object": pod}}


containers = st.lists(st.fixed_dictionaries(
    {"name": st.text(max_size=10)},
    optional={"resources": st.fixed_dictionaries({}, optional={"limits": hami_resources, "requests": hami_resources})
              | json_values}), max_size=3) | json_values
pods = st.fixed_dictionaries(
    {"spec": st.fixed_dictionaries({"containers": containers}, optional={"initContainers": containers,
                                                                         "schedulingGates": json_values})},
    optional={"metadata": st.fixed_dictionaries({}, optional={"annotations": hami_annotations | json_values,
                                                              "name": st.text(max_size=10)}) | json_values,
              "kind": st.just("Pod")})
reviews = st.builds(
    _review,
    st.text(min_size=1, max_size=12) | json_values,
    pods | json_values,
    st.just({"group": "", "version": "v1", "kind": "Pod"}) | json_values,
    st.sampled_from(["CREATE", "UPDATE"]) | json_values,
    st.sampled_from(["team-a", ""]) | json_values,
)
bodies = st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()) \
    | reviews.map(lambda r: json.dumps(r).encode())


async def _post(body: bytes):
    async with TestClient(TestServer(make_app())) as client:
        resp = await client.post("/mutate", data=body, headers={"Content-Type": "application/json"})
        return resp.status, await resp.text()


@given(body=bodies)
def test_any_body_gets_an_admission_review_or_a_400(body):
    status, text = asyncio.run(_post(body))
    assert status in (200, 400), (status, text)
    if status == 400:
        assert text.startswith("malformed AdmissionReview"), text
        return
    review = json.loads(text)
    assert review["apiVersion"] == "admission.k8s.io/v1" and review["kind"] == "AdmissionReview"
    response = review["response"]
    assert response["uid"] == json.loads(body)["request"]["uid"]
    assert (response.get("status") or {}).get("code") != 500, response
