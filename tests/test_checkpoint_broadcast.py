"""`load_latest(broadcast=True)` (`checkpoint.load_broadcast: true`): a region several ranks
hold alike is read from disk by one of them and sent to the others, on real gloo processes
and real files. The tensors loaded are the same as without it, and the bytes read halve
for dp2."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from test_checkpoint_multirank import Synth, _init, check_state, make_state, spawn

from checkpoint import SaveOptions, Saver, load_latest

STEP = 5


def _worker(rank, world, store, ckpt, saved, loads, out):
    group = _init(rank, world, store)
    results = []
    try:
        saver = Saver(ckpt, group=group, options=SaveOptions(async_=False, chunk_min_bytes=256))
        model, optim = make_state(saved, rank, STEP)
        saver.save(step=STEP, consumed_samples=1, model=model, optimizer=optim)
        saver.close()
        for lay in loads:
            for broadcast in (False, True):
                model, optim = make_state(lay, rank, STEP, fill=float("nan"))
                ck = load_latest(
                    ckpt, model=model, optimizer=optim, group=group, broadcast=broadcast
                )
                results.append(
                    {
                        "layout": repr(lay),
                        "broadcast": broadcast,
                        "wrong": check_state(model, optim, STEP),
                        "read": ck.stats.bytes_read,
                        "needed": ck.stats.bytes_needed,
                        "received": ck.stats.bytes_received,
                    }
                )
                ck.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(results))


def test_dp_replicas_read_once_and_load_the_same_tensors(tmp_path):
    # dp2 x tp2 resumes as saved, and as dp2 x tp2 with the experts split over ep2 (each dp
    # rank then holds experts no other rank holds: those it reads itself).
    same, ep2 = Synth(tp=2, dp=2), Synth(tp=2, dp=2, ep=2)
    results = spawn(_worker, 4, tmp_path, str(tmp_path / "ckpt"), same, [same, ep2])
    for per_rank in results:
        for r in per_rank:
            assert r["wrong"] == [], r
    totals = {}
    for i, (lay, broadcast) in enumerate([(same, False), (same, True), (ep2, False), (ep2, True)]):
        rows = [per_rank[i] for per_rank in results]
        assert {r["broadcast"] for r in rows} == {broadcast} and {r["layout"] for r in rows} == {
            repr(lay)
        }
        totals[(repr(lay), broadcast)] = {
            k: sum(r[k] for r in rows) for k in rows[0] if k in ("read", "needed", "received")
        }
    plain, shared = totals[(repr(same), False)], totals[(repr(same), True)]
    assert plain["received"] == 0
    # Every byte a rank needs was read by it or received; each was read once, not twice.
    assert shared["needed"] + shared["received"] == plain["needed"]
    # Half at most: a norm replicated over tp too is read by one rank of four.
    assert shared["needed"] * 2 <= plain["needed"]
    assert shared["read"] < 0.55 * plain["read"], (shared, plain)
    # With ep2 the experts are each dp rank's own: only the rest is shared.
    plain, shared = totals[(repr(ep2), False)], totals[(repr(ep2), True)]
    assert shared["needed"] + shared["received"] == plain["needed"]
    assert 0.55 * plain["read"] < shared["read"] < plain["read"], (shared, plain)


def test_the_job_setting_is_a_boolean_said_in_one_line():
    from elasticd.jobspec import JobSpecError, parse_job

    assert parse_job({"name": "t"}).checkpoint.load_broadcast is False
    assert parse_job(
        {"name": "t", "checkpoint": {"load_broadcast": True}}
    ).checkpoint.load_broadcast
    try:
        parse_job({"name": "t", "checkpoint": {"load_broadcast": "yes"}})
    except JobSpecError as exc:
        assert str(exc) == "job.yaml: checkpoint.load_broadcast: 'yes' is not true or false"
    else:
        raise AssertionError("a string was taken for a boolean")
