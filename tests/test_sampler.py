"""ElasticBatchSampler: the samples of a step are the same whatever the world, and a round
that resumes at a step reads on from exactly there (pure logic: no process group)."""

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import elasticd.inprocess as ei
from elasticd.sampler import ElasticBatchSampler


def parts(size, batch, world, step, **kw):
    """Every rank's indices at ``step`` in a world of ``world``."""
    return [
        ElasticBatchSampler(size, batch, rank=r, world_size=world, **kw).indices(step)
        for r in range(world)
    ]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 12])
def test_a_steps_global_batch_is_the_same_in_any_world_and_the_ranks_parts_tile_it(
    world, drop_last
):
    whole = ElasticBatchSampler(50, 12, rank=0, world_size=1, drop_last=drop_last)
    for step in range(12):
        got = parts(50, 12, world, step, drop_last=drop_last)
        assert [i for p in got for i in p] == whole.global_indices(step), (world, step)
        sizes = [len(p) for p in got]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes


def test_drop_last_takes_each_epochs_samples_once_and_leaves_its_shuffled_remainder():
    s = ElasticBatchSampler(50, 12, rank=0, world_size=1, seed=3)
    assert s.steps_per_epoch == 4
    for epoch in range(3):
        seen = [i for step in range(4 * epoch, 4 * epoch + 4) for i in s.global_indices(step)]
        assert len(seen) == len(set(seen)) == 48, epoch
        assert s.epoch(4 * epoch + 3) == epoch
    e0 = s.global_indices(0) + s.global_indices(1)
    e1 = s.global_indices(4) + s.global_indices(5)
    assert e0 != e1  # each epoch shuffled anew
    assert s.global_indices(0) == ElasticBatchSampler(
        50, 12, rank=0, world_size=1, seed=3
    ).global_indices(0)
    assert s.global_indices(0) != ElasticBatchSampler(
        50, 12, rank=0, world_size=1, seed=4
    ).global_indices(0)


def test_without_drop_last_the_stream_uses_every_sample_once_per_epoch_across_batch_edges():
    s = ElasticBatchSampler(50, 12, rank=0, world_size=1, drop_last=False, seed=1)
    stream = [i for step in range(25) for i in s.global_indices(step)]  # 300 = 6 epochs
    for epoch in range(6):
        assert sorted(stream[50 * epoch : 50 * (epoch + 1)]) == list(range(50)), epoch
    assert s.epoch(4) == 0 and s.epoch(5) == 1  # step 4 takes samples 48..59: 48, 49 of epoch 0
    plain = ElasticBatchSampler(5, 3, rank=0, world_size=1, drop_last=False, shuffle=False)
    assert [plain.global_indices(k) for k in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_a_round_that_resumes_at_a_step_reads_on_from_exactly_there_in_its_new_world():
    """dp3 for 5 steps, then dp2 from step 5: each step's samples, over both worlds, are
    those of one process for the same steps."""
    one = list(ElasticBatchSampler(40, 6, rank=0, world_size=1, steps=10))
    first = [list(ElasticBatchSampler(40, 6, rank=r, world_size=3, steps=5)) for r in range(3)]
    second = [
        list(ElasticBatchSampler(40, 6, step=5, rank=r, world_size=2, steps=10)) for r in range(2)
    ]
    merged = [[i for r in range(3) for i in first[r][k]] for k in range(5)]
    merged += [[i for r in range(2) for i in second[r][k]] for k in range(5)]
    assert merged == one
    assert len(ElasticBatchSampler(40, 6, step=5, rank=0, world_size=2, steps=10)) == 5


def test_an_uneven_split_is_weighted_back_to_the_batchs_mean_by_share():
    """5 ranks on a batch of 12: parts of 3, 3, 2, 2, 2; each rank's mean loss times its
    share, averaged over the ranks as DDP does, is the mean over the whole batch."""
    losses = torch.arange(12, dtype=torch.float64) ** 2
    means = []
    for r in range(5):
        s = ElasticBatchSampler(12, 12, rank=r, world_size=5, shuffle=False)
        start, end = s.bounds()
        means.append(losses[start:end].mean() * s.share())
    assert torch.stack(means).mean().item() == pytest.approx(losses.mean().item(), rel=1e-12)
    assert ElasticBatchSampler(12, 12, rank=1, world_size=4).share() == 1.0


def test_it_is_a_dataloaders_batch_sampler_and_leaves_the_global_generator_alone():
    data = TensorDataset(torch.arange(30.0))
    make = lambda: ElasticBatchSampler(data, 6, step=2, steps=5, rank=1, world_size=2)  # noqa: E731
    state = torch.get_rng_state()
    drawn = list(make())  # (a DataLoader's iterator draws a base seed from it: not ours)
    assert torch.equal(torch.get_rng_state(), state)
    sampler = make()
    got = [batch[0].tolist() for batch in DataLoader(data, batch_sampler=sampler)]
    assert drawn == [[int(i) for i in g] for g in got]
    assert got == [[float(i) for i in sampler.indices(k)] for k in range(2, 5)]
    assert all(len(g) == 3 for g in got) and len(sampler) == 3
    endless = iter(ElasticBatchSampler(data, 6, rank=0, world_size=1))
    assert len([next(endless) for _ in range(12)]) == 12  # past the epoch: the next one
    with pytest.raises(ei.MisuseError, match="endless and has no len"):
        len(ElasticBatchSampler(data, 6, rank=0, world_size=1))


def test_an_epoch_loop_with_set_epoch_takes_the_streams_steps_resumed_mid_epoch():
    """A DistributedSampler's loop (set_epoch, then the epoch's batches), resumed at step
    10 (mid-epoch 2 of 4-step epochs): the rest of epoch 2, then each later epoch whole,
    the last cut at ``steps``: exactly the stream's steps 10 to 21."""
    stream = list(ElasticBatchSampler(50, 12, step=10, steps=22, rank=1, world_size=3))
    sampler = ElasticBatchSampler(50, 12, step=10, steps=22, rank=1, world_size=3)
    got, lens = [], []
    for epoch in range(sampler.epoch(10), 10):
        sampler.set_epoch(epoch)
        lens.append(len(sampler))
        got += list(sampler)
    assert got == stream and lens == [2, 4, 4, 2, 0, 0, 0, 0]
    loose = ElasticBatchSampler(50, 12, steps=9, rank=0, world_size=1, drop_last=False)
    spans = []
    for epoch in range(4):
        loose.set_epoch(epoch)
        spans.append(list(loose._span()))
    assert spans == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [], []]  # step 4 starts in epoch 0
    assert [loose.epoch(s) for s in range(9)] == [0] * 5 + [1] * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"size": 10, "global_batch": 0}, "global_batch must be at least 1, not 0"),
        ({"size": 10, "global_batch": 2.5}, "global_batch must be an int, not float"),
        ({"size": 0, "global_batch": 2}, "size (the dataset's length) must be at least 1"),
        (
            {"size": 10, "global_batch": 2, "world_size": 3, "rank": 0},
            "a world of 3 ranks is larger",
        ),
        (
            {"size": 10, "global_batch": 4, "world_size": 2, "rank": 2},
            "rank 2 is not below world_size 2",
        ),
        ({"size": 3, "global_batch": 4}, "make no whole batch of 4 (drop_last=True)"),
        ({"size": 10, "global_batch": 2, "step": 5, "steps": 4}, "steps must be at least 5, not 4"),
        ({"size": 10, "global_batch": 2, "step": -1}, "step must be at least 0"),
        ({"size": 10, "global_batch": 2, "step": True}, "step must be an int, not bool"),
    ],
)
def test_what_it_refuses_is_one_misuse_line(kwargs, message):
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("world_size", 1)
    size, batch = kwargs.pop("size"), kwargs.pop("global_batch")
    with pytest.raises(ei.MisuseError, match=r"^ElasticBatchSampler: ") as info:
        ElasticBatchSampler(size, batch, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_without_a_process_group_or_a_rank_it_says_what_to_pass():
    code = (
        "import elasticd.inprocess as ei\n"
        "try:\n    ei.ElasticBatchSampler(10, 2)\n"
        "except ei.MisuseError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "no process group: pass rank= and world_size=" in out.stdout, out


def test_a_second_iteration_that_would_train_steps_again_is_refused():
    """A plain script's ``for epoch ...: for batch in loader`` kept around one sampler
    without set_epoch read the same steps again each epoch (a review's job recorded 180
    steps of 100 and "succeeded"); now a step taken a second time is one MisuseError line,
    whether the stream again, an epoch again, or an epoch the stream already took."""
    sampler = ElasticBatchSampler(50, 12, steps=8, rank=0, world_size=1)
    assert len(list(sampler)) == 8
    with pytest.raises(ei.MisuseError, match=r"step 0 taken again \(steps up to 7 were\)"):
        list(sampler)
    sampler = ElasticBatchSampler(50, 12, steps=8, rank=0, world_size=1)
    sampler.set_epoch(0)
    list(sampler)
    with pytest.raises(ei.MisuseError, match="step 0 taken again"):
        list(sampler)
    sampler.set_epoch(1)
    assert len(list(sampler)) == 4
    stream_first = ElasticBatchSampler(50, 12, steps=8, rank=0, world_size=1)
    list(stream_first)
    stream_first.set_epoch(0)
    with pytest.raises(ei.MisuseError, match="step 0 taken again"):
        list(stream_first)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_with_worker_processes_takes_each_step_once(persistent):
    """A multi-worker DataLoader makes the batch sampler's iterator twice and reads the
    second (torch 2.13): the first, unread, must not count as an iteration (a review found
    every num_workers > 0 loader refused). Persistent workers: one loader over two epochs."""
    data = TensorDataset(torch.arange(48.0))
    sampler = ElasticBatchSampler(data, 6, steps=16, rank=1, world_size=2)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=1,
                        persistent_workers=persistent, generator=torch.Generator())  # fmt: skip
    got = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        got += [batch[0].int().tolist() for batch in loader]
    want = list(ElasticBatchSampler(data, 6, steps=16, rank=1, world_size=2))
    assert got == want and len(got) == 16


def test_a_sampler_made_in_another_call_of_train_is_refused():
    """Made once and kept across rounds (or at module level), it still held the first
    round's rank, world and first step: after a kill the survivors read their 3-rank
    slices (a third of each batch never read) from step 0 again, and the job "succeeded".
    ``elasticd.inprocess.run`` marks each call of the training function: a sampler made
    in one call (or outside any) yields nothing in another, kept iterators included."""
    from elasticd.sampler import train_call

    with train_call():
        sampler = ElasticBatchSampler(50, 12, steps=8, rank=0, world_size=3)
        kept = iter(sampler)
        assert len(next(kept)) == 4
    said = r"made in call \d+ of the training function, iterated in call \d+: .* anew each round"
    with train_call(), pytest.raises(ei.MisuseError, match=said):
        next(kept)
    outside = ElasticBatchSampler(50, 12, steps=8, rank=0, world_size=3)
    assert len(list(outside)) == 8  # no training function at all: a plain script
    outside = ElasticBatchSampler(50, 12, steps=8, rank=0, world_size=3)
    with (
        train_call(),
        pytest.raises(
            ei.MisuseError, match="made outside any call of the training function, iterated in call"
        ),
    ):
        list(outside)


def naive(size, batch, step, shuffle, seed, drop_last):
    """A step's global batch from an explicit stream of whole epochs."""
    from elasticd.sampler import SEED_STRIDE

    def order(e):
        if not shuffle:
            return list(range(size))
        gen = torch.Generator().manual_seed(seed * SEED_STRIDE + e)
        return torch.randperm(size, generator=gen).tolist()

    if drop_last:
        e, at = divmod(step, size // batch)
        return order(e)[at * batch : (at + 1) * batch]
    stream = [i for e in range((step + 1) * batch // size + 1) for i in order(e)]
    return stream[step * batch : (step + 1) * batch]


def test_every_small_case_matches_an_explicit_stream_of_epochs():
    for size in range(1, 10):
        for batch in range(1, 10):
            for drop_last in (True, False):
                if drop_last and size < batch:
                    continue
                for world in sorted({1, 2, 3, batch} & set(range(1, batch + 1))):
                    for step in range(12):
                        want = naive(size, batch, step, True, 7, drop_last)
                        got = parts(size, batch, world, step, seed=7, drop_last=drop_last)
                        assert [i for p in got for i in p] == want, (size, batch, world, step)
    plain = ElasticBatchSampler(7, 3, rank=0, world_size=1, shuffle=False, drop_last=False)
    got = [plain.global_indices(k) for k in range(4)]
    assert got == [naive(7, 3, k, False, 0, False) for k in range(4)]
