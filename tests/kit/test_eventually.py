"""`eventually` returns the first truthy value of a plain or async check, and on timeout fails
with what the check last returned or raised."""

from __future__ import annotations

import pytest

from kit import eventually


async def test_returns_the_first_truthy_value_of_a_plain_check():
    calls = []

    def check():
        calls.append(1)
        return len(calls) >= 3 and "there"

    assert await eventually(check, timeout=5, every=0.001) == "there"
    assert len(calls) == 3


async def test_awaits_an_async_check():
    seen = []

    async def check():
        seen.append(1)
        return len(seen) == 2

    assert await eventually(check, timeout=5, every=0.001) is True


async def test_on_timeout_says_what_the_check_last_returned():
    prepared: list[str] = []
    with pytest.raises(AssertionError, match=r"claims prepared: not true after 0.05s; it last returned \[\]"):
        await eventually(lambda: prepared, timeout=0.05, every=0.01, what="claims prepared")


async def test_an_exception_counts_as_not_yet_and_is_shown_on_timeout():
    attempts = []

    def check():
        attempts.append(1)
        if len(attempts) < 3:
            raise KeyError("gpu-0")
        return "found"

    assert await eventually(check, timeout=5, every=0.001) == "found"

    def never():
        raise KeyError("gpu-1")

    with pytest.raises(AssertionError, match=r"never: not true after 0.05s; it last raised KeyError\('gpu-1'\)") as info:
        await eventually(never, timeout=0.05, every=0.01)
    assert isinstance(info.value.__cause__, KeyError)
