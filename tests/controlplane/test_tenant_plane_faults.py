"""Faults of a tenant's control plane: a binary missing, its port taken, its serving certificate
replaced underneath it, its datastore password changed behind the manager's back, its datastore full
(etcd past its quota; PostgreSQL's disk, a real one: a tablespace on a small tmpfs). The tenant's status names what is wrong, the other tenant is
not harmed, and a later resync repairs what can be repaired."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from controlplane.planes import Planes
from kit import eventually
from tessera.controlplane.datastores import DatastoreAuthFailed, DatastoreFull
from tessera.controlplane.datastores import etcd as etcd_store
from tessera.controlplane.datastores import postgres as pg_store
from tessera.controlplane.datastores.etcd_dedicated import DedicatedEtcdDriver
from tessera.controlplane.pki import PkiAuthority

QUOTA = 16 * 1024 * 1024  # a dedicated etcd's: room for a control plane, soon filled on purpose
VALUE = b"x" * (64 * 1024)
DISK = 64 * 1024 * 1024  # PostgreSQL's template database (~8 MiB) and a control plane's first writes fit


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["postgres"], indirect=True)
async def test_a_missing_binary_is_named_and_repaired(planes: Planes, tmp_path):
    await planes.create("steady")
    bins = tmp_path / "bins"
    shutil.copytree(planes.host.kube_bin, bins, symlinks=True)
    planes.host.kube_bin = bins
    (bins / "kube-apiserver").rename(bins / "kube-apiserver.away")

    await planes.manager.api.apply("broken", planes_spec(planes))
    record = await planes.wait_phase("broken", "NotReady", "BinaryMissing", timeout=120)
    assert "kube-apiserver" in record.status.message
    assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]

    (bins / "kube-apiserver.away").rename(bins / "kube-apiserver")
    await planes.wait_phase("broken", "Ready")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["postgres"], indirect=True)
async def test_a_taken_port_is_named_and_the_tenant_moves(planes: Planes, tmp_path):
    await planes.create("steady")
    await planes.create("mover")
    assert (await planes.call("sleep", "mover")).ok
    port = planes.host._read("mover").apiserver_port  # type: ignore[union-attr]
    # The slept server's own connections linger in TIME_WAIT on that port: a squatter that listens
    # there still keeps any other server from binding it.
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        await eventually(lambda: _bound(squatter, port), timeout=30, what=f"port {port} to be free")
        squatter.listen()
        await planes.call("wake", "mover")  # (its reply waits for the resync that moves the port)
        assert "PortInUse" in await planes.reasons("mover")
        record = await planes.wait_phase("mover", "Ready")
        assert f":{port}" not in record.status.endpoint  # a new port, and its kubeconfig says so
        kubeconfig = await planes.kubeconfig("mover", tmp_path)
        assert (await planes.kubectl(kubeconfig, "get", "ns")).returncode == 0
        assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]
    finally:
        squatter.close()


@pytest.mark.timeout(900)
# (the process watch finds it: no resync may write the files back first, before the API server reloaded them)
@pytest.mark.parametrize("planes", [("etcd", {"resync_seconds": 3600.0})], indirect=True)
async def test_a_replaced_serving_certificate_is_named_and_repaired(planes: Planes, tmp_path):
    await planes.create("steady")
    await planes.create("rotated")
    kubeconfig = await planes.kubeconfig("rotated", tmp_path)
    # A certificate for every name the API server answers to, from a CA that is not the tenant's,
    # written over its own (a rotation gone wrong): the real kube-apiserver reloads and serves it.
    authority = PkiAuthority()
    ca, ca_key = authority.new_ca("someone-else-ca")
    crt, key = authority.issue_serving(ca, ca_key, "kube-apiserver", ["localhost"], ["127.0.0.1"])
    pki = planes.host.home("rotated") / "volumes" / "pki"
    for name, pem in (("apiserver.key", key), ("apiserver.crt", crt)):
        (pki / f".{name}.new").write_text(pem)
        os.replace(pki / f".{name}.new", pki / name)

    record = await planes.wait_phase("rotated", "NotReady", "ServingCertificateMismatch", timeout=120)
    assert "someone-else-ca" in record.status.message and "rotated-ca" in record.status.message, record.status
    assert "apiserver.crt" in record.status.message, record.status.message
    await planes.wait_phase("rotated", "Ready")  # its own certificate again: the tenant's kubeconfig works
    assert (await planes.kubectl(kubeconfig, "get", "ns")).returncode == 0
    assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]
    assert "ServingCertificateMismatch" not in await planes.reasons("steady")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["postgres"], indirect=True)
async def test_a_changed_datastore_password_is_repaired(planes: Planes, tmp_path):
    await planes.create("steady")
    await planes.create("victim")
    kubeconfig = await planes.kubeconfig("victim", tmp_path)
    conn = await psycopg.AsyncConnection.connect(planes.postgres_admin, autocommit=True)
    async with conn:
        # The manager sets the role's password itself at each pass over the tenant; two ALTER ROLEs
        # of one role at the same moment make PostgreSQL refuse the second ("tuple concurrently
        # updated", seen in CI): the change is made once the manager's is done.
        async def altered() -> bool:
            try:
                await conn.execute(sql.SQL("ALTER ROLE {} PASSWORD 'not-the-one'").format(
                    sql.Identifier(pg_store.role_name("victim"))))
            except psycopg.errors.InternalError_ as exc:
                if "concurrently updated" not in str(exc):
                    raise
                return False
            return True

        await eventually(altered, timeout=30, what="the password changed behind the manager's back")
    os.kill(planes.host.pids("victim")["datastore-shim"], signal.SIGKILL)  # its next login is refused

    await eventually(lambda: planes.host.pids("victim").get("datastore-shim"), timeout=60)
    await planes.wait_phase("victim", "Ready")
    assert (await planes.kubectl(kubeconfig, "get", "ns")).returncode == 0
    assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", [("etcd", {"etcd_mode": "dedicated", "etcd_quota_bytes": QUOTA})], indirect=True)
async def test_a_full_datastore_is_named_and_freeing_it_repairs(planes: Planes, tmp_path):
    await planes.create("steady")
    await planes.create("filler")
    driver = planes.manager.drivers["etcd"]
    assert isinstance(driver, DedicatedEtcdDriver)
    creds = await planes.credentials("filler")
    tenant = driver.gateway("filler")
    root = driver.gateway("filler")
    try:
        await tenant.authenticate(creds.username, creds.password)
        for i in range(4 * QUOTA // len(VALUE)):  # the tenant writes past its own etcd's quota
            try:
                await tenant.put(f"{etcd_store.prefix('filler')}fill/{i}", VALUE)
            except DatastoreAuthFailed:  # (each reconcile's auth change ends etcd's tokens)
                await tenant.authenticate(creds.username, creds.password)
            except DatastoreFull:
                break
        else:
            raise AssertionError("etcd never refused a write")

        record = await planes.wait_phase("filler", "NotReady", "DatastoreFull", timeout=60)
        assert "alarm disarm" in record.status.message, record.status.message
        assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]

        # what the message says: free space, compact, defragment, disarm; the next resync repairs
        await root.authenticate("root", driver._read("filler").root_password)  # type: ignore[union-attr]
        await root.delete_prefix(f"{etcd_store.prefix('filler')}fill/")
        revision = int((await root.call("maintenance/status", {}))["header"]["revision"])
        await root.call("kv/compaction", {"revision": revision, "physical": True})
        await root.call("maintenance/defragment", {})
        member = (await root.call("maintenance/status", {}))["header"]["member_id"]
        await root.call("maintenance/alarm", {"action": "DEACTIVATE", "memberID": member, "alarm": "NOSPACE"})
        await planes.wait_phase("filler", "Ready")
        kubeconfig = await planes.kubeconfig("filler", tmp_path)
        made = await planes.kubectl(kubeconfig, "create", "namespace", "after-the-fill")
        assert made.returncode == 0, made.stderr  # it writes again
    finally:
        await tenant.close()
        await root.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", ["postgres"], indirect=True)
async def test_a_full_postgres_disk_is_named_and_freeing_room_repairs(planes: Planes, tmp_path):
    await planes.create("steady")
    db, role = pg_store.database_name("filler"), pg_store.role_name("filler")
    admin = await psycopg.AsyncConnection.connect(planes.postgres_admin, autocommit=True)
    async with admin:
        with small_disk(DISK) as disk:
            try:
                # the tenant's database on a volume of its own (placed there by the DBA, before the tenant)
                await admin.execute(sql.SQL("CREATE TABLESPACE tessera_small LOCATION {}").format(sql.Literal(str(disk))))
                await admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
                await admin.execute(sql.SQL("CREATE DATABASE {} OWNER {} TABLESPACE tessera_small").format(
                    sql.Identifier(db), sql.Identifier(role)))
                await planes.create("filler")
                kubeconfig = await planes.kubeconfig("filler", tmp_path)

                # PostgreSQL drops a database's relation-cache file when its catalogs change (the
                # manager's own check makes a table), and the next login writes it again: on a full
                # disk that login fails ("FATAL: could not write init file"), which is still full
                for init in disk.rglob("pg_internal.init"):
                    init.unlink()
                filler = disk / "filler"  # the volume filled by someone else, to the last byte
                with open(filler, "wb", buffering=0) as f:
                    try:
                        while True:  # (a write that fits part only writes that part; then none fits)
                            f.write(bytes(1 << 16))
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
                record = await planes.wait_phase("filler", "NotReady", "DatastoreFull", timeout=120)
                assert "out of disk" in record.status.message and "tablespace" in record.status.message, record.status
                assert (await planes.record("steady")).status.phase == "Ready"  # type: ignore[union-attr]

                filler.unlink()  # room again: the next resync finds it
                await planes.wait_phase("filler", "Ready")
                made = await planes.kubectl(kubeconfig, "create", "namespace", "after-the-fill")
                assert made.returncode == 0, made.stderr  # it writes again
            finally:
                await planes.manager.api.remove("filler")
                await admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
                await admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
                await admin.execute("DROP TABLESPACE IF EXISTS tessera_small")


@contextlib.contextmanager
def small_disk(size: int):
    """A tmpfs of ``size`` bytes, the PostgreSQL server's user's to write, unmounted even on failure
    (a mount needs root: the tests' PostgreSQL already runs as the `postgres` user for that reason)."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs for PostgreSQL's full disk needs root: run the tests as root")
    point = Path(tempfile.mkdtemp(prefix="tessera-pg-disk-"))  # (not under pytest's 0700 basetemp)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)], check=True,
                       capture_output=True)
        try:
            owner = pwd.getpwnam("postgres")
            os.chown(point, owner.pw_uid, owner.pw_gid)
            yield point
        finally:
            subprocess.run(["umount", "--lazy", str(point)], check=True, capture_output=True)
    finally:
        point.rmdir()


def planes_spec(planes: Planes):
    from tessera.controlplane.spec import parse_spec

    return parse_spec({"datastore": {"driver": planes.driver}})


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
