"""The pure rendezvous core: the close rule, rank assignment, the world record."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.errors import UsageError
from elasticd.rendezvous.decisions import (
    EVIDENCE_MARK,
    Change,
    Member,
    RendezvousSettings,
    World,
    build_world,
    close_delay,
    member_json,
    order_members,
    parse_join_key,
    parse_member,
    parse_world,
    pending_previous,
    world_changes,
)
from elasticd.rendezvous.errors import RendezvousState


def _delay(**kw):
    base = dict(
        joined=2, pending_previous=0, min_nodes=2, max_nodes=4, since_last_join=0.0, settle=1.0
    )
    base.update(kw)
    return close_delay(**base)


def test_a_round_closes_at_once_when_max_nodes_joined():
    assert _delay(joined=4, since_last_join=0.0) == 0.0


def test_a_round_at_min_nodes_closes_after_settle_without_new_joins():
    assert _delay(joined=2, since_last_join=0.25) == pytest.approx(0.75)
    assert _delay(joined=3, since_last_join=1.5) == 0.0


def test_a_round_below_min_nodes_never_closes_on_time_alone():
    assert _delay(joined=1, since_last_join=100.0) is None


def test_a_round_waits_for_live_members_of_the_previous_world_even_at_max():
    assert _delay(joined=4, pending_previous=1) is None


def test_a_fast_reform_waits_for_a_silent_previous_member_only_for_the_grace_after_evidence():
    fast = dict(reform=True, reform_grace=0.3)
    # No evidence yet: a pending member is waited for (its lease decides), as before.
    assert _delay(pending_previous=1, since_evidence=None, **fast) is None
    # Evidence seen 0.1 s ago: wait out the rest of the grace, then close without it.
    assert _delay(pending_previous=1, since_evidence=0.1, **fast) == pytest.approx(0.2)
    assert _delay(pending_previous=1, since_evidence=0.3, **fast) == 0.0
    # ...but never below min_nodes.
    assert _delay(joined=1, pending_previous=1, since_evidence=5.0, **fast) is None


def test_a_fast_reform_skips_settle_once_every_previous_member_rejoined():
    assert _delay(joined=2, since_last_join=0.0, reform=True, reform_grace=0.3) == 0.0
    # The first world (no previous one) still settles, and without a grace nothing changes.
    assert _delay(joined=2, since_last_join=0.0, reform=False, reform_grace=0.3) == 1.0
    assert _delay(joined=2, since_last_join=0.0, reform=True) == 1.0
    assert _delay(pending_previous=1, since_evidence=9.0, reform=True) is None


def test_an_evidence_join_round_trips_and_stays_out_of_the_world_record():
    m = Member(node="a", addr="h", port=1, evidence=True)
    assert parse_member("a", member_json(m).encode()) == m
    assert EVIDENCE_MARK in member_json(m).encode()
    assert EVIDENCE_MARK not in member_json(Member(node="a", addr="h", port=1)).encode()
    world = World(run_id="r", round=1, members=(m,))
    assert "evidence" not in world.to_json()


def test_survivors_keep_their_relative_order_and_newcomers_follow_sorted_by_name():
    members, waiting = order_members(["c", "a", "b"], {"b": 9, "z": 3, "c": 7, "y": 5}, 8)
    assert members == ["c", "b", "y", "z"]
    assert waiting == []


def test_over_max_nodes_survivors_win_and_the_latest_newcomers_wait():
    members, waiting = order_members(["b", "a"], {"a": 1, "b": 2, "n2": 3, "n1": 4}, 3)
    assert members == ["b", "a", "n2"]
    assert waiting == ["n1"]


@given(
    previous=st.lists(st.sampled_from("abcdefgh"), unique=True),
    joined=st.dictionaries(st.sampled_from("abcdefghijk"), st.integers(1, 100), min_size=1),
    max_nodes=st.integers(1, 12),
)
def test_rank_order_is_a_deterministic_partition_of_the_joined_nodes(previous, joined, max_nodes):
    members, waiting = order_members(previous, joined, max_nodes)
    assert sorted(members + waiting) == sorted(joined)
    assert len(members) == min(max_nodes, len(joined))
    kept = [n for n in previous if n in members]
    assert members[: len(kept)] == kept  # survivors first, in their old order
    assert members[len(kept) :] == sorted(members[len(kept) :])  # then newcomers by name
    assert (members, waiting) == order_members(
        list(previous), dict(reversed(joined.items())), max_nodes
    )


def test_a_world_round_trips_through_json_with_rank_zero_as_master():
    members = (
        Member(node="b", addr="10.0.0.2", port=29500),
        Member(node="a", addr="10.0.0.1", port=1),
    )
    world = World(run_id="job", round=3, members=members)
    again = parse_world(world.to_json().encode(), revision=17)
    assert again.nodes == ("b", "a") and again.round == 3 and again.revision == 17
    assert (again.master_addr, again.master_port) == ("10.0.0.2", 29500)
    assert again.rank_of("a") == 1 and again.rank_of("zz") is None


@pytest.mark.parametrize(
    "raw", [b"\x80\x04pickle", b"{}", b'{"version": 1, "members": "x"}', b"[]"]
)
def test_a_corrupt_world_record_is_a_state_error_not_a_crash(raw):
    with pytest.raises(RendezvousState):
        parse_world(raw)


def test_build_world_uses_the_previous_world_to_keep_ranks_stable():
    old = World(run_id="r", round=1, members=tuple(Member(node=n, addr="h", port=1) for n in "abc"))
    joined = {n: (i, Member(node=n, addr="h", port=i)) for i, n in enumerate(["d", "c", "a"])}
    world, waiting = build_world(run_id="r", round_=2, previous=old, joined=joined, max_nodes=8)
    assert world.nodes == ("a", "c", "d") and world.round == 2 and waiting == []
    assert pending_previous(old, ["b", "x"]) == 1


def test_join_keys_parse_back_to_round_and_node():
    s = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=2)
    assert parse_join_key(s, s.join_key(7, "node-a")) == (7, "node-a")
    assert parse_join_key(s, s.world_key()) is None


@pytest.mark.parametrize(
    "kw",
    [
        dict(run_id=""),
        dict(run_id="a/b"),
        dict(min_nodes=0),
        dict(min_nodes=3, max_nodes=2),
        dict(ttl=0.5),
        dict(min_nodes=2, max_nodes=4, start_nodes=1),
        dict(min_nodes=1, max_nodes=2, start_nodes=3),
        dict(start_wait=-1),
    ],
)
def test_impossible_settings_are_usage_errors(kw):
    with pytest.raises(UsageError):
        RendezvousSettings(**{"run_id": "r", **kw})


def test_start_nodes_lengthen_the_settle_of_the_first_round_only():
    s = RendezvousSettings(run_id="r", min_nodes=1, max_nodes=4, start_nodes=3, settle=1,
                           start_wait=60)  # fmt: skip
    assert s.close_rule(first=True, joined=2) == (1, 60)  # short of start: a longer settle
    assert s.close_rule(first=True, joined=3) == (1, 1)
    assert s.close_rule(first=False, joined=2) == (1, 1)  # a later round: as ever
    plain = RendezvousSettings(run_id="r", min_nodes=2, max_nodes=4, settle=1)
    assert plain.close_rule(first=True, joined=1) == (2, 1)


def test_keepalive_defaults_to_a_third_of_the_ttl():
    assert RendezvousSettings(run_id="r", ttl=3).keepalive == pytest.approx(1.0)


def _world(*nodes, round_=1):
    return World(
        run_id="r", round=round_, members=tuple(Member(node=n, addr="h", port=1) for n in nodes)
    )


def test_a_vanished_member_is_reported_lost_and_a_next_round_joiner_waiting():
    w = _world("a", "b", "c")
    changes = world_changes(world=w, members={"a", "b", "c"}, me="a", live={"a", "c"},
                            next_round={"d"}, still_joined=True, closed=False)  # fmt: skip
    assert changes == [Change("lost", ("b",)), Change("waiting", ("d",))]


def test_our_own_missing_key_is_a_lost_lease_and_a_closed_run_trumps_everything():
    w = _world("a", "b")
    changes = world_changes(world=w, members={"a", "b"}, me="a", live={"b"}, next_round=(),
                            still_joined=True, closed=False)  # fmt: skip
    assert changes == [Change("lease-lost", ("a",))]
    assert world_changes(world=w, members={"a", "b"}, me="a", live=(), next_round=(),
                         still_joined=True, closed=True) == [Change("closed")]  # fmt: skip


def test_a_steady_world_has_no_changes_and_an_excluded_joiner_counts_as_waiting():
    w = _world("a", "b")
    assert world_changes(world=w, members={"a", "b"}, me="a", live={"a", "b"}, next_round=(),
                         still_joined=True, closed=False) == []  # fmt: skip
    assert world_changes(world=w, members={"a", "b"}, me="a", live={"a", "b", "x"},
                         next_round=(), still_joined=True, closed=False) == [Change("waiting", ("x",))]  # fmt: skip


def test_a_member_whose_join_is_not_seen_yet_is_not_lost_until_the_join_feed_catches_up():
    """The world (state feed) and the joins (join feed) come through separate watches: a
    world closed from joins this mirror has not seen yet must not read as those members
    lost (that ended healthy worlds at once under load, a second re-form per fault). A
    join seen deleted is lost at once; a join feed that has caught up with the world's
    revision is believed as it stands."""
    from elasticd.etcd.client import KeyValue
    from elasticd.etcd.watch import Event
    from elasticd.rendezvous.mirror import Mirror

    s = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=3)
    members = tuple(Member(node=n, addr="127.0.0.1", port=1) for n in "abc")

    def kv(key: str, value: str, rev: int) -> KeyValue:
        return KeyValue(key=key, value=value.encode(), create_revision=rev, mod_revision=rev,
                        lease=0)  # fmt: skip

    def join(node: str, rev: int) -> Event:
        return Event("put", kv(s.join_key(2, node), member_json(members["abc".index(node)]), rev))

    def gone(node: str, rev: int) -> Event:
        return Event("delete", kv(s.join_key(2, node), "", rev))

    world_doc = World(run_id="job", round=2, members=members).to_json()
    m = Mirror(s)
    jg, sg = m.load("join", [], 1), m.load("state", [], 1)
    with m.cond:
        assert m.apply("join", jg, [join("a", 5)])
        assert m.apply("state", sg, [Event("put", kv(s.world_key(), world_doc, 10))])
        world = m.world
        assert world is not None and world.revision == 10
        assert m.absent(world) == set()  # b's and c's joins are merely not seen yet
        assert m.apply("join", jg, [join("b", 6), join("c", 7), gone("c", 8)])
        assert m.absent(world) == {"c"}  # seen deleted: gone, whatever the feed's revision
        assert m.apply("join", jg, [gone("b", 11)])
        assert m.absent(world) == {"b", "c"}
    # Caught up: what the join feed shows is believed, deleted or never seen.
    m2 = Mirror(s)
    m2.load("state", [kv(s.world_key(), world_doc, 10)], 10)
    jg2 = m2.load("join", [], 12)
    with m2.cond:
        assert m2.apply("join", jg2, [join("a", 13)])
        assert m2.absent(m2.world) == {"b", "c"}
    changes = world_changes(world=world, members=set(world.nodes), me="a",
                            live={"a"} | (set(world.nodes) - {"c"}), next_round=(),
                            still_joined=True, closed=False)  # fmt: skip
    assert changes == [Change("lost", ("c",))]


def test_build_world_takes_a_placement_only_when_it_is_a_permutation():
    old = World(run_id="r", round=1, members=tuple(Member(node=n, addr="h", port=1) for n in "abc"))
    joined = {n: (i, Member(node=n, addr=f"h-{n}", port=i)) for i, n in enumerate("abcd")}

    def build(arrange):
        world, _ = build_world(run_id="r", round_=2, previous=old, joined=joined, max_nodes=8,
                               arrange=arrange)  # fmt: skip
        return world

    told = []
    swap = lambda prev, order: (told.append((prev, order)), [order[1], order[0], *order[2:]])[1]  # noqa: E731
    world = build(swap)
    assert told == [(("a", "b", "c"), ("a", "b", "c", "d"))]
    assert world.nodes == ("b", "a", "c", "d") and world.master_addr == "h-b"
    assert build(lambda prev, order: ["a", "b", "c"]).nodes == ("a", "b", "c", "d")  # one short
    assert build(lambda prev, order: ["a", "a", "b", "c"]).nodes == ("a", "b", "c", "d")

    def broken(prev, order):
        raise ValueError("no layout for this world")

    assert build(broken).nodes == ("a", "b", "c", "d")  # a round closes all the same
    first, _ = build_world(run_id="r", round_=1, previous=None, joined=joined, max_nodes=8,
                           arrange=broken)  # fmt: skip
    assert first.nodes == ("a", "b", "c", "d")  # nothing held before the first world
