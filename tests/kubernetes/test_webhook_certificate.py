"""The webhook serves a renewed certificate without a restart (cert-manager rotates it, the kubelet
swaps the Secret volume's ``..data`` symlink); connections made before keep working; a file that
does not load is logged and the certificate in service kept."""

from __future__ import annotations

import logging

from tessera.translator.service import TranslatorSettings

from kit import eventually
from translator_harness import free_port, running_translator
from webhook_tls import Authority, post_review, project_secret, served_serial


def review(uid: str) -> dict:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "ml"},
           "spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": "ml", "operation": "CREATE", "object": pod}}


async def served_now(port: int, authority: Authority) -> int:
    """The serial of the certificate a new connection is served."""
    seen, _, writer = await served_serial(port, authority)
    writer.close()
    await writer.wait_closed()
    return seen


async def serial_becomes(port: int, authority: Authority, serial: int) -> None:
    async def served() -> bool:
        return await served_now(port, authority) == serial

    await eventually(served, timeout=30, every=0.05, what=f"certificate {serial} served")


async def test_renewed_certificate_is_served_to_new_connections(nats_url, tmp_path, caplog):
    authority = Authority()
    secret = tmp_path / "webhook-tls"
    first_cert, first_key, first = authority.serving()
    project_secret(secret, {"tls.crt": first_cert, "tls.key": first_key, "ca.crt": authority.pem})
    port = free_port()
    settings = TranslatorSettings(webhook_port=port, webhook_host="127.0.0.1", webhook_cert=str(secret / "tls.crt"),
                                  webhook_key=str(secret / "tls.key"), cert_poll_seconds=0.05)
    async with running_translator(nats_url, settings):
        serial, old_reader, old_writer = await served_serial(port, authority)
        assert serial == first
        assert (await post_review(old_reader, old_writer, review("a")))["response"]["allowed"] is True

        second_cert, second_key, second = authority.serving()
        project_secret(secret, {"tls.crt": second_cert, "tls.key": second_key, "ca.crt": authority.pem})
        await serial_becomes(port, authority, second)
        # The connection made before the renewal still answers reviews, on the old certificate.
        answer = await post_review(old_reader, old_writer, review("b"))
        assert answer["response"] == {"uid": "b", "allowed": True}
        old_writer.close()
        await old_writer.wait_closed()

        # Half-written files: the change is logged and the renewed certificate stays in service.
        caplog.set_level(logging.ERROR, logger="tessera.translator.certs")
        project_secret(secret, {"tls.crt": second_cert[: len(second_cert) // 2], "tls.key": b"garbage",
                                "ca.crt": authority.pem})
        # (only the log says the files were read and refused: the certificate served stays the same)
        await eventually(lambda: any("do not load" in r.getMessage() for r in caplog.records), timeout=30,
                         every=0.05, what="the half-written files logged as not loading")
        serial, reader, writer = await served_serial(port, authority)
        assert serial == second
        assert (await post_review(reader, writer, review("c")))["response"]["allowed"] is True
        writer.close()
        await writer.wait_closed()

        # ...and the next good renewal is picked up.
        third_cert, third_key, third = authority.serving()
        project_secret(secret, {"tls.crt": third_cert, "tls.key": third_key, "ca.crt": authority.pem})
        await serial_becomes(port, authority, third)
