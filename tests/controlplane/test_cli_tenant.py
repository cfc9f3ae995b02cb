"""`tessera tenant ...` talks to a real manager over NATS request/reply and prints tables."""

from __future__ import annotations

import argparse
import asyncio

import msgspec
import pytest
import yaml

from tessera.cli import tenant
from tessera.controlplane import api
from tessera.controlplane.app import Manager
from tessera.controlplane.spec import TenantControlPlane
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.natsserver import NatsServer
from tessera.shared.settings import BusSettings

from kit import eventually


async def answering(bus: Bus) -> None:
    """The tenant API answers: the serve tasks just started have made their subscriptions."""
    await eventually(lambda: bus.request(f"{subjects.API_TENANTS}.list", b"{}", timeout=1), every=0.05,
                     what="the tenant API answering")


@pytest.fixture
async def served(bus):
    mgr = await Manager.start(bus, ControlPlaneSettings())
    tasks = [asyncio.create_task(bus.serve(f"{subjects.API_TENANTS}.{verb}", h)) for verb, h in mgr.api.handlers().items()]
    try:
        await answering(bus)
        yield bus.settings.url
    finally:
        await cancel_and_wait(tasks)
        await mgr.close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera")
    tenant.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


async def test_create_list_get_delete_with_tables(served, capsys):
    url = served
    args = parse("tenant", "create", "alpha", "--gpus", "4", "--memory-mib", "40000", "--size", "medium", "--nats", url)
    assert await args.func(args) == 0
    assert "Phase" in capsys.readouterr().out
    args = parse("tenant", "list", "--nats", url)
    assert await args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["NAME", "PHASE"]
    assert out[1].split()[:6] == ["alpha", "Ready", "4", "40000", "-", "medium"]
    args = parse("tenant", "get", "alpha", "--nats", url)
    assert await args.func(args) == 0
    assert "gpus=4 memory_mib=40000" in capsys.readouterr().out
    args = parse("tenant", "delete", "alpha", "--nats", url)
    assert await args.func(args) == 0
    assert "deleted" in capsys.readouterr().out


async def test_refusals_name_the_field_and_exit_nonzero(served, capsys):
    args = parse("tenant", "create", "Bad_Name", "--nats", served)
    assert await args.func(args) == 1
    err = capsys.readouterr().err
    assert "[name]" in err and "lowercase" in err
    args = parse("tenant", "get", "nobody", "--nats", served)
    assert await args.func(args) == 1
    assert "not-found" in capsys.readouterr().err


async def test_tenant_commands_connect_as_the_user_the_environment_names(tmp_path, monkeypatch, capsys):
    """Like every other command, `tenant` connects as $TESSERA_NATS_USER with its password file
    (how the compose set is driven from the host), not only as the URL's user."""
    auth = tmp_path / "auth"
    passwords = identities.write_auth_dir(auth, ["gpu-0"])
    srv = NatsServer(tmp_path / "store", config_file=auth / "nats.conf").start()
    try:
        manager_bus = await Bus.connect(BusSettings(url=srv.url, user="controlplane", password=passwords["controlplane"],
                                                    file_storage=False), "controlplane")
        await manager_bus.ensure_topology()
        mgr = await Manager.start(manager_bus, ControlPlaneSettings())
        tasks = [asyncio.create_task(manager_bus.serve(f"{subjects.API_TENANTS}.{verb}", h))
                 for verb, h in mgr.api.handlers().items()]
        try:
            await manager_bus.flush()
            secret = tmp_path / "operator-password"
            secret.write_text(passwords["operator"])
            monkeypatch.setenv("TESSERA_NATS_USER", "operator")
            monkeypatch.setenv("TESSERA_NATS_PASSWORD_FILE", str(secret))
            args = parse("tenant", "list", "--nats", srv.url)  # no credentials in the URL
            assert await args.func(args) == 0, capsys.readouterr().err
            assert capsys.readouterr().out.split()[:2] == ["NAME", "PHASE"]
        finally:
            await cancel_and_wait(tasks)
            await mgr.close()
            await manager_bus.close()
    finally:
        srv.stop()


async def test_kubeconfig_prints_the_tenants_admin_kubeconfig(served, capsys):
    url = served
    args = parse("tenant", "kubeconfig", "nobody", "--nats", url)
    assert await args.func(args) != 0
    assert "tenant 'nobody' has no kubeconfig" in capsys.readouterr().err
    args = parse("tenant", "create", "alpha", "--nats", url)
    assert await args.func(args) == 0
    capsys.readouterr()
    args = parse("tenant", "kubeconfig", "alpha", "--nats", url)
    assert await args.func(args) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["current-context"] == "tessera-alpha"
    assert config["users"][0]["user"]["client-certificate-data"]


async def test_sleep_and_wake_show_in_tenant_get(served, capsys):
    # (a manager that runs no control plane: the record and the status say it all the same; the
    # Deployment scaled to zero on a host: test_kubernetes_mode.py)
    url = served
    args = parse("tenant", "create", "alpha", "--nats", url)
    assert await args.func(args) == 0
    args = parse("tenant", "sleep", "alpha", "--nats", url)
    assert await args.func(args) == 0
    assert "tenant alpha: NotReady (Sleeping)" in capsys.readouterr().out
    args = parse("tenant", "get", "alpha", "--nats", url)
    assert await args.func(args) == 0
    shown = dict(line.split(None, 1) if " " in line else (line, "") for line in capsys.readouterr().out.splitlines())
    assert shown["Phase"].strip() == "NotReady" and shown["Reason"].strip() == "Sleeping", shown
    assert shown["Replicas"].strip() == "0 (asleep; a wake scales it to 2)", shown
    args = parse("tenant", "wake", "alpha", "--nats", url)
    assert await args.func(args) == 0
    assert "tenant alpha: Ready (Ready)" in capsys.readouterr().out
    args = parse("tenant", "get", "alpha", "--nats", url)
    assert await args.func(args) == 0
    shown = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert shown["Last"].startswith("wake") and shown["Last"].endswith(" s until Ready"), shown
    args = parse("tenant", "wake", "nobody", "--nats", url)
    assert await args.func(args) != 0
    assert "tenant 'nobody' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("syncer", "shown"), [("", "-"), ("Syncing", "Syncing"),
                                               ("Failed: Forbidden: pods is forbidden", "Failed: Forbidden: pods is forbidden")])
def test_get_shows_the_state_of_the_tenants_gpu_pod_syncer(syncer, shown):
    # What the API returns for a tenant (its view, as JSON would carry it) and what `tessera tenant
    # get` prints: the pod syncer's state, "-" where none runs (no host cluster).
    record = TenantControlPlane(name="alpha", uid="u")
    record.status.gpu_pods = syncer
    detail = tenant.render_detail(msgspec.to_builtins(api.view(record))).splitlines()
    [line] = [row for row in detail if row.startswith("GPU pods")]
    assert line.split(None, 2)[2] == shown
