"""The layout engine: exact Megatron groups, partitions, orthogonality, planning for elasticity."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from elasticd.errors import LayoutError
from elasticd.layout import (
    GROUP_KINDS,
    Layout,
    ParallelConfig,
    keep_shards,
    masked_orthogonal_groups,
    plan,
    plan_world,
    rank_coordinates,
    shard_signature,
)


def lists(groups):
    return [list(g) for g in groups]


def test_seed_001_example_tp2_pp4_on_16_ranks_gives_megatrons_groups():
    layout = plan_world(16, ParallelConfig(tp=2, pp=4))
    g = layout.groups
    assert layout.dp == 2
    assert lists(g["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lists(g["pp"]) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lists(g["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lists(g["tp-pp"]) == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert lists(g["embedding"]) == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert lists(g["position-embedding"]) == [[0], [1], [2], [3]]


def test_corrected_tp4_pp2_dp2_example_follows_the_algorithm_not_the_seed_listing():
    layout = plan_world(16, ParallelConfig(tp=4, pp=2))
    g = layout.groups
    assert lists(g["tp"]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # Seed 000 wrongly lists [0,4,8,12] and [0..7]; DESIGN.md gives these.
    assert lists(g["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert lists(g["pp"]) == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert lists(g["tp-dp-cp"]) == [list(range(8)), list(range(8, 16))]


def test_expert_groups_use_etp_and_fold_ep_inside_the_data_parallel_ranks():
    layout = plan_world(8, ParallelConfig(tp=2, ep=2))
    g = layout.groups
    assert lists(g["expert-tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists(g["expert-ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists(g["expert-tp-ep"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists(g["expert-dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # etp=1 with tp=2: experts are not tensor-split, so ep runs over consecutive ranks.
    layout = plan_world(8, ParallelConfig(tp=2, ep=4, etp=1))
    assert lists(layout.groups["expert-ep"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists(layout.groups["expert-tp"]) == [[r] for r in range(8)]
    assert layout.expert_dp == 2


def test_context_parallel_groups_sit_between_tp_and_dp_in_the_default_order():
    layout = plan_world(8, ParallelConfig(tp=2, cp=2))
    g = layout.groups
    assert lists(g["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists(g["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists(g["dp-cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lists(g["tp-cp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_an_expert_grid_that_splits_pipelines_differently_is_refused():
    with pytest.raises(LayoutError, match="other pipeline groups"):
        plan_world(4, ParallelConfig(pp=2, cp=2, etp=2, order="tp-ep-dp-pp-cp"))


def test_a_custom_order_moves_the_fastest_axis():
    layout = plan_world(4, ParallelConfig(tp=2, order="dp-tp-cp-ep-pp"))
    assert lists(layout.groups["dp"]) == [[0, 1], [2, 3]]
    assert lists(layout.groups["tp"]) == [[0, 2], [1, 3]]


def test_the_mixed_radix_generator_enumerates_masked_axes_fastest_first():
    assert lists(masked_orthogonal_groups([2, 3], [False, True])) == [[0, 2, 4], [1, 3, 5]]
    assert lists(masked_orthogonal_groups([2, 3], [True, True])) == [[0, 1, 2, 3, 4, 5]]


# ------------------------------------------------------------------------------ planning


def test_a_world_that_is_not_a_multiple_of_the_model_size_leaves_spares():
    layout = plan_world(10, ParallelConfig(tp=2, pp=2), global_batch=16, micro_batch=1)
    assert (layout.active, layout.spares, layout.dp, layout.grad_accum) == (8, (8, 9), 2, 8)
    assert layout.is_spare(9) and not layout.is_spare(7)
    assert layout.group_of("tp", 9) is None


def test_a_global_batch_that_does_not_split_shrinks_the_active_world():
    layout = plan_world(3, ParallelConfig(), global_batch=16, micro_batch=2)
    assert (layout.active, layout.dp, layout.grad_accum, layout.spares) == (2, 2, 4, (2,))
    layout = plan_world(3, ParallelConfig(), global_batch=12, micro_batch=2)
    assert (layout.active, layout.dp, layout.grad_accum) == (3, 3, 2)


def test_interleaving_needs_a_multiple_of_pp_micro_batches():
    layout = plan_world(8, ParallelConfig(pp=2, vpp=2), global_batch=8, micro_batch=1)
    assert layout.grad_accum % 2 == 0
    assert (layout.active, layout.grad_accum) == (8, 2)
    with pytest.raises(LayoutError, match="multiple of pp"):
        plan_world(2, ParallelConfig(pp=2, vpp=2), global_batch=3, micro_batch=1)


def test_global_batch_is_constant_across_worlds():
    p = ParallelConfig(tp=2)
    for world in range(2, 17):
        layout = plan_world(world, p, global_batch=48, micro_batch=2)
        assert layout.micro_batch * layout.grad_accum * layout.dp == 48


@pytest.mark.parametrize(
    ("world", "parallel", "batch", "message"),
    [
        (3, ParallelConfig(tp=4), None, "smaller than tp·pp·cp = 4"),
        (4, ParallelConfig(ep=2), (3, 1), "no layout fits a world of 4"),
        (4, ParallelConfig(), (5, 2), "not a multiple of train.micro_batch"),
        (100_000_000, ParallelConfig(), None, "more than the 131072 elasticd plans for"),
    ],
)
def test_when_no_layout_fits_the_error_says_why(world, parallel, batch, message):
    gb, mb = batch or (None, None)
    with pytest.raises(LayoutError, match=message):
        plan_world(world, parallel, global_batch=gb, micro_batch=mb)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "parallel.tp: 0 must be a positive integer"),
        ({"pp": True}, "parallel.pp: True must be a positive integer"),
        ({"order": "tp-pp"}, "parallel.order"),
        ({"order": "tp-tp-ep-dp-pp"}, "parallel.order"),
        ({"vpp": 2}, "parallel.vpp: 2 needs parallel.pp > 1"),
        ({"etp": -1}, "parallel.etp"),
    ],
)
def test_parallel_config_rejects_bad_sizes_with_the_field_name(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelConfig(**kwargs)


def test_a_layout_survives_a_round_trip_through_json():
    import json

    layout = plan_world(12, ParallelConfig(tp=2, pp=2, vpp=2, ep=1), global_batch=12, micro_batch=1)
    again = Layout.from_dict(json.loads(layout.to_json()))
    assert again == layout
    assert rank_coordinates(again, 5) == {"tp": 1, "cp": 0, "dp": 2, "pp": 0, "ep": 0}


# ------------------------------------------------------------------------- properties


@st.composite
def configs(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    order = "-".join(draw(st.permutations(["tp", "cp", "ep", "dp", "pp"])))
    # ep folds into dp·cp·tp/etp; pick etp and ep so that the expert grid divides the world.
    room = tp * cp * dp
    etp = draw(st.sampled_from([e for e in (1, 2, 4) if room % e == 0]))
    ep_choices = [e for e in (1, 2, 3, 4) if room % (etp * e) == 0]
    ep = draw(st.sampled_from(ep_choices))
    spare = draw(st.integers(0, tp * pp * cp - 1))
    vpp = 1 if pp == 1 else draw(st.sampled_from([1, 2]))
    parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, order=order)
    world = tp * pp * cp * dp + spare
    try:
        plan_world(world, parallel)
    except LayoutError as exc:
        # Only expert grids that split pipelines differently are refused here.
        assert "other pipeline groups" in str(exc)
        assume(False)
    return parallel, world


def expected_size(kind: str, layout: Layout) -> int:
    p = layout.parallel
    sizes = {
        "tp": p.tp,
        "pp": p.pp,
        "dp": layout.dp,
        "cp": p.cp,
        "dp-cp": layout.dp * p.cp,
        "tp-pp": p.tp * p.pp,
        "tp-cp": p.tp * p.cp,
        "tp-dp-cp": p.tp * layout.dp * p.cp,
        "expert-ep": p.ep,
        "expert-tp": p.expert_tp,
        "expert-tp-ep": p.expert_tp * p.ep,
        "expert-dp": layout.expert_dp,
        "expert-tp-ep-pp": p.expert_tp * p.ep * p.pp,
        "embedding": 2 if p.pp > 1 else 1,
        "position-embedding": 1,
    }
    return sizes[kind]


PARTITIONING = [k for k in GROUP_KINDS if k not in ("embedding", "position-embedding")]


@settings(max_examples=150, deadline=None)
@given(configs())
def test_every_group_kind_partitions_the_active_ranks_with_the_right_sizes(case):
    parallel, world = case
    layout = plan_world(world, parallel)
    active = set(range(layout.active))
    assert layout.active + len(layout.spares) == world
    for kind in GROUP_KINDS:
        groups = layout.groups[kind]
        assert all(len(g) == expected_size(kind, layout) for g in groups), kind
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members)), kind
        if kind in PARTITIONING:
            assert set(members) == active, kind
        else:
            assert set(members) <= active


ORTHOGONAL = [("tp", "dp"), ("tp", "pp"), ("dp", "pp"), ("tp", "cp"), ("cp", "dp"), ("cp", "pp")]
EXPERT_ORTHOGONAL = [
    ("expert-tp", "expert-ep"),
    ("expert-ep", "expert-dp"),
    ("expert-tp", "expert-dp"),
]


@settings(max_examples=150, deadline=None)
@given(configs())
def test_groups_of_orthogonal_kinds_meet_in_at_most_one_rank(case):
    parallel, world = case
    layout = plan_world(world, parallel)
    for a, b in [*ORTHOGONAL, *EXPERT_ORTHOGONAL, ("pp", "expert-tp-ep")]:
        for ga, gb in itertools.product(layout.groups[a], layout.groups[b]):
            assert len(set(ga) & set(gb)) <= 1, (a, b, ga, gb)


@settings(max_examples=100, deadline=None)
@given(configs())
def test_composite_kinds_are_unions_of_their_parts(case):
    parallel, world = case
    layout = plan_world(world, parallel)
    for rank in range(layout.active):
        tp_dp_cp = set(layout.group_of("tp-dp-cp", rank))
        assert set(layout.group_of("tp", rank)) <= tp_dp_cp
        assert set(layout.group_of("dp-cp", rank)) <= tp_dp_cp
        assert set(layout.group_of("dp", rank)) <= set(layout.group_of("dp-cp", rank))
        assert set(layout.group_of("expert-ep", rank)) <= set(layout.group_of("expert-tp-ep", rank))
        # A whole pipeline of model replicas is the tp-pp group.
        assert set(layout.group_of("pp", rank)) <= set(layout.group_of("tp-pp", rank))


@settings(max_examples=100, deadline=None)
@given(configs(), st.integers(1, 8), st.integers(1, 64))
def test_planning_is_deterministic_and_keeps_the_global_batch(case, micro, multiple):
    parallel, world = case
    global_batch = micro * multiple
    try:
        a = plan_world(world, parallel, global_batch=global_batch, micro_batch=micro)
    except LayoutError:
        return
    b = plan_world(world, parallel, global_batch=global_batch, micro_batch=micro)
    assert a == b
    assert a.micro_batch * a.grad_accum * a.dp == global_batch
    # No larger active count would have worked.
    p = parallel
    for bigger in range(a.active + 1, world + 1):
        dp, rest = divmod(bigger, p.model_size)
        if rest:
            continue
        accum, uneven = divmod(global_batch, micro * dp)
        assert (
            bigger % (p.expert_tp * p.ep * p.pp) != 0
            or uneven != 0
            or (p.vpp > 1 and accum % p.pp != 0)
        ), bigger


# -- placement of a re-formed world: survivors keep what they hold ---------------------------


def _job(parallel: dict, *, nproc: int = 1, batch: int = 12, **model):
    from elasticd.jobspec import parse_job

    return parse_job({
        "name": "place", "output_dir": "/nonexistent", "nproc_per_node": nproc,
        "nodes": {"min": 8, "max": 16}, "parallel": parallel,
        "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 256,
                  "seq_len": 32, **model},
        "train": {"steps": 4, "global_batch": batch, "micro_batch": 1},
    })  # fmt: skip


def _held(job, nodes: list[str], *, nproc: int) -> dict[str, tuple]:
    layout = plan(len(nodes) * nproc, job)
    return {n: tuple(shard_signature(layout, i * nproc + k) for k in range(nproc))
            for i, n in enumerate(nodes)}  # fmt: skip


@pytest.mark.parametrize(
    ("parallel", "nproc", "model", "previous", "order", "expected"),
    [
        # tp2 x dp2 loses rank 0's node: replica 1's tp0 (c) becomes rank 0, b keeps tp1,
        # d (replica 1's tp1) is the spare. Plain order: b, c, d took tp0, tp1, spare.
        ({"tp": 2}, 1, {}, "abcd", "bcd", "cbd"),
        ({"tp": 2}, 1, {}, "abcd", "abd", "abd"),  # nothing moves anyway
        # tp2 x dp2 + a spare (e) loses b (tp1 of replica 0). With ZeRO-1 c and d keep
        # their exact places (the dp index too, which the rows follow) and the spare takes
        # b's; without, d (the first tp1 holder) takes b's and e fills in.
        ({"tp": 2, "zero": 1}, 1, {}, "abcde", "acde", "aecd"),
        ({"tp": 2}, 1, {}, "abcde", "acde", "adce"),
        # ZeRO-1, dp6 + a spare node (d) loses a: still dp6, so b and c keep their rows
        # (the dp index too) and d takes a's.
        ({"zero": 1}, 2, {}, "abcd", "bcd", "dbc"),
        # ZeRO-1 where the dp size changes: no rank keeps its rows, and the plain order
        # keeps the most in place (dp3 → dp2: 1/2 of them, against 1/6 swapped).
        ({"zero": 1}, 1, {}, "abc", "bc", "bc"),
        ({"zero": 1}, 2, {}, "abc", "bc", "bc"),
        ({"tp": 2, "zero": 1}, 1, {}, "abcdef", "cdef", "cdef"),
        # Data parallelism alone: every node holds the same; the order stays.
        ({}, 1, {}, "abc", "ac", "ac"),
        ({}, 2, {}, "abc", "bc", "bc"),
        # pp2 x dp2 loses stage 0 of replica 0 (a): b is stage 0 of replica 1.
        ({"pp": 2}, 1, {}, "abcd", "bcd", "bcd"),
        # tp2 with two ranks a node and dp2 over 2 nodes: whole tp groups a node, kept.
        ({"tp": 2}, 2, {}, "abc", "bc", "bc"),
        # tp2 x ep2 (MoE, dp4, expert-dp2) on 8 nodes losing node 0: every survivor keeps
        # its tp index and expert shard.
        ({"tp": 2, "ep": 2}, 1, {"experts": 4, "top_k": 2}, "abcdefgh", "bcdefgh", None),
        # A newcomer joins: the survivors keep their places, the newcomer takes the rest.
        ({"tp": 2}, 1, {}, "ab", "abz", "abz"),
        ({"tp": 2}, 1, {}, "abcd", "bcdz", None),
    ],
)  # fmt: skip
def test_keep_shards_places_each_survivor_where_it_holds_the_same(
    parallel, nproc, model, previous, order, expected
):
    job = _job(parallel, nproc=nproc, **model)
    out = keep_shards(list(previous), list(order), nproc=nproc,
                      plan_for=lambda ranks: plan(ranks, job))  # fmt: skip
    assert sorted(out) == sorted(order)
    if expected is not None:
        assert "".join(out) == expected
    before, after = _held(job, list(previous), nproc=nproc), _held(job, out, nproc=nproc)
    kept = [n for n in out if n in before and before[n] == after[n]]
    plain = _held(job, list(order), nproc=nproc)
    kept_plain = [n for n in order if n in before and before[n] == plain[n]]
    assert len(kept) >= len(kept_plain)
    # Every position that some survivor could fill exactly is filled by one.
    for n in out:
        if n not in kept and all(s is not None for s in after[n]):
            assert not any(before.get(m) == after[n] for m in out if m not in kept), (n, out)


def test_keep_shards_changes_nothing_when_the_shards_differ_or_nothing_was_held():
    job = _job({"tp": 2})
    plan_for = lambda ranks: plan(ranks, job)  # noqa: E731
    assert keep_shards([], ["b", "a"], nproc=1, plan_for=plan_for) == ["b", "a"]
    other = _job({"tp": 4})
    mixed = lambda ranks: plan(ranks, job if ranks == 4 else other)  # noqa: E731
    assert keep_shards(list("abcd"), list("bcdefg"), nproc=1, plan_for=mixed) == list("bcdefg")
