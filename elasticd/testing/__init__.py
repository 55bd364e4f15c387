"""Fault-injection tests of your own training script, with pytest (docs/testing.md).

Installing elasticd registers a pytest plugin (``elasticd.testing.plugin``) that gives
every test the ``elasticd_cluster`` fixture: a factory of local clusters, each a real
embedded etcd and N real ``elasticd agent`` processes in the test's own temporary
directory, torn down when the run ends (or the test fails, or times out)::

    def test_my_script_survives_a_dead_node(elasticd_cluster):
        job = elasticd_cluster.script_job("train.py", steps=20)
        result = elasticd_cluster.run(job, nodes=2, faults=["kill-node=1@step=5"])
        reference = elasticd_cluster.reference(job, nodes=2)   # cached per session
        result.assert_losses_match(reference)
        result.assert_worlds([2, 1])
        result.assert_recovered_within(60)

A script is any command that uses the worker-side API (``elasticd.worker.WorkerChannel``:
``record(step=..., loss=...)`` after each step, ``phase(...)`` where faults keyed to a phase
should land; ``elasticd.inprocess.run`` for in-process restart).

Nothing here imports torch: the plugin costs an unrelated test suite nothing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticd.errors import ElasticdError, UsageError
from elasticd.faultplan import InjectedFault
from elasticd.jobspec import run_logs_dir

DEFAULT_TIMEOUT = 300.0
"""Seconds a run may take (the ``elasticd`` marker's ``timeout`` overrides it)."""
RUN_OVERHEAD = 100.0
"""Seconds a run can take beyond its timeout (the agents registering, the cluster's
stop), kept out of what the test's own timeout leaves to its runs."""
MIN_RUN = 10.0
"""Fewer seconds left to a test than this, and its next run is refused at once."""

BUILTIN_JOB: dict[str, Any] = {
    "nodes": {"min": 1, "max": 8},
    "nproc_per_node": 1,
    "model": {"layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 256,
              "seq_len": 32},
    "train": {"steps": 20, "global_batch": 12, "micro_batch": 2},
    "checkpoint": {"every": 5},
    "rendezvous": {"ttl": 2, "settle": 1.0},
}  # fmt: skip
"""The built-in trainer's small GPT (seconds per run on a laptop CPU), the base of
:meth:`Cluster.builtin_job` and :meth:`Cluster.script_job`. A global batch of 12 splits
evenly over 1, 2, 3, 4 or 6 ranks."""

HANG_TIMEOUT = 30.0
"""``restart.hang_timeout`` of a dict job that plans a ``hang-worker`` fault and sets none:
the job default (300 s) equals a run's default timeout, so the hang was never detected in
time. Only then: a script's long step or save elsewhere is not cut short."""

STARTUP_TIMEOUT = 60.0
"""``restart.startup_timeout`` of a dict job that plans a ``hang-worker`` fault and sets
none: a built-in trainer's worker hung before its first step
(``hang-worker=0@step=1:phase=forward``) is judged by it, not by ``hang_timeout``, and the
job default (1800 s) outlasts any run."""

SPARE_RESTARTS = 2
"""A dict job that does not set ``restart.max_restarts`` gets two per fault and this many
more: a script that fails on its own (a NameError before its first step) fails the run in
a few restarts, not after the job default's 10, minutes later."""


ENV_TEST_BASE = "ELASTICD_TEST_BASE"
"""Set on every agent (and so every worker) of a test's runs: the test's directory. The
teardown finds what a run left running by it, whatever the process's command line."""


class ElasticdAssertionError(AssertionError):
    """A failed ``assert_*`` of a run: the message names what differs. ``result``: the run
    it is about, when there is one."""

    def __init__(self, message: str, result: RunResult | None = None) -> None:
        super().__init__(message)
        self.result = result


# -- the result ---------------------------------------------------------------------------------


FAILURES_SHOWN = 3
"""The last failures :meth:`RunResult.describe` names (each a worker's own error line)."""

UNFINISHED_SHOWN = 4
"""The ranks still running at a timeout whose logs :meth:`RunResult.describe` quotes."""
LOG_TAIL_LINES = 5
"""How many of their last log lines it quotes (those printed before the timeout)."""
LOG_TAIL_WIDTH = 160
"""Characters of each quoted line (a longer one is cut)."""
STACK_FRAMES = 12
"""How many frames of a rank's main thread, innermost first, it quotes from the stacks the
rank printed after the timeout (the built-in trainer prints them on SIGUSR1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """One recovery of the job: from the fault's detection to rank 0's next step."""

    round: int
    reason: str
    """What ended the previous round (peer_lost, worker_failed, collective_failed, ...)."""
    mode: str
    """``inprocess`` (the survivors' processes went on) or ``process`` (all restarted)."""
    source: str
    """Where the state came from: peers, replica, checkpoint or none."""
    lost_steps: int | None
    """Completed steps that had to be trained again; None when nobody could tell (a
    restarted agent that saw no step, a script that reported no ``lost_steps``):
    :attr:`RunResult.retrained` tells from metrics.jsonl."""
    seconds: float
    """From the failure's detection to rank 0's next step; after attempts that failed
    before their first step (a second fault during the recovery), from the first one's."""
    parts: Mapping[str, float]
    """The recovery's time split into its parts (failed_attempts, abort or stop,
    rendezvous, ...)."""
    attempts: int = 1
    """Recoveries this one took: 2 or more when earlier ones failed before their first
    step (they are not recoveries of their own)."""
    since_fault: float | None = None
    """From the fault the run injected that caused it to rank 0's next step: the time its
    detection took counts too (a frozen node's is about its lease's TTL, which
    :attr:`seconds` leaves out). The fault is the last one fired before the detection
    and after the recovery before it's, of a kind that fails something (not add-node);
    None without one, and for a scale-up (``reason`` ``scale_up``: an added node, a
    thawed one back), which no failure caused."""


@dataclass(kw_only=True)
class RunResult:
    """What one run on a local cluster did."""

    outcome: str
    """The job's final state: ``succeeded``, ``failed``, ``cancelled``; ``timed_out``
    when the run passed its timeout (the job was then cancelled)."""
    reason: str
    records: list[dict[str, Any]]
    """metrics.jsonl records of the run, the last record of each step, by step."""
    worlds: list[int]
    """The world sizes in order (nodes, not ranks, in each new world; consecutive repeats
    merged)."""
    recoveries: list[Recovery]
    faults: list[dict[str, Any]]
    """Each fault as fired: ``fault``, ``kind``, ``t``, ``detail`` (and ``end``)."""
    run_dir: str
    """The job's output dir: metrics.jsonl, logs/, ckpt/, cluster/ (agent logs, etcd)."""
    output: str
    """What the run printed (as ``elasticd run`` would)."""
    status: dict[str, Any] = field(default_factory=dict)
    """The job's final status record, with its ``history``."""
    run_id: str = ""
    """The run's id: its worker logs are under ``logs/<run_id>/``."""
    retrained: list[int] = field(default_factory=list)
    """Steps recorded more than once in metrics.jsonl: trained again after a roll back
    (:attr:`records` keeps the last record of each)."""
    unfinished: list[dict[str, Any]] = field(default_factory=list)
    """When the run timed out: the workers still running then, in rank order (``rank``,
    ``node``, ``pid``, ``log``: the file its output went to, ``size``: that file's size
    at the timeout)."""

    @property
    def unfired(self) -> list[dict[str, Any]]:
        """The faults that never fired or could not be applied when due (a kill of a node
        whose agent had exited, a rank no live worker had): ``detail`` says why."""
        return [f for f in self.faults if f.get("unfired") or f.get("skipped")]

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.records]

    @property
    def losses(self) -> dict[int, float]:
        return {int(r["step"]): float(r["loss"]) for r in self.records if "loss" in r}

    def logs(self) -> dict[str, str]:
        """Every worker log of the run: path under ``logs/<run_id>/`` -> its text."""
        out = {}
        root = run_logs_dir(self.run_dir, self.run_id)
        for dirpath, _, files in os.walk(root):
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
        return dict(sorted(out.items()))

    def rank_log(self, rank: int) -> str:
        """Everything global rank ``rank`` printed in the rounds that started it, in round
        order. (Warm workers of in-process jobs log per node and local rank, under
        ``warm/`` in :meth:`logs`: their rank can change from round to round.)"""

        def round_of(path: str) -> int:
            head = path.split(os.sep)[0]
            return int(head.split("-")[1]) if head.startswith("round-") else -1

        logs = self.logs()
        mine = [p for p in logs if os.path.basename(p) == f"rank-{rank}.log"]
        return "".join(logs[p] for p in sorted(mine, key=round_of))

    def describe(self) -> str:
        """A few lines for a failure message: outcome, worlds, faults, recoveries, and the
        last failures the agents recorded (a worker's own error: what a script raising at
        import, or a misspelt command, shows)."""
        lines = [f"outcome {self.outcome} ({self.reason}); worlds {self.worlds}; "
                 f"steps {self.steps[:1]}..{self.steps[-1:]} ({len(self.steps)} records); "
                 f"run dir {self.run_dir}"]  # fmt: skip
        if not self.records:
            lines.append("  no step was recorded (a script reports each step with "
                         "channel.record; the built-in trainer does)")  # fmt: skip
        if self.outcome == "timed_out":
            lines += self._unfinished_lines()
        lines += [f"  fault {f.get('fault')}: {f.get('detail')}" for f in self.faults]
        lines += [f"  recovery round {r.round}: {r.reason}, {r.mode} from {r.source}, "
                  f"{r.seconds:.2f} s"
                  + ("" if r.since_fault is None else f" ({r.since_fault:.2f} s from the fault)")
                  + ", lost "
                  f"{'unknown' if r.lost_steps is None else r.lost_steps}"
                  for r in self.recoveries]  # fmt: skip
        failures = [e for e in self.status.get("history", []) if e.get("kind") == "failure"]
        if len(failures) > FAILURES_SHOWN:
            lines.append(f"  ({len(failures) - FAILURES_SHOWN} earlier failures)")
        lines += [f"  failure round {e.get('round')} on {e.get('node')}: {e.get('reason')}: "
                  f"{e.get('detail', '')}" for e in failures[-FAILURES_SHOWN:]]  # fmt: skip
        return "\n".join(lines)

    def _unfinished_lines(self) -> list[str]:
        """Which ranks never finished, each with the last lines it printed before the
        timeout (where it hung, without a look through the run dir)."""
        if not self.unfinished:
            return ["  no worker was running at the timeout (the agents' logs: "
                    "cluster/agent-*.log)"]  # fmt: skip
        lines = []
        for w in self.unfinished[:UNFINISHED_SHOWN]:
            path, size = w.get("log"), int(w.get("size") or 0)
            tail, after = _log_tail(path, size)
            name = os.path.relpath(path, self.run_dir) if path else "?"
            lines.append(f"  rank {w['rank']} (node-{w['node']}) had not finished; the last "
                         f"lines of its log ({name}) before the timeout:")  # fmt: skip
            lines += [f"    | {line}" for line in tail] or ["    (it had printed nothing)"]
            stack = _main_stack(path, size) if after else None
            if stack:
                lines.append("    its main thread's stack, printed after the timeout "
                             "(innermost call first):")  # fmt: skip
                lines += [f"    | {line}" for line in stack]
            elif after:
                lines.append(f"    (the log goes on after the timeout: {after} bytes, "
                             "with no stack dump in them)")  # fmt: skip
        rest = [str(w["rank"]) for w in self.unfinished[UNFINISHED_SHOWN:]]
        if rest:
            lines.append(f"  ranks {', '.join(rest)} had not finished either")
        return lines

    # -- assertions (each also a module-level function) --------------------------------------

    def assert_succeeded(self) -> RunResult:
        __tracebackhide__ = True  # pytest: the caller's line, then the message
        if self.outcome != "succeeded":
            raise ElasticdAssertionError(f"the job did not succeed\n{self.describe()}")
        return self

    def assert_losses_match(
        self,
        reference: RunResult,
        *,
        after: int = 0,
        rtol: float = 1e-4,
        atol: float = 0.0,
        keys: Sequence[str] = ("loss",),
    ) -> RunResult:
        """Every step past ``after`` has ``keys`` within ``rtol``/``atol`` of the reference's
        same step; a step one run has and the other lacks is a difference too."""
        __tracebackhide__ = True  # pytest: the caller's line, then the message
        mine = {int(r["step"]): r for r in self.records}
        theirs = {int(r["step"]): r for r in reference.records}
        recorded = {k for r in (*self.records, *reference.records) for k in r}
        absent = [k for k in keys if k not in recorded]
        if absent:  # a misspelt key made a table of "-" rows that hid the mistake
            raise ElasticdAssertionError(
                f"keys: {', '.join(map(repr, absent))} in no record of either run (recorded: "
                f"{', '.join(sorted(recorded)) or 'nothing'})",
                self,
            )
        rows = []
        for step in sorted(set(mine) | set(theirs)):
            if step <= after:
                continue
            for key in keys:
                got = mine.get(step, {}).get(key)
                want = theirs.get(step, {}).get(key)
                if got is None and want is None:
                    continue  # recorded by neither (a key in no record is refused below)
                if got is None or want is None:
                    rows.append((step, key, got, want, math.inf))
                    continue
                diff = abs(float(got) - float(want))
                if not diff <= atol + rtol * abs(float(want)):  # also catches nan
                    rows.append((step, key, got, want, diff / max(abs(float(want)), 1e-30)))
        if rows:
            raise ElasticdAssertionError(
                f"{len(rows)} value(s) differ from the reference after step {after} "
                f"(rtol {rtol:g}, atol {atol:g}):\n{_table(rows)}\n"
                f"{_world_hint(mine, theirs, rows[0][0])}{self.describe()}"
            )
        return self

    def assert_recovered_within(self, seconds: float) -> RunResult:
        """At least one recovery, and every one took at most ``seconds``: from the fault
        that caused it (:attr:`Recovery.since_fault`, its detection included) where the
        run injected one, else from its detection."""
        __tracebackhide__ = True  # pytest: the caller's line, then the message
        if not self.recoveries:
            raise ElasticdAssertionError(f"the run recorded no recovery\n{self.describe()}")
        slow = [r for r in self.recoveries if not _took(r) <= seconds]
        if slow:
            lines = "\n".join(
                f"  round {r.round}: {_took(r):.2f} s "
                + (f"from the fault, {r.seconds:.2f} s from its detection "
                   if r.since_fault is not None else "")
                + f"({_parts(r.parts)})"
                for r in slow
            )  # fmt: skip
            raise ElasticdAssertionError(
                f"{len(slow)} recovery(ies) took longer than {seconds:g} s:\n{lines}\n"
                f"{self.describe()}"
            )
        return self

    def assert_no_lost_steps(self) -> RunResult:
        """No recovery trained a completed step again, and no step is missing: neither by
        the recoveries' own count (``lost_steps``) nor by metrics.jsonl (a step recorded
        twice was trained again, whatever the recovery said or could not say)."""
        __tracebackhide__ = True  # pytest: the caller's line, then the message
        lost = [r for r in self.recoveries if r.lost_steps]
        gaps = self._missing_steps()
        if lost or gaps or self.retrained:
            lines = [f"  round {r.round}: {r.lost_steps} step(s) lost ({r.mode} from {r.source})"
                     for r in lost]  # fmt: skip
            if self.retrained:
                lines.append(f"  steps trained again (recorded twice in metrics.jsonl): "
                             f"{_ranges(self.retrained)}")  # fmt: skip
            if gaps:
                lines.append(f"  steps missing from metrics.jsonl: {_ranges(gaps)}")
            raise ElasticdAssertionError("steps were lost:\n" + "\n".join(lines) + "\n"
                                         + self.describe())  # fmt: skip
        return self

    def _missing_steps(self) -> list[int]:
        """Steps below the last one recorded that metrics.jsonl lacks."""
        done = self.steps
        return sorted(set(range(1, (done[-1] if done else 0) + 1)) - set(done))

    def assert_lost_steps_at_most(self, steps: int) -> RunResult:
        """Every recovery lost at most ``steps`` completed steps, by its own count
        (``lost_steps``: the furthest step trained before it, less the step the script
        said it resumed from; a count nobody could tell is not judged) and by metrics.jsonl
        (at most ``steps`` steps recorded again per recovery), and no step is missing from
        metrics.jsonl. For a script that saves every ``steps`` steps and resumes from its
        latest save: a script that trains from step 0 again after a fault passes
        ``assert_losses_match`` (its steps come out the same, and each step's last record
        is compared), not this."""
        __tracebackhide__ = True  # pytest: the caller's line, then the message
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise UsageError(f"steps: {steps!r} must be a whole number of steps >= 0")
        over = [r for r in self.recoveries if r.lost_steps is not None and r.lost_steps > steps]
        again = len(self.retrained) > steps * len(self.recoveries)
        gaps = self._missing_steps()
        if over or again or gaps:
            lines = [f"  round {r.round}: {r.lost_steps} step(s) lost ({r.mode} from {r.source})"
                     for r in over]  # fmt: skip
            if again:
                lines.append(f"  steps trained again (recorded twice in metrics.jsonl), "
                             f"{len(self.retrained)} over {len(self.recoveries)} "
                             f"recovery(ies): {_ranges(self.retrained)}")  # fmt: skip
            if gaps:
                lines.append(f"  steps missing from metrics.jsonl: {_ranges(gaps)}")
            raise ElasticdAssertionError(f"more than {steps} step(s) lost:\n" + "\n".join(lines)
                                         + "\n" + self.describe())  # fmt: skip
        return self

    def assert_worlds(self, sizes: Sequence[int]) -> RunResult:
        """The world went through exactly these sizes, in order."""
        __tracebackhide__ = True  # pytest: the caller's line, then the message
        if list(sizes) != self.worlds:
            raise ElasticdAssertionError(
                f"worlds {self.worlds}, expected {list(sizes)}\n{self.describe()}"
            )
        return self


def _one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An error elasticd raises on purpose in ``fn`` (an ``ElasticdError``: a bad
    argument, a job spec field, a fault that can never apply) comes out as one line from
    the caller's own frame, as the CLI prints it: pytest shows the test's line and the
    message, not elasticd's frames (about 100 lines of its source before)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        __tracebackhide__ = True
        try:
            return fn(*args, **kw)
        except ElasticdError as exc:  # the same error, without elasticd's frames
            raise exc.with_traceback(None) from None

    return wrapper


def _fault_texts(faults: Any) -> list[str]:
    """``faults`` as a list of spec strings; anything else is a one-line UsageError."""
    texts = [faults] if isinstance(faults, str) else faults
    if not isinstance(texts, Iterable) or isinstance(texts, bytes | Mapping):
        raise UsageError(f"faults: {faults!r} must be a fault spec or a list of them")
    texts = list(texts)
    for text in texts:
        if not isinstance(text, str):
            raise UsageError(f"faults: {text!r} is not a fault spec (a string such as "
                             "'kill-node=1@step=5')")  # fmt: skip
    return texts


def _check_timeout(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
        raise UsageError(f"{name}: {value!r} must be a number of seconds > 0")


def _log_tail(path: str | None, size: int) -> tuple[list[str], int]:
    """The last :data:`LOG_TAIL_LINES` lines of the first ``size`` bytes of ``path``, each
    cut to :data:`LOG_TAIL_WIDTH` characters, and how many bytes the file has beyond them;
    an unreadable file is one line saying so."""
    if not path:
        return ["(its log could not be found)"], 0
    try:
        with open(path, "rb") as fh:
            start = max(0, size - 64 * 1024)  # plenty for a few lines
            fh.seek(start)
            data = fh.read(size - start)
            after = max(0, os.fstat(fh.fileno()).st_size - size)
    except OSError as exc:
        return [f"(its log cannot be read: {exc.strerror or exc})"], 0
    text = data.decode("utf-8", errors="replace")
    lines = [line.rstrip() for line in text.splitlines()]
    if start:
        lines = lines[1:]  # the first may be the end of a longer one
    while lines and not lines[-1]:
        lines.pop()
    cut = LOG_TAIL_WIDTH - 3
    return [line if len(line) <= LOG_TAIL_WIDTH else line[:cut] + "..."
            for line in lines[-LOG_TAIL_LINES:]], after  # fmt: skip


STACK_HEADS = ("Current thread 0x", "Thread 0x")
"""How faulthandler starts each thread's part of a dump of all threads."""


def _main_stack(path: str | None, size: int) -> list[str] | None:
    """The main thread's part of the first stack dump (faulthandler's, of every thread)
    that ``path`` got after its first ``size`` bytes: its header line, then at most
    :data:`STACK_FRAMES` frames, innermost first, and a line counting the rest; each line
    cut to :data:`LOG_TAIL_WIDTH` characters. None when there is no such dump.

    faulthandler walks the interpreter's threads newest first, so the main thread (the
    oldest) is the dump's last part, whichever thread took the signal."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            fh.seek(size)
            data = fh.read(1024 * 1024)  # a dump of a few dozen threads is far less
    except OSError:
        return None
    blocks: list[list[str]] = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.startswith(STACK_HEADS):
            blocks.append([line.rstrip()])
        elif blocks and line.startswith("  "):  # '  File "...", line N in f', '  <no Python frame>'
            blocks[-1].append(line.rstrip())
        elif blocks and line.strip():
            break  # the dump is over: the rank printed something else after it
    if not blocks:
        return None
    head, *frames = blocks[-1]
    shown = frames[:STACK_FRAMES]
    if len(frames) > len(shown):
        shown.append(f"  ({len(frames) - len(shown)} outer frames more)")
    if len(blocks) > 1:
        others = len(blocks) - 1
        shown.append(f"  ({others} other thread{'s' * (others > 1)} in the dump, in the log)")
    cut = LOG_TAIL_WIDTH - 3
    return [line if len(line) <= LOG_TAIL_WIDTH else line[:cut] + "..." for line in [head, *shown]]


def _table(rows: list[tuple[int, str, Any, Any, float]], limit: int = 20) -> str:
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{float(v):.8g}"

    lines = [f"  {'step':>6}  {'key':<10} {'got':>14} {'reference':>14} {'rel diff':>10}"]
    for step, key, got, want, rel in rows[:limit]:
        lines.append(f"  {step:>6}  {key:<10} {fmt(got):>14} {fmt(want):>14} {rel:>10.3g}")
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more")
    return "\n".join(lines)


def _parts(parts: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in parts.items())


def _ranges(steps: list[int]) -> str:
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)


def _world_hint(mine: Mapping[int, dict], theirs: Mapping[int, dict], step: int) -> str:
    """A line for a first difference at a step this run trained in a world of another size
    than the reference's, or ""."""
    got, want = mine.get(step, {}).get("world"), theirs.get(step, {}).get("world")
    if got is None or want is None or got == want:
        return ""
    return (f"The first difference, at step {step}, is in a world of {got} ranks (the "
            f"reference's: {want}). A value of one rank's, not one agreed over the ranks (a "
            f"loss recorded before its all-reduce), or a batch that depends on the world size "
            f"differs so.\n")  # fmt: skip


def assert_losses_match(result: RunResult, reference: RunResult, **kw: Any) -> None:
    __tracebackhide__ = True  # pytest: the caller's line, then the message
    result.assert_losses_match(reference, **kw)


def assert_recovered_within(result: RunResult, seconds: float) -> None:
    __tracebackhide__ = True  # pytest: the caller's line, then the message
    result.assert_recovered_within(seconds)


def assert_no_lost_steps(result: RunResult) -> None:
    __tracebackhide__ = True  # pytest: the caller's line, then the message
    result.assert_no_lost_steps()


def assert_lost_steps_at_most(result: RunResult, steps: int) -> None:
    __tracebackhide__ = True  # pytest: the caller's line, then the message
    result.assert_lost_steps_at_most(steps)


def assert_worlds(result: RunResult, sizes: Sequence[int]) -> None:
    __tracebackhide__ = True  # pytest: the caller's line, then the message
    result.assert_worlds(sizes)


def _took(r: Recovery) -> float:
    return r.seconds if r.since_fault is None else r.since_fault


NOT_FAILURES = frozenset({"add-node"})
"""Fault kinds that fail nothing: a recovery after one is not timed from it."""


def _since_faults(history: Sequence[Mapping[str, Any]], faults: Sequence[Any]) -> list:
    """For each recovery of ``history`` in order: seconds from the fault that caused it
    to its first step, or None (:attr:`Recovery.since_fault`). Every time is this
    machine's clock: the faults' ``t`` taken as they were fired, before they act, and the
    recoveries' ``detected_at``."""
    fired = sorted(float(f["t"]) for f in faults if isinstance(f, Mapping)
                   and f.get("t") is not None and not f.get("skipped")
                   and f.get("kind") not in NOT_FAILURES)  # fmt: skip
    out: list[float | None] = []
    after = float("-inf")  # the detection of the recovery before
    for e in history:
        if e.get("kind") != "recovery":
            continue
        seen = e.get("detected_at")
        if seen is None:
            out.append(None)
            continue
        seen = float(seen)
        # A scale-up (an added node, a thawed one back) is caused by no failure: an etcd
        # outage before it that re-formed nothing is not its cause.
        cause = [t for t in fired if after < t <= seen] if e.get("reason") != "scale_up" else []
        out.append(seen + float(e.get("seconds", 0.0)) - cause[-1] if cause else None)
        after = max(after, seen)
    return out


def result_from(final: Mapping[str, Any], *, run_dir: str, output: str) -> RunResult:
    """A RunResult from ``run_cluster``'s final record."""
    last: dict[int, dict[str, Any]] = {}
    again: set[int] = set()
    for rec in final.get("metrics", []):
        if "step" in rec:
            step = int(rec["step"])
            if step in last:
                again.add(step)
            last[step] = rec
    status = dict(final.get("status") or {})
    history = status.get("history") or []
    worlds: list[int] = []
    for e in history:
        if e.get("kind") == "world" and (not worlds or worlds[-1] != int(e["world"])):
            worlds.append(int(e["world"]))
    recoveries = [
        Recovery(round=int(e.get("round", 0)), reason=str(e.get("reason", "")),
                 mode=str(e.get("mode", "process")), source=str(e.get("source", "")),
                 lost_steps=None if e.get("lost_steps") is None else int(e["lost_steps"]),
                 seconds=float(e.get("seconds", 0.0)),
                 parts=dict(e.get("parts") or {}), attempts=int(e.get("attempts") or 1),
                 since_fault=since)
        for e, since in zip([e for e in history if e.get("kind") == "recovery"],
                            _since_faults(history, final.get("faults") or []), strict=True)
    ]  # fmt: skip
    outcome = "timed_out" if final.get("timed_out") else str(final.get("state", "unknown"))
    return RunResult(
        outcome=outcome, reason=str(final.get("reason", "")),
        records=[last[s] for s in sorted(last)], retrained=sorted(again), worlds=worlds,
        recoveries=recoveries,
        faults=list(final.get("faults", [])), run_dir=run_dir, output=output, status=status,
        run_id=str(final.get("run_id") or ""), unfinished=list(final.get("unfinished", [])),
    )  # fmt: skip


# -- the factory --------------------------------------------------------------------------------


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *head, last = dotted.split(".")
    for key in head:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UsageError(f"override {dotted}: {key} is not a section")
    node[last] = value


def _merge(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` into a copy of ``raw``: dotted keys (``"train.steps": 8``) or sections
    (``train={"steps": 8}``, merged key by key)."""
    out = copy.deepcopy(raw)
    for key, value in overrides.items():
        if "." not in key and isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            _set(out, key, value)
    return out


def _job_dict(job: Any) -> dict[str, Any]:
    """A job given as a dict, a JobSpec, or a path to a job.yaml/json -> a plain dict."""
    from elasticd.jobspec import JobSpec, load_job

    if isinstance(job, JobSpec):
        return job.to_dict()
    if isinstance(job, Mapping):
        return copy.deepcopy(dict(job))
    if isinstance(job, (str, os.PathLike)):
        return load_job(os.fspath(job)).to_dict()
    raise UsageError(f"job: expected a dict, a JobSpec or a path, not {type(job).__name__}")


def _names_steps(job: Any) -> bool:
    """Whether ``job`` as given names ``train.steps`` itself (a dict, or a job file that
    writes it) rather than leaving it to the default: a script job's faults are checked
    against it before the run. A JobSpec cannot say (its default looks like a choice)."""
    from elasticd.jobspec import JobSpec, load_raw

    if isinstance(job, JobSpec):
        return False
    raw = load_raw(os.fspath(job)) if isinstance(job, (str, os.PathLike)) else job
    train = raw.get("train") if isinstance(raw, Mapping) else None
    return isinstance(train, Mapping) and "steps" in train


@dataclass(kw_only=True)
class Cluster:
    """The ``elasticd_cluster`` fixture: runs jobs on fresh local clusters under ``base``."""

    base: str
    """This test's directory; each run gets ``run-<n>/`` under it."""
    timeout: float = DEFAULT_TIMEOUT
    references: dict[str, RunResult] = field(default_factory=dict)
    """Uninterrupted runs of this session, by job and cluster shape (shared by all tests)."""
    reference_base: str | None = None
    """Where reference runs live (a session directory); default under ``base``."""
    runs: list[RunResult] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every agent (and so every worker) of this fixture's runs."""
    deadline: float | None = None
    """``time.monotonic()`` by which this test's runs must be over: the plugin sets it
    from the test's own timeout (pytest-timeout's), less :data:`RUN_OVERHEAD`. A run's
    timeout is cut to what is left, so a test whose runs together overrun ends with the
    timed-out run's summary (the ranks still running, their last lines), not killed
    half-way by pytest-timeout."""
    _next: int = 0
    """The next run's number (its directory ``run-<n>``)."""

    @_one_line_errors
    def builtin_job(self, **overrides: Any) -> dict[str, Any]:
        """The built-in trainer's job (a small GPT), with ``overrides``: sections
        (``train={"steps": 8}``) or dotted keys (``**{"parallel.tp": 2}``)."""
        return _merge(BUILTIN_JOB, overrides)

    @_one_line_errors
    def script_job(
        self,
        script: str | os.PathLike[str],
        *args: str,
        steps: int = 20,
        python: str = sys.executable,
        **overrides: Any,
    ) -> dict[str, Any]:
        """A job running ``python script args...`` on every rank; ``train.steps`` is
        what the script should train (it reads it from ``ELASTICD_JOB_FILE`` if it wants):
        :meth:`run` refuses a fault past it."""
        path = os.path.abspath(os.fspath(script))
        if not os.path.isfile(path):
            where = "" if os.path.isabs(os.fspath(script)) else (
                f" (a relative path is taken from the current directory, {os.getcwd()}, "
                "not the test file's: os.path.join(os.path.dirname(__file__), ...) names "
                "one beside the test)"
            )  # fmt: skip
            raise UsageError(f"script_job: {script}: no such file{where}")
        raw = _merge(BUILTIN_JOB, {"command": [python, path, *args], "train.steps": steps})
        return _merge(raw, overrides)

    @_one_line_errors
    def run(
        self,
        job: Any,
        *,
        nodes: int = 1,
        nproc_per_node: int | None = None,
        restart: str | None = None,
        faults: Iterable[str] | str = (),
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        allow_unfired: bool = False,
    ) -> RunResult:
        """Run ``job`` (a dict, a JobSpec or a path) on a fresh cluster of ``nodes`` agents
        with ``nproc_per_node`` workers each, under ``restart`` (inprocess or process;
        default the job's), firing ``faults`` (``elasticd run --fault`` specs, which may
        name a phase). Returns when the job ends or ``timeout`` passes; the cluster is gone
        by then. A fault that never fired (no rank reached its step and phase) raises
        ElasticdAssertionError, unless ``allow_unfired``: a fault test whose fault missed
        proves nothing."""
        __tracebackhide__ = True  # pytest: an unfired fault's failure at the caller's line
        from elasticd.faultplan import worker_side
        from elasticd.jobspec import parse_job
        from elasticd.localcluster import (
            ETCD_MEMBER_FAULTS,
            FAULT_SYNTAX,
            TESTING_FAULT_SYNTAX,
            check_plan,
            parse_fault,
            run_cluster,
        )

        faults = _fault_texts(faults)
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise UsageError(f"nodes: {nodes!r} must be a whole number of agents >= 1")
        if timeout is not None:
            _check_timeout(timeout, "timeout")
        limit = self._limit(timeout)
        index = self._next
        self._next += 1  # a run that raises keeps its directory: the next gets another
        run_dir = os.path.join(self.base, f"run-{index}")
        raw = _job_dict(job)
        raw["name"] = name or f"{raw.get('name') or 'test'}-{index}"
        raw["output_dir"] = os.path.join(run_dir, "out")
        raw["checkpoint"] = {**(raw.get("checkpoint") or {}),
                             "dir": os.path.join(run_dir, "out", "ckpt")}  # fmt: skip
        if nproc_per_node is not None:
            raw["nproc_per_node"] = nproc_per_node
        if restart is not None:
            if restart not in ("inprocess", "process"):
                raise UsageError(f"restart: {restart!r} must be inprocess or process")
            raw["restart"] = {**(raw.get("restart") or {}), "mode": restart}
        given = raw.get("restart") or {}
        if isinstance(job, Mapping) and "max_restarts" not in given:
            raw["restart"] = {**given, "max_restarts": 2 * len(faults) + SPARE_RESTARTS}
        hangs = any(f.strip().startswith("hang-worker") for f in faults)
        if isinstance(job, Mapping) and hangs and "hang_timeout" not in given:
            raw["restart"] = {**(raw.get("restart") or {}), "hang_timeout": HANG_TIMEOUT}
        if isinstance(job, Mapping) and hangs and "startup_timeout" not in given:
            raw["restart"] = {**(raw.get("restart") or {}), "startup_timeout": STARTUP_TIMEOUT}
        # Relative paths of the job (data.path) are the caller's, as for `elasticd run`.
        spec = parse_job(raw, where=f"job {raw['name']}").with_paths_resolved(os.getcwd())
        for k, v in (env or {}).items():
            if not isinstance(k, str) or not isinstance(v, str | os.PathLike):
                raise UsageError(f"env[{k!r}]: {v!r}: names and values must be strings")
        try:  # the CLI's words for the CLI's flag; here the argument is faults=
            parsed = [parse_fault(f) for f in faults]
            for fault in parsed:
                if fault.kind in ETCD_MEMBER_FAULTS:
                    raise UsageError(
                        f"--fault {fault}: needs an etcd of 3 members; elasticd.testing runs "
                        "one (elasticd run --etcd-members 3 runs three)"
                    )
            check_plan(nodes_min=spec.nodes.min, nproc=spec.nproc_per_node, nodes=nodes,
                       faults=parsed, etcd_members=1, where=f"job {raw['name']}",
                       steps=spec.train.steps if spec.command is None else None,
                       restart_mode=spec.restart.mode,
                       nodes_start=spec.nodes.start)  # fmt: skip
        except UsageError as exc:
            said = str(exc).replace("--fault ", "faults: ", 1).replace("(--nodes)", "(nodes=)")
            # The syntax it lists, less the etcd member faults a one-member etcd refuses.
            said = said.replace(FAULT_SYNTAX, TESTING_FAULT_SYNTAX)
            raise UsageError(said) from None
        if spec.command is not None and _names_steps(job):
            # A script may train steps of its own, but this job says how many it trains: a
            # fault past them would be found, unfired, only once the whole run is over.
            for fault in parsed:
                if fault.step > spec.train.steps:
                    raise UsageError(
                        f"faults: {fault}: step {fault.step} is past the job's last step "
                        f"(train.steps: {spec.train.steps}; a script that trains more steps "
                        "than that: say how many, script_job(..., steps=N))"
                    )
                if fault.step == spec.train.steps and not worker_side(fault):
                    raise UsageError(
                        f"faults: {fault}: step {fault.step} is the job's last step "
                        f"(train.steps: {spec.train.steps}); the cluster fires a fault once "
                        "its step completed, when nothing is left to recover: pick an "
                        "earlier step, or a phase inside it (:phase=forward)"
                    )
        hang = spec.restart.hang_timeout
        startup = spec.restart.startup_timeout and max(spec.restart.startup_timeout, hang)
        for fault, text in zip(parsed, faults, strict=True):
            if fault.kind == "hang-worker" and hang >= limit:
                raise UsageError(
                    f"faults: {text}: a hung worker is found after restart.hang_timeout "
                    f"({hang:g} s), not within the run's timeout ({limit:g} s); lower "
                    "restart.hang_timeout or raise the timeout"
                )
            if fault.kind == "hang-worker" and fault.phase and fault.step <= 1:
                if spec.command is not None:  # restart.startup_timeout does not judge it
                    raise UsageError(
                        f"faults: {text}: a script's worker hung inside its first step is "
                        "never found (restart.startup_timeout judges only the built-in "
                        "trainer's workers); hang it at a later step"
                    )
                if not startup or startup >= limit:  # hung inside step 1: no step yet
                    after = f"after {startup:g} s" if startup else "never (it is 0)"
                    raise UsageError(
                        f"faults: {text}: a worker hung before its first step is found by "
                        f"restart.startup_timeout, {after}, not within the run's timeout "
                        f"({limit:g} s); lower restart.startup_timeout or raise the timeout"
                    )
        os.makedirs(spec.out_dir, exist_ok=True)
        out = io.StringIO()
        agents_env = {**os.environ, **self.env, **(env or {}), ENV_TEST_BASE: self.base}
        agents_env.setdefault("OMP_NUM_THREADS", "1")
        # A test's timeout (pytest-timeout) raises in here: SIGKILL, not a preemption that
        # waits up to 20 s for workers to save what the teardown deletes.
        final = run_cluster(spec, nodes=nodes, faults=parsed, timeout=limit, out=out,
                            env=agents_env, kill_on_error=True)  # fmt: skip
        result = result_from(final, run_dir=spec.out_dir, output=out.getvalue())
        self.runs.append(result)
        if result.unfired and not allow_unfired:
            # The summary's fault lines say why each one never fired: named once, there.
            names = ", ".join(str(f["fault"]) for f in result.unfired)
            raise ElasticdAssertionError(
                f"{len(result.unfired)} fault(s) never fired (pass allow_unfired=True if that "
                f"is what the test expects): {names}\n{result.describe()}",
                result,
            )
        return result

    def _limit(self, timeout: float | None) -> float:
        """A run's timeout: ``timeout`` (or the fixture's), cut to what the test has left."""
        limit = timeout or self.timeout
        if self.deadline is None:
            return limit
        left = self.deadline - time.monotonic()
        if left < MIN_RUN:
            raise UsageError(
                f"this test's timeout leaves {max(left, 0):.0f} s to its next run (each run "
                f"also needs up to {RUN_OVERHEAD:g} s to start and stop): raise "
                "@pytest.mark.elasticd(timeout=...)"
            )
        return min(limit, left)

    @_one_line_errors
    def reference(
        self, job: Any, *, nodes: int = 1, nproc_per_node: int | None = None, **kw: Any
    ) -> RunResult:
        """The uninterrupted run of ``job`` on ``nodes`` agents, made once per session (per
        xdist worker) and shared by every test that asks for the same job, shape and
        environment (whatever its ``restart`` section: a run without faults never
        restarts). The environment is the one given (``env``, the cluster's), not this
        process's own: a test that changes ``os.environ`` for its job passes it as ``env``.
        It must succeed; a failed one is not run again for the next test."""
        __tracebackhide__ = True  # pytest: an unfired fault's failure at the caller's line
        from elasticd.jobspec import parse_job

        unknown = sorted(set(kw) - {"env", "timeout", "restart"})
        if unknown:
            raise UsageError(
                f"reference: {', '.join(unknown)}: not an argument of an uninterrupted run "
                "(it takes nodes, nproc_per_node, env and timeout; faults go to run())"
            )
        raw = _job_dict(job)
        kw.pop("restart", None)  # the job's own restart section: never used without faults
        if nproc_per_node is not None:
            raw["nproc_per_node"] = nproc_per_node
        # The same job however it was given (a path, a dict with defaults left out, paths
        # relative to another directory), whatever its restart section.
        spec = parse_job({**raw, "name": "reference"}, where="reference job")
        canon = spec.with_paths_resolved(os.getcwd()).to_dict()
        for name in ("name", "output_dir", "restart"):
            canon.pop(name, None)
        (canon.get("checkpoint") or {}).pop("dir", None)
        env = {k: os.fspath(v) for k, v in {**self.env, **dict(kw.get("env") or {})}.items()}
        key = json.dumps([canon, nodes, env], sort_keys=True)
        if key not in self.references:
            base = os.path.join(self.reference_base or self.base, "references")
            os.makedirs(base, exist_ok=True)
            where = Cluster(base=tempfile.mkdtemp(prefix="reference-", dir=base),
                            timeout=self.timeout, env=self.env,
                            deadline=self.deadline)  # fmt: skip
            full = kw.get("timeout") or self.timeout
            cut = where._limit(kw.get("timeout")) < full
            result = where.run(raw, nodes=nodes, **kw)
            if result.outcome == "timed_out":
                # Not kept: a longer timeout (another test's, or this one's time not cut
                # short) may see it through; the next test that asks runs it again.
                why = "what this test's timeout left it" if cut else "its timeout"
                raise ElasticdAssertionError(
                    f"the reference run did not finish in {why} (raise "
                    f"@pytest.mark.elasticd(timeout=...))\n{result.describe()}",
                    result,
                )
            self.references[key] = result
        result = self.references[key]
        if result.outcome != "succeeded":
            raise ElasticdAssertionError(
                f"the reference run did not succeed\n{result.describe()}", result
            )
        return result


def leftover_processes(path: str) -> list[int]:
    """Pids of live processes of runs under ``path``: their command line names it (etcd,
    agents) or their environment carries it as ENV_TEST_BASE (agents and every worker,
    a user's script included). The plugin's teardown kills them; its tests check there
    are none."""
    out = []
    needle = os.fsencode(os.path.abspath(path))
    marker = os.fsencode(ENV_TEST_BASE) + b"=" + needle
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                ours = needle in fh.read()
            if not ours:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    ours = any(v == marker or v.startswith(marker + b"/")
                               for v in fh.read().split(b"\0"))  # fmt: skip
        except OSError:
            continue
        if ours and state != b"Z":
            out.append(int(entry))
    return out


def sweep(path: str, *, remove: bool, settle: float = 3.0, grace: float = 5.0) -> list[int]:
    """Kill what a run under ``path`` left running (normally nothing: workers die with
    their agent, which can take a moment, hence ``settle`` seconds first); with ``remove``
    delete ``path``. Returns the pids that were still there."""
    import signal

    deadline = time.monotonic() + settle
    pids = leftover_processes(path)
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = leftover_processes(path)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while pids and leftover_processes(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    if remove:
        shutil.rmtree(path, ignore_errors=True)
    return pids


__all__ = [
    "BUILTIN_JOB",
    "DEFAULT_TIMEOUT",
    "Cluster",
    "ElasticdAssertionError",
    "InjectedFault",
    "Recovery",
    "RunResult",
    "assert_losses_match",
    "assert_lost_steps_at_most",
    "assert_no_lost_steps",
    "assert_recovered_within",
    "assert_worlds",
    "leftover_processes",
    "result_from",
    "sweep",
]
