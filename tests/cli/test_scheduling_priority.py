"""`--scheduling-priority` and HAMi's `--priority` are two things, through the CLI and the API.

The scheduling priority orders the queue and decides what may be preempted (`ClaimSpec.priority`);
HAMi's ``nvidia.com/priority`` (``--priority``, 0 high, 1 low) is how the claim's processes share
a GPU at run time (`ClaimSpec.task_priority`). One flag never sets the other. A bad value is
refused with what is wrong.
"""

from __future__ import annotations

import json

from tessera.shared import api, subjects
from tessera.shared.events import ClaimSpec, GpuQuota

from tessera.cli.client import Client
from tessera.cli.errors import CliError

from clikit import tessera


async def test_the_scheduling_priority_and_hamis_runtime_priority_are_set_apart(cluster):
    operator = ["--nats", cluster.url]
    client = await Client.connect(cluster.url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name="prio", quota=GpuQuota()),
                          timeout=30)
        ran = await tessera("submit", *operator, "--tenant", "prio", "--gpumem", "1000", "--scheduling-priority",
                            "70", "--priority", "1", "-o", "json")
        assert ran.code == 0, ran.err
        record = await client.claim(json.loads(ran.out)["claim"])
        assert (record.spec.priority, record.spec.task_priority) == (70, 1)

        ran = await tessera("submit", *operator, "--tenant", "prio", "--gpumem", "1000", "--priority", "0", "-o", "json")
        record = await client.claim(json.loads(ran.out)["claim"])
        assert (record.spec.priority, record.spec.task_priority) == (0, 0)  # HAMi's high is no scheduling priority

        ran = await tessera("submit", *operator, "--tenant", "prio", "--gpumem", "1000", "--scheduling-priority", "-1")
        assert ran.code != 0 and "scheduling_priority" in ran.err and ">= 0" in ran.err, ran.err

        # The API: with a native spec, the two must not disagree.
        try:
            await client.submit(api.SubmitRequest(tenant="prio", spec=ClaimSpec(memory_mib=1000, priority=5),
                                                  scheduling_priority=6))
        except CliError as exc:
            assert "differs from spec.priority 5" in str(exc), exc
        else:
            raise AssertionError("a spec.priority and a different scheduling_priority were both accepted")
        done = await client.submit(api.SubmitRequest(tenant="prio", spec=ClaimSpec(memory_mib=1000),
                                                     scheduling_priority=6))
        assert (await client.claim(done["claim"])).spec.priority == 6
    finally:
        await client.close()
