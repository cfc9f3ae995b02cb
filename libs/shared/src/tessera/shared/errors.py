"""Errors classified by what the caller should do next, not by where they came from.

A bus handler raises one of these and the consumer loop acts on the class:
- PermanentError: the message can never succeed (bad payload, impossible request) -> terminate it
  and publish it to the dead-letter subject with the reason;
- TemporaryError: I/O or a peer is down -> negative-ack with a delay, try again later;
- ConflictError: a compare-and-set lost a race -> re-read and retry now.
Anything else escaping a handler is treated as temporary until the delivery limit, then dead-lettered.

`retry_cas` is the "retry now" of a ConflictError, written once with its bound: every
compare-and-set (a KV bucket's revision, a Kubernetes object's resourceVersion) retries through it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

R = TypeVar("R")

# How often a lost compare-and-set is re-read and retried before the caller is told (ConflictError).
CAS_ATTEMPTS = 20


class TesseraError(Exception):
    """Base of the classified errors."""


class PermanentError(TesseraError):
    """Retrying cannot help: dead-letter with this reason."""


class TemporaryError(TesseraError):
    """Retry later; ``delay`` seconds is a hint for the redelivery."""

    def __init__(self, message: str, delay: float = 1.0) -> None:
        super().__init__(message)
        self.delay = delay


class ConflictError(TesseraError):
    """A compare-and-set lost: re-read current state and try again immediately."""


class ConfigError(TesseraError):
    """A setting is missing or malformed; raised at start-up with the variable's name."""


async def retry_cas(attempt: Callable[[], Awaitable[R]], attempts: int = CAS_ATTEMPTS, what: str = "") -> R:
    """Run ``attempt`` (which re-reads what it writes) until it does not lose a race, at most
    ``attempts`` times; then ConflictError, so the caller's message is retried later, not forever now."""
    for _ in range(attempts):
        try:
            return await attempt()
        except ConflictError:
            continue
    raise ConflictError(f"{what or 'a compare-and-set'} kept losing after {attempts} attempts")
