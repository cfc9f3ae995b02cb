"""The load keeps claims to the end without filling a tenant's quota, so a long run keeps placing.

Kept without a bound, one claim in eight filled both tenants' quotas within about six seconds of a
long run; from then on every claim was unschedulable, placement wrote no ledger entry, and
lost-kv-reply (which waits for the next ledger write) could not start its fault.
"""

from __future__ import annotations

import random

from loadgen import TENANTS, Load, _valid_resources


def test_kept_claims_never_hold_more_than_half_a_tenants_quota():
    load = Load(client=None, seed=108)
    rng = random.Random(108)
    kept = dict.fromkeys(TENANTS, 0)
    for n in range(1, 2001):  # far longer than any run
        load._n = n
        tenant = rng.choice(list(TENANTS))
        gpus = _valid_resources(rng)["nvidia.com/gpu"]
        if load._keeps(tenant, gpus):
            kept[tenant] += gpus
    assert all(kept[t] <= TENANTS[t].gpus // 2 for t in TENANTS), kept
    assert all(kept[t] > 0 for t in TENANTS), "the load keeps some claims of each tenant"
