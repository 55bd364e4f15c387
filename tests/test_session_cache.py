"""The suite's own cache of shared references (tests/session_cache.py): computed once a
session, however many xdist workers ask at once, and never left half-written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from session_cache import once_per_session, session_dir

ASK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from session_cache import once_per_session

    def compute():
        with open(sys.argv[2], "a") as fh:
            fh.write("computed\\n")
        time.sleep(0.5)  # the others ask meanwhile
        return {1: 0.5, 2: [1.25]}

    print(once_per_session(sys.argv[1], "k", compute))
""")


def test_workers_asking_at_once_compute_once_and_all_read_the_same(tmp_path):
    base = tmp_path / "popen-gw0"
    base.mkdir()
    tests = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-c", ASK, str(base), str(tmp_path / "log"), tests],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert set(outs) == {"{'1': 0.5, '2': [1.25]}\n"}  # JSON-shaped for every caller
    assert (tmp_path / "log").read_text() == "computed\n"
    assert session_dir(base / "test_x0") == tmp_path
    assert (tmp_path / "session-cache" / "k.json").exists()


def test_a_failed_compute_leaves_nothing_and_the_next_caller_computes(tmp_path):
    base = tmp_path / "popen-gw1"  # not the session's own directory
    base.mkdir()

    def fail():
        raise RuntimeError("the reference run failed")

    with pytest.raises(RuntimeError):
        once_per_session(base, "k", fail)
    assert not list((tmp_path / "session-cache").glob("k.*json"))
    assert once_per_session(base, "k", lambda: [1]) == [1]
    assert once_per_session(base, "k", lambda: [2]) == [1]  # kept for the session


def test_a_kept_value_that_is_not_enough_is_computed_again_and_replaced(tmp_path):
    """A reference of fewer steps than a caller needs: that caller trains its own, and
    the callers after it are served by the longer one."""
    base = tmp_path / "popen-gw0"
    base.mkdir()

    def upto(n: int) -> dict[int, float]:
        return {s: 1.0 / s for s in range(1, n + 1)}

    def enough(n: int):
        return lambda kept: str(n) in kept

    assert once_per_session(base, "k", lambda: upto(4), enough(4)) == {
        str(s): 1.0 / s for s in range(1, 5)
    }
    assert len(once_per_session(base, "k", lambda: upto(8), enough(2))) == 4  # kept: enough
    assert len(once_per_session(base, "k", lambda: upto(8), enough(6))) == 8  # computed again
    assert len(once_per_session(base, "k", lambda: upto(16), enough(5))) == 8  # the longer one kept
