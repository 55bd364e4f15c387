"""Token sources and the global sample arithmetic; `elasticd data prepare` on real files."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.cli import main as elasticd_main
from trainer.data import BatchPlan, SyntheticSource, TokenFile, micro_batches, read_header
from trainer.errors import DataError


@settings(max_examples=200, deadline=None)
@given(
    dp=st.integers(1, 8), mb=st.integers(1, 4), accum=st.integers(1, 4),
    step=st.integers(0, 50),
)  # fmt: skip
def test_each_step_consumes_exactly_its_global_range_whatever_the_layout(dp, mb, accum, step):
    gb = dp * mb * accum
    consumed = step * gb
    seen = []
    for rank in range(dp):
        plan = BatchPlan(global_batch=gb, micro_batch=mb, dp=dp, dp_rank=rank)
        assert plan.grad_accum == accum
        for r in plan.micro_batch_indices(consumed):
            assert len(r) == mb and r.start % mb == 0  # micro-batches never straddle
            seen += list(r)
    assert seen == list(range(step * gb, (step + 1) * gb))


def test_synthetic_samples_are_deterministic_and_predictable_after_two_tokens() -> None:
    a = SyntheticSource(seed=3, vocab=50, seq_len=16)
    b = SyntheticSource(seed=3, vocab=50, seq_len=16)
    for i in (0, 1, 999):
        s = a.sample(i)
        assert s.shape == (17,) and s.dtype == torch.int64
        assert torch.equal(s, b.sample(i))
        assert int(s.min()) >= 0 and int(s.max()) < 50
        stride = (s[1] - s[0]) % 50
        assert torch.equal((s[1:] - s[:-1]) % 50, torch.full((16,), int(stride)))
    assert not torch.equal(a.sample(0), SyntheticSource(seed=4, vocab=50, seq_len=16).sample(0))


def test_micro_batches_pair_inputs_with_next_token_targets() -> None:
    src = SyntheticSource(seed=1, vocab=256, seq_len=8)
    plan = BatchPlan(global_batch=8, micro_batch=2, dp=2, dp_rank=1)
    batches = list(micro_batches(src, plan, consumed_samples=16))
    assert len(batches) == 2
    x, y = batches[1]
    assert x.shape == y.shape == (2, 8)
    # rank 1 of step 2: samples 20..23; its second micro-batch is 22, 23
    assert torch.equal(x[0], src.sample(22)[:-1]) and torch.equal(y[1], src.sample(23)[1:])


def test_data_prepare_writes_a_token_file_the_trainer_maps(tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello, world")
    (tmp_path / "b.txt").write_text("héllo again", encoding="utf-8")
    out = tmp_path / "tokens.bin"
    assert elasticd_main(["data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                          "-o", str(out)]) == 0  # fmt: skip
    assert "tokens" in capsys.readouterr().out
    header, offset = read_header(str(out))
    expected = b"hello, world\n" + "héllo again".encode()
    assert header["count"] == len(expected) and header["vocab"] == 256 and offset % 64 == 0
    tf = TokenFile(out, seq_len=4)
    assert tf.num_samples == (len(expected) - 1) // 4
    assert bytes(tf.sample(1).tolist()) == expected[4:9]
    assert torch.equal(tf.sample(tf.num_samples), tf.sample(0))  # wraps around


def test_data_prepare_reports_a_missing_input_in_one_line_with_exit_code_2(tmp_path, capsys):
    rc = elasticd_main(["data", "prepare", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2 and "nope.txt" in err and len(err.strip().splitlines()) == 1


def test_a_file_that_is_not_a_token_file_is_refused_by_name(tmp_path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not tokens at all, just text")
    with pytest.raises(DataError, match="bad magic"):
        TokenFile(bad, seq_len=4)
    with pytest.raises(DataError, match="no such token file"):
        TokenFile(tmp_path / "missing.bin", seq_len=4)
