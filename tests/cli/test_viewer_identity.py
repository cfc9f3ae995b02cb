"""The read-only identity reads and can change nothing, and no reader creates a stream or bucket.

Against a real nats-server with the authorization `make up` writes (identities.write_auth_dir): a
read command against a server where Tessera never ran says so (exit 4) and leaves it empty, for the
operator as for the viewer; once the topology exists the viewer reads the fleet and the dead
letters, and every write it tries (a stream, a bucket, a key, an event) is refused by the server.
"""

from __future__ import annotations

import json

import nats
import pytest

from tessera.shared import identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.natsserver import NatsServer
from tessera.shared.settings import BusSettings

from tessera.cli import exitcodes

from clikit import tessera
from kit import eventually


@pytest.fixture
def server(tmp_path):
    auth = tmp_path / "auth"
    passwords = identities.write_auth_dir(auth, ["gpu-0"])
    srv = NatsServer(tmp_path / "store", config_file=auth / "nats.conf").start()
    try:
        yield srv, passwords
    finally:
        srv.stop()


def url_of(srv, passwords, user: str) -> str:
    return srv.url.replace("nats://", f"nats://{user}:{passwords[user]}@", 1)


async def streams_of(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        return [s.config.name for s in await nc.jetstream().streams_info()]
    finally:
        await nc.close()


async def test_readers_never_create_topology(server):
    srv, passwords = server
    for user in (identities.VIEWER, identities.OPERATOR):
        for argv in (["status"], ["claims", "-o", "json"], ["dlq", "list"]):
            ran = await tessera(*argv, "--nats", url_of(srv, passwords, user))
            assert ran.code == exitcodes.UNAVAILABLE, (user, argv, ran.err)
            assert "does not exist" in ran.err and "Traceback" not in ran.err, ran.err
    assert await streams_of(url_of(srv, passwords, identities.OPERATOR)) == []


async def test_the_viewer_reads_and_can_change_nothing(server):
    srv, passwords = server
    operator = await Bus.connect(BusSettings(url=url_of(srv, passwords, identities.OPERATOR)), "cli")
    await operator.ensure_topology()
    await operator.close()
    before = sorted(await streams_of(url_of(srv, passwords, identities.OPERATOR)))

    viewer_url = url_of(srv, passwords, identities.VIEWER)
    ran = await tessera("status", "--nats", viewer_url, "-o", "json")
    assert ran.code == exitcodes.OK, ran.err
    assert json.loads(ran.out)["totals"]["nodes"] == 0
    assert (await tessera("dlq", "list", "--nats", viewer_url)).code == exitcodes.OK

    refusals: list[str] = []

    async def on_error(exc):
        refusals.append(str(exc))

    nc = await nats.connect(viewer_url, error_cb=on_error, inbox_prefix=identities.inbox_prefix(identities.VIEWER))
    try:
        js = nc.jetstream(timeout=2)
        watcher = await (await js.key_value(subjects.KV_CLAIMS)).watchall()  # a read it needs
        await watcher.stop()
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_stream(name="VIEWER_WAS_HERE", subjects=["viewer.>"])
        with pytest.raises(nats.errors.TimeoutError):
            await js.create_key_value(bucket="viewer-bucket")
        with pytest.raises(nats.errors.TimeoutError):
            await (await js.key_value(subjects.KV_LEDGER)).put("node.gpu-0", b"{}")
        await nc.publish(subjects.claim("alpha", "c1", "requested"), b"{}")
        await nc.publish(subjects.dlq_replayed(1), b"{}")
        await nc.flush()
        wanted = [subjects.claim("alpha", "c1", "requested"), subjects.dlq_replayed(1), "$js.api.stream.create"]

        def refused(subject: str) -> bool:
            return any("permissions violation" in r.lower() and subject.lower() in r.lower() for r in refusals)

        # the server reports refusals asynchronously: wait for them
        await eventually(lambda: all(refused(s) for s in wanted), timeout=5, every=0.05,
                         what=f"refusals of {wanted}")
    finally:
        await nc.close()
    assert sorted(await streams_of(url_of(srv, passwords, identities.OPERATOR))) == before
