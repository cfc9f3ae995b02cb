"""`tessera dlq list|replay`: the dead letters, and sending one back to where it came from.

A service that gives up on a message publishes a `DeadLetter` (the original subject and payload, the
reason) to ``tessera.dlq.<service>`` in stream TESSERA_DLQ. Once the cause is fixed (a tenant
created, a bug fixed) the operator replays the letter: its payload goes back to its subject once.
Once, because the republished message carries ``Nats-Msg-Id: dlq-replay:<seq>`` (two replays racing
within the stream's duplicate window store one message) and a mark is left on
``tessera.dlq.replayed.<seq>`` afterwards (a later replay finds it and sends nothing, whatever the
window). ``--force`` sends a letter again on purpose.

Listing needs only the read-only viewer identity; replaying publishes on the letter's subject and
so needs the operator's.
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import nats.errors
from nats.js import api as jsapi
from rich.console import Console
from rich.table import Table

from tessera.shared import subjects
from tessera.shared.events import DeadLetter, DeadLetterReplayed, dlq_decoder, encode

from tessera.cli import exitcodes
from tessera.cli.client import Client
from tessera.cli.errors import CliError
from tessera.cli.options import add_identity_args, add_output_arg

console = Console()
FETCH = 256


class Letter(msgspec.Struct, kw_only=True):
    """One dead letter as `tessera dlq list -o json` prints it."""

    seq: int
    service: str
    subject: str
    reason: str
    deliveries: int
    stream: str
    ts: float
    payload: str
    replayed: bool = False
    replayed_at: float | None = None
    replayed_seq: int | None = None


def register(sub: argparse._SubParsersAction) -> None:
    dlq = sub.add_parser("dlq", help="list and replay dead letters (messages a service gave up on)")
    verbs = dlq.add_subparsers(dest="dlq_command", metavar="{list,replay}", required=True)
    lst = verbs.add_parser("list", help="every dead letter still in the stream, oldest first")
    add_identity_args(lst)
    lst.add_argument("--service", help="only the letters of this service (e.g. placement)")
    add_output_arg(lst)
    lst.set_defaults(func=cmd_list)
    rep = verbs.add_parser("replay", help="send letters back to their subjects, once each")
    add_identity_args(rep)
    rep.add_argument("seq", nargs="+", type=int, help="the letters' sequence numbers (from 'tessera dlq list')")
    rep.add_argument("--force", action="store_true", help="send again a letter that was already replayed")
    add_output_arg(rep)
    rep.set_defaults(func=cmd_replay)


async def read_letters(client: Client, service: str | None = None) -> list[Letter]:
    """The stream's letters with their replay marks, read by a pull consumer (nothing is removed)."""
    try:
        sub = await client.bus.pull_subscribe(
            f"{subjects.DLQ}.>", stream=subjects.STREAM_DLQ,
            config=jsapi.ConsumerConfig(ack_policy=jsapi.AckPolicy.NONE, deliver_policy=jsapi.DeliverPolicy.ALL,
                                        mem_storage=True, inactive_threshold=60.0),
        )
    except nats.js.errors.NotFoundError:
        raise CliError(f"stream {subjects.STREAM_DLQ} does not exist yet: Tessera's services create it when they "
                       f"first start", code=exitcodes.UNAVAILABLE) from None
    letters: dict[int, Letter] = {}
    marks: dict[int, DeadLetterReplayed] = {}
    try:
        pending = (await sub.consumer_info()).num_pending
        while pending:
            for msg in await sub.fetch(min(pending, FETCH), timeout=10):
                seq = msg.metadata.sequence.stream
                pending = msg.metadata.num_pending
                try:
                    event = dlq_decoder.decode(msg.data)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    continue  # not a letter of ours: nothing to replay
                if isinstance(event, DeadLetterReplayed):
                    marks[event.seq] = event
                elif service is None or event.service == service:
                    letters[seq] = Letter(seq=seq, service=event.service, subject=event.subject,
                                          reason=event.reason, deliveries=event.deliveries, stream=event.stream,
                                          ts=event.ts, payload=event.payload)
    finally:
        await sub.unsubscribe()
    for seq, mark in marks.items():
        if seq in letters:
            letters[seq].replayed, letters[seq].replayed_at = True, mark.ts
            letters[seq].replayed_seq = mark.replayed_seq or None
    return [letters[s] for s in sorted(letters)]


async def cmd_list(args) -> int:
    client = await Client.from_args(args, read_only=True)
    try:
        letters = await read_letters(client, args.service)
    finally:
        await client.close()
    if args.output == "json":
        print(json.dumps(msgspec.to_builtins(letters), indent=2))
        return exitcodes.OK
    table = Table(title=f"dead letters ({len(letters)})", title_justify="left")
    for col in ("seq", "when", "service", "subject", "reason", "replayed"):
        table.add_column(col)
    for letter in letters:
        table.add_row(str(letter.seq), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(letter.ts)),
                      letter.service, letter.subject or "(unknown)", letter.reason[:70],
                      "yes" if letter.replayed else "")
    console.print(table)
    return exitcodes.OK


async def replay(client: Client, seq: int, *, force: bool = False) -> dict:
    """Send letter ``seq`` back to its subject once; returns what happened (a JSON-able dict)."""
    bus = client.bus
    try:
        stored = await bus.stored_message(subjects.STREAM_DLQ, seq)
    except nats.js.errors.NotFoundError:
        raise CliError(f"no dead letter at sequence {seq} of {subjects.STREAM_DLQ}: see 'tessera dlq list'") from None
    try:
        letter = dlq_decoder.decode(stored.data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CliError(f"message {seq} of {subjects.STREAM_DLQ} is not a dead letter ({exc})") from None
    if not isinstance(letter, DeadLetter):
        raise CliError(f"message {seq} is a replay mark, not a dead letter; replay the letter it names ({letter.seq})")
    if not letter.subject:
        raise CliError(f"letter {seq} does not say which subject it came from (it aged out of its stream before it "
                       f"was dead-lettered): nothing to send it back to")
    if "\ufffd" in letter.payload:
        raise CliError(f"letter {seq}'s payload was not UTF-8 and is kept only as a lossy copy: replaying it would "
                       f"send different bytes; republish the original by hand if you have it")
    mark_subject = subjects.dlq_replayed(seq)
    if not force and await client.bus.stored(subjects.STREAM_DLQ, mark_subject):
        return {"seq": seq, "subject": letter.subject, "replayed": False, "already_replayed": True}
    msg_id = f"dlq-replay:{seq}" if not force else f"dlq-replay:{seq}:{time.time_ns()}"
    try:
        ack = await bus.publish_bytes(letter.subject, letter.payload.encode(), headers={"Nats-Msg-Id": msg_id})
    except nats.js.errors.NoStreamResponseError:
        raise CliError(f"no stream stores {letter.subject}: the letter cannot be replayed there") from None
    except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError) as exc:
        raise CliError(f"publishing to {letter.subject} failed ({exc!r}): run the replay again (it is sent once)",
                       code=exitcodes.UNAVAILABLE) from None
    mark = DeadLetterReplayed(seq=seq, subject=letter.subject, replayed_seq=ack.seq, stream=ack.stream)
    await bus.publish_bytes(mark_subject, encode(mark), headers={"Nats-Msg-Id": f"dlq-replayed:{seq}:{msg_id}"})
    duplicate = bool(ack.duplicate)  # a concurrent replay stored it first (same Nats-Msg-Id)
    return {"seq": seq, "subject": letter.subject, "replayed": not duplicate, "already_replayed": duplicate,
            "stream": ack.stream, "stream_seq": ack.seq}


async def cmd_replay(args) -> int:
    client = await Client.from_args(args)
    results = []
    try:
        for seq in args.seq:
            results.append(await replay(client, seq, force=args.force))
    finally:
        await client.close()
    if args.output == "json":
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["replayed"]:
                console.print(f"letter {r['seq']} sent back to {r['subject']} ({r['stream']} #{r['stream_seq']})")
            else:
                console.print(f"letter {r['seq']} was already replayed: nothing sent (--force sends it again)")
    return exitcodes.OK
