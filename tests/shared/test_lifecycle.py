"""The claim lifecycle, written once: every allowed move has one owner, releases are routed by state."""

from __future__ import annotations

from tessera.shared import subjects
from tessera.shared.lifecycle import ALLOWED, ON_NODE, TERMINAL, TRANSITIONS, UNPLACED, allowed, owner_of, \
    release_route


def test_each_move_has_exactly_one_owner_and_nothing_leaves_released():
    edges = [(t.source, t.target) for t in TRANSITIONS]
    assert len(edges) == len(set(edges))
    assert ALLOWED["released"] == frozenset()
    assert not any(allowed("released", s) for s in ALLOWED if s != "released")
    assert allowed("allocated", "allocated")  # a replay stays put
    assert not allowed("running", "allocated") and not allowed("prepared", "unschedulable")


def test_placement_moves_unplaced_claims_and_the_enforcer_moves_placed_ones():
    for t in TRANSITIONS:
        # (one exception: an allocation kube-scheduler took back, unprepared, is placement's to redo)
        placement = t.source in UNPLACED or (t.source, t.target) == ("allocated", "requested")
        assert t.owner == ("placement" if placement else "enforcer"), t
    assert owner_of("requested", "allocated") == "placement"
    assert owner_of("allocated", "prepared") == "enforcer"
    assert owner_of("running", "requested") is None


def test_a_release_goes_to_placement_before_a_node_holds_the_claim_and_to_that_node_after():
    assert release_route("requested", "").owner == "placement"
    assert release_route("unschedulable", "").subject("t", "c") == subjects.claim("t", "c", "release")
    for state in ON_NODE:
        route = release_route(state, "n1")
        assert route.owner == "enforcer" and route.subject("t", "c") == subjects.claim("t", "c", "release", "n1")
        assert route.msg_id("c") == "c:release:n1"
    assert release_route("released", "n1") is None
    assert release_route("failed", "n1").node == "n1"  # a failed claim still holds its GPUs until released
    assert TERMINAL == {"released", "failed"}


def test_who_ends_a_claim_is_read_from_the_route():
    from tessera.shared.lifecycle import ended_with_lost_node, ends
    assert ends("placement", "requested", "") and not ends("enforcer", "requested", "", "n1")
    assert ends("enforcer", "running", "n1", "n1") and not ends("enforcer", "running", "n1", "n2")
    assert not ends("placement", "allocated", "n1") and not ends("translator", "requested", "")
    assert not any(ends(s, "released", "n1", "n1") for s in ("placement", "enforcer"))
    # a peer ends a lost node's claims, also one whose record never left requested
    assert ended_with_lost_node("requested") and ended_with_lost_node("prepared")
    assert not ended_with_lost_node("released")
