"""Attack: a workload holds its accounting file's update lock. The enforcer (root, reading every
claim's file in one observe pass) used to wait on that lock without a timeout, stalling the node's
observe loop until peers declared the node lost and released every co-located claim. The read must
not wait: a lock held too long is reported, naming the claim, and the claim's usage counts as
unknown (in use), never as idle."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from isokit import Hostile, forge

from tessera.enforcer import accounting
from tessera.enforcer.claimdir import ClaimDir
from tessera.enforcer.observe import ClaimView, Observer


def read_or_give_up(path: Path, holder: Hostile) -> BaseException | accounting.VgpuSnapshot:
    """The read in a thread; if it blocks, the holder is let go so the test ends (and fails)."""
    out: list = []

    def run() -> None:
        try:
            out.append(accounting.read(path))
        except BaseException as exc:  # the outcome is the assertion's business
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    blocked = t.is_alive()
    holder.stop()
    t.join()
    assert not blocked, "the enforcer's read waited for the workload's lock"
    return out[0]


def test_a_held_lock_is_reported_not_waited_for(tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    forge(cache, [])
    holder = Hostile("hold-lock", str(cache))
    got = read_or_give_up(cache, holder)
    assert isinstance(got, accounting.VgpuCacheLocked), got
    assert "held for more than" in str(got) and str(cache) in str(got)
    assert accounting.read(cache).processes == ()  # readable again once the lock is dropped


def test_the_observer_names_the_claim_and_keeps_it_in_use(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = ClaimDir(tmp_path / "claims" / "run-hostile")
    directory.create({}, "")
    forge(directory.cache, [])
    holder = Hostile("hold-lock", str(directory.cache))
    observer = Observer("n1", None, None, None, None)
    cv = ClaimView(claim="run-hostile", record=None, directory=directory)
    caplog.set_level(logging.WARNING, logger="tessera.enforcer.observe")
    try:
        observer._read_files([cv])
        observer._read_files([cv])  # a second pass while still held: reported once, not every pass
    finally:
        holder.stop()
    assert "held for more than" in cv.error
    warnings = [r.getMessage() for r in caplog.records if "run-hostile" in r.getMessage()]
    assert len(warnings) == 1 and "lock held too long, not waited for" in warnings[0]
    assert observer.unreadable == {"run-hostile": cv.error}
    observer._read_files([cv := ClaimView(claim="run-hostile", record=None, directory=directory)])
    assert cv.error == "" and observer.unreadable == {}
