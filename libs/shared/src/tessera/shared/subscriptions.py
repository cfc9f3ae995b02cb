"""What a consumer of the bus declares, and the one rule that decides each message's fate.

A service says what it reads as a `Subscription` (one handler call per message) or a
`BatchSubscription` (one call per fetched batch, one outcome per message), typed by the event its
decoder yields; `tessera.shared.bus.Bus.consume` / ``consume_batches`` run them. Either way a
message's outcome goes through `verdict`, so a handler that raises, and a batch handler that
returns the same exception for an item, send the message the same way: acked, redelivered after a
delay, or dead-lettered and terminated (the error classes are `tessera.shared.errors`). Nothing here
talks to NATS: the bus applies the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Literal, Mapping, Sequence, TypeVar

import msgspec

from tessera.shared.errors import ConflictError, PermanentError, TemporaryError

E = TypeVar("E")

# A lost compare-and-set is retried at once, in-process, this many times before the message is
# given back to the server (a handler of one message is re-run by the bus; a batch handler
# retries its own lost races).
CONFLICT_RETRIES = 50
# A message whose handler kept losing its compare-and-set: redelivered after this long, to re-read.
CONFLICT_KEPT_LOSING_DELAY = 0.1
# A conflict a batch handler reports for one of its items: re-read and retry at once, through a
# redelivery (the batch is not re-run for it).
CONFLICT_REDELIVERY_DELAY = 0.01


@dataclass(frozen=True)
class Delivery:
    """What a handler may want to know about the message besides its decoded event."""

    subject: str
    headers: Mapping[str, str]
    data: bytes
    num_delivered: int


Handler = Callable[[E, Delivery], Awaitable[None]]
# Returns one outcome per item, in order: None (ack) or the exception deciding its fate.
BatchHandler = Callable[[Sequence[tuple[E, Delivery]]], Awaitable[Sequence[BaseException | None]]]


@dataclass(frozen=True, kw_only=True)
class _Consumer(Generic[E]):
    """A durable pull consumer on ``stream``: what it reads and how each message is decoded."""

    stream: str
    durable: str
    # The subjects the server delivers to it (the consumer's filter); at least one.
    filter_subjects: Sequence[str]
    decoder: msgspec.json.Decoder[E]
    batch: int = 64  # messages per fetch
    deliver_new: bool = False  # start at the next message instead of the stream's first
    max_deliver: int | None = None  # None: the bus settings' max_deliver

    def __post_init__(self) -> None:
        name = f"{type(self).__name__}(durable={self.durable!r})"
        if not self.stream or not self.durable:
            raise ValueError(f"{name}: stream and durable must be named (got stream={self.stream!r})")
        if isinstance(self.filter_subjects, str) or not self.filter_subjects:
            raise ValueError(f"{name}: filter_subjects must be a non-empty list of subjects, "
                             f"got {self.filter_subjects!r}")
        if self.batch < 1:
            raise ValueError(f"{name}: batch must be at least 1, got {self.batch}")
        if self.max_deliver is not None and self.max_deliver < 1:
            raise ValueError(f"{name}: max_deliver must be at least 1 (or None for the bus's), got {self.max_deliver}")
        object.__setattr__(self, "filter_subjects", list(self.filter_subjects))


@dataclass(frozen=True, kw_only=True)
class Subscription(_Consumer[E]):
    """Each message is decoded and handed to ``handler`` in a span of its own; a lost
    compare-and-set (`ConflictError`) re-runs the handler at once, up to `CONFLICT_RETRIES` times.

    ``concurrency`` > 1 handles the messages of one fetched batch side by side; the handler must
    then be safe to run so (idempotent, compare-and-set writes)."""

    handler: Handler[E]
    concurrency: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.concurrency < 1:
            raise ValueError(f"Subscription(durable={self.durable!r}): concurrency must be at least 1, "
                             f"got {self.concurrency}")


@dataclass(frozen=True, kw_only=True)
class BatchSubscription(_Consumer[E]):
    """Each fetched batch is decoded (what does not decode is dead-lettered first) and handed to
    ``handler`` whole, which returns one outcome per item; it makes its own spans and retries its
    own lost compare-and-sets (a `ConflictError` outcome is redelivered at once)."""

    handler: BatchHandler[E]


@dataclass(frozen=True)
class Verdict:
    """What becomes of a handled message."""

    action: Literal["ack", "redeliver", "dead-letter"]
    delay: float = 0.0  # redeliver: after this many seconds
    reason: str = ""  # redeliver: why (for the log); dead-letter: the letter's reason
    routine: bool = False  # redeliver: a lost race, normal (logged at debug, not as a warning)


ACK = Verdict("ack")


def kept_losing() -> TemporaryError:
    """The outcome of a message whose handler lost its compare-and-set `CONFLICT_RETRIES` times."""
    return TemporaryError("compare-and-set kept losing", delay=CONFLICT_KEPT_LOSING_DELAY)


def verdict(outcome: BaseException | None, delivered: int, max_deliver: int) -> Verdict:
    """The fate of a message on its ``delivered``-th delivery whose handling came to ``outcome``
    (None: done). Permanent errors are dead-lettered at once; anything else is redelivered, after
    the delay a `TemporaryError` names (a conflict: at once; an unexpected error: backing off),
    until the ``max_deliver``-th delivery, which is dead-lettered instead."""
    if outcome is None:
        return ACK
    if isinstance(outcome, PermanentError):
        return Verdict("dead-letter", reason=str(outcome))
    if isinstance(outcome, TemporaryError):
        reason, delay = str(outcome), outcome.delay
    elif isinstance(outcome, ConflictError):
        reason, delay = f"compare-and-set lost: {outcome}", CONFLICT_REDELIVERY_DELAY
    else:
        reason, delay = f"{type(outcome).__name__}: {outcome}", min(0.2 * 2**delivered, 10)
    if delivered >= max_deliver:
        return Verdict("dead-letter", reason=f"gave up after {delivered} deliveries: {reason}")
    return Verdict("redeliver", delay=delay, reason=reason, routine=isinstance(outcome, ConflictError))
