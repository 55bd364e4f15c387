"""Pipeline schedules: every small (pp, vpp, m) runs to completion in simulation, with the
bubble and the activation peak that theory predicts, and bad sizes are refused clearly."""

from __future__ import annotations

import json
from fractions import Fraction
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.cli import main as cli_main
from trainer.parallel.schedule import (
    Action,
    Kind,
    Op,
    ScheduleError,
    all_stages,
    comm_batches,
    compute_order,
    layer_range,
    stage_actions,
    validate,
    virtual_stage,
)
from trainer.parallel.schedule_sim import run_stages, simulate


def _valid_sizes(kind: Kind):
    for pp in range(1, 9):
        for vpp in range(1, 5):
            for m in range(1, 33):
                try:
                    validate(pp=pp, vpp=vpp, microbatches=m, kind=kind)
                except ScheduleError:
                    continue
                yield pp, vpp, m


def _check_causal(result) -> None:
    """Independently of the simulator's own checks: slots never overlap on a stage, every
    (chunk, mb) runs F and B once, and data dependencies across stages hold in time."""
    pp, vpp, m = result.pp, result.vpp, result.microbatches
    n_virtual = pp * vpp
    f_end, b_end, b_start, f_start = {}, {}, {}, {}
    for s, row in enumerate(result.timeline):
        for a, b in pairwise(row):
            assert a.end <= b.start, (s, a, b)
        seen = [(x.action.op, x.action.chunk, x.action.microbatch) for x in row]
        assert sorted(seen) == sorted(
            (op, c, mb) for op in (Op.BACKWARD, Op.FORWARD) for c in range(vpp) for mb in range(m)
        )
        for x in row:
            v = virtual_stage(pp=pp, stage=s, chunk=x.action.chunk)
            key = (v, x.action.microbatch)
            if x.action.op is Op.FORWARD:
                f_start[key], f_end[key] = x.start, x.end
            else:
                b_start[key], b_end[key] = x.start, x.end
    for (v, mb), start in f_start.items():
        if v > 0:
            assert start >= f_end[(v - 1, mb)]
    for (v, mb), start in b_start.items():
        assert start >= f_end[(v, mb)], "a backward ran before its forward"
        if v < n_virtual - 1:
            assert start >= b_end[(v + 1, mb)]


def _peak_from_order(order: list[Action]) -> int:
    live, peak = 0, 0
    for act in order:
        live += 1 if act.op is Op.FORWARD else -1
        peak = max(peak, live)
    return peak


def test_every_1f1b_and_interleaved_schedule_up_to_pp8_vpp4_m32_runs_with_theory_bubble():
    checked = 0
    for pp, vpp, m in _valid_sizes(Kind.ONE_F_ONE_B):
        result = simulate(pp=pp, vpp=vpp, microbatches=m)  # raises on deadlock or mismatch
        _check_causal(result)
        assert result.bubble_fraction == Fraction(pp - 1, vpp * m), (pp, vpp, m)
        for s in range(pp):
            order = compute_order(pp=pp, vpp=vpp, microbatches=m, stage=s)
            assert result.peak_in_flight[s] == _peak_from_order(order)
            if vpp == 1:
                # The 1F1B bound: stage s holds at most pp − s micro-batches.
                assert result.peak_in_flight[s] == min(pp - s, m)
            else:
                # Megatron's interleaved warm-up, plus the forward of the first pair.
                assert result.peak_in_flight[s] == min(
                    2 * (pp - s - 1) + (vpp - 1) * pp + 1, m * vpp
                )
        checked += 1
    assert checked == 415  # 256 plain 1F1B + 159 interleaved sizes


def test_every_gpipe_schedule_up_to_pp8_m32_has_the_fill_drain_bubble_and_holds_all_batches():
    for pp, _, m in _valid_sizes(Kind.GPIPE):
        result = simulate(pp=pp, vpp=1, microbatches=m, kind="gpipe")
        _check_causal(result)
        assert result.bubble_fraction == Fraction(pp - 1, m)
        assert result.peak_in_flight == (m,) * pp


def test_every_send_is_matched_by_a_receive_of_the_same_tensor_in_fifo_order():
    for pp, vpp, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6), (5, 1, 7), (8, 4, 16)]:
        sent: dict[tuple[int, int], list] = {}
        got: dict[tuple[int, int], list] = {}
        for s, acts in enumerate(all_stages(pp=pp, vpp=vpp, microbatches=m)):
            for a in acts:
                v = virtual_stage(pp=pp, stage=s, chunk=a.chunk)
                if a.op is Op.SEND_ACT:
                    sent.setdefault((s, a.peer), []).append(("act", v + 1, a.microbatch))
                elif a.op is Op.SEND_GRAD:
                    sent.setdefault((s, a.peer), []).append(("grad", v - 1, a.microbatch))
                elif a.op is Op.RECV_ACT:
                    got.setdefault((a.peer, s), []).append(("act", v, a.microbatch))
                elif a.op is Op.RECV_GRAD:
                    got.setdefault((a.peer, s), []).append(("grad", v, a.microbatch))
        assert sent == got


def test_1f1b_places_each_forwards_send_in_one_batch_with_the_next_backwards_receive():
    acts = stage_actions(pp=4, vpp=1, microbatches=8, stage=1)
    items = comm_batches(acts)
    # Steady state: F(3); [send act 3, recv grad 0]; B(0); [send grad 0, recv act 4]; F(4)
    i = items.index(Action(op=Op.FORWARD, chunk=0, microbatch=2))
    assert [x.op for x in items[i + 1]] == [Op.SEND_ACT, Op.RECV_GRAD]
    assert items[i + 2] == Action(op=Op.BACKWARD, chunk=0, microbatch=0)
    assert [x.op for x in items[i + 3]] == [Op.SEND_GRAD, Op.RECV_ACT]


def test_posting_every_transfer_alone_deadlocks_1f1b_so_the_simulator_would_catch_it():
    stages = all_stages(pp=4, vpp=1, microbatches=8)
    alone = [[a if a.is_compute else [a] for a in acts] for acts in stages]
    with pytest.raises(ScheduleError, match="deadlock"):
        run_stages(alone, vpp=1, microbatches=8, kind=Kind.ONE_F_ONE_B)


def test_receiving_micro_batches_out_of_order_is_reported_as_a_mismatch():
    stages = [comm_batches(a) for a in all_stages(pp=2, vpp=1, microbatches=2)]
    first_two = [i for i, x in enumerate(stages[1]) if isinstance(x, list)][:2]
    swapped = list(stages[1])
    swapped[first_two[0]] = [
        Action(op=Op.RECV_ACT, chunk=0, microbatch=1, peer=0) if a.op is Op.RECV_ACT else a
        for a in swapped[first_two[0]]
    ]
    with pytest.raises(ScheduleError, match="expects"):
        run_stages([stages[0], swapped], vpp=1, microbatches=2, kind=Kind.ONE_F_ONE_B)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 0, "vpp": 1, "microbatches": 4}, "pp must be a positive integer"),
        ({"pp": 2, "vpp": 1, "microbatches": -1}, "microbatches must be a positive integer"),
        ({"pp": 2, "vpp": True, "microbatches": 4}, "vpp must be a positive integer"),
        ({"pp": 1, "vpp": 2, "microbatches": 4}, "needs pp > 1"),
        ({"pp": 4, "vpp": 2, "microbatches": 6}, r"multiple of pp \(4\)"),
        ({"pp": 2, "vpp": 2, "microbatches": 4, "kind": "gpipe"}, "one chunk per stage"),
        ({"pp": 2, "vpp": 1, "microbatches": 4, "kind": "zigzag"}, "unknown schedule kind"),
        ({"pp": 2, "vpp": 1, "microbatches": 4, "stage": 2}, r"stage must be in 0\.\.1"),
    ],
)
def test_impossible_schedule_sizes_are_refused_with_a_message_naming_the_argument(kwargs, message):
    kwargs = {"stage": 0, **kwargs}
    with pytest.raises(ScheduleError, match=message):
        stage_actions(**kwargs)


@given(
    pp=st.integers(1, 8),
    vpp=st.integers(1, 4),
    per=st.integers(1, 4),
)
def test_layer_placement_partitions_the_layers_in_virtual_stage_order(pp, vpp, per):
    layers = pp * vpp * per
    ranges = {
        virtual_stage(pp=pp, stage=s, chunk=c): layer_range(
            layers=layers, pp=pp, vpp=vpp, stage=s, chunk=c
        )
        for s in range(pp)
        for c in range(vpp)
    }
    flat = [i for v in sorted(ranges) for i in ranges[v]]
    assert flat == list(range(layers))


def test_layer_placement_follows_the_seed_example_of_16_layers_on_4_stages_with_vpp2():
    got = [list(layer_range(layers=16, pp=4, vpp=2, stage=0, chunk=c)) for c in range(2)]
    assert got == [[0, 1], [8, 9]]
    assert list(layer_range(layers=16, pp=4, vpp=2, stage=3, chunk=1)) == [14, 15]
    with pytest.raises(ScheduleError, match=r"divisible by pp·vpp \(6\)"):
        layer_range(layers=8, pp=3, vpp=2, stage=0, chunk=0)


def test_the_schedule_command_prints_the_timeline_and_the_bubble(capsys):
    assert cli_main(["schedule", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("stage 0: F0 F1 F2 F3 ..")
    assert lines[3].startswith("stage 3: .. .. .. F0 B0 B0 F1")
    assert "bubble fraction: 0.3750 = 3/8 (theory 3/8)" in out
    assert "4 3 2 1" in out


def test_the_schedule_command_prints_json_with_each_stages_compute_actions(capsys):
    assert cli_main(["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["pp"], doc["vpp"], doc["microbatches"]) == (2, 2, 2)
    # Fields in the text's order: F<microbatch>.<chunk>.
    assert [(a["op"], a["microbatch"], a["chunk"]) for a in doc["stages"][0]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("B", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0),
    ]  # fmt: skip
    assert list(doc["stages"][0][0]) == ["op", "microbatch", "chunk"]
    assert len(doc["stages"][1]) == 8


def test_the_schedule_text_has_a_legend(capsys):
    assert cli_main(["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "legend: F<m>.<c>: forward of micro-batch m on model chunk c" in out
    assert cli_main(["schedule", "--pp", "2", "--microbatches", "2"]) == 0
    assert (
        "legend: F<m>: forward of micro-batch m (one cell); B: its backward"
        in capsys.readouterr().out
    )


def test_the_schedule_command_turns_bad_sizes_into_one_line_and_exit_2(capsys):
    assert cli_main(["schedule", "--pp", "3", "--vpp", "2", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert "multiple of pp (3)" in err
    assert cli_main(["schedule", "--pp", "2", "--microbatches", "4", "--kind", "zz"]) == 2
