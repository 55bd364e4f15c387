"""Resumed references for bench/chaos.py: the soak's job as one process, trained over each
round of the soak from a copy of the committed checkpoint that round resumed from.

    python bench/chaos_reference.py JOB.json CKPT_DIR OUT_DIR     (requests on stdin)

Why references resumed from the soak's own checkpoints, in segments of at most
``SEGMENT_STEPS`` steps. Two data-parallel layouts (dp2, dp3, dp4 against one process) sum
the gradients in a different order, so they agree within fp32 round-off per step (DESIGN.md
invariant 2), and this model, trained at a constant learning rate, amplifies such
differences exponentially once it is a few thousand steps in: an uninterrupted dp2 run
drifts from an uninterrupted one-process run past 1e-4 at step 4,218. Resuming both from the
same checkpoint starts them level, but not for long. Measured on the 20-minute soak's
checkpoints (seed 7, all 25 rounds, 19,298 records, one-process segments of up to 200 steps,
each from a checkpoint the round resumed from or committed), the largest |diff| by steps
into a segment: 9.5e-7 for steps 1-40 (fp32's resolution near the first losses, about 5),
1.4e-6 for 41-60, 4.6e-6 for 61-80, 2.2e-5 for 81-100, 1.4e-4 for 141-160, 8.8e-4 for
181-200; from step 10,500 alone, one process and the soak's dp2 round first differ by more
than 1e-4 209 steps on. So a reference that starts where a round starts and runs to that
round's end is sound only for short rounds, and a round can last 8,700 steps. A round's
reference is a chain of segments: the first resumed from a copy of the checkpoint the round
resumed from (from scratch for a round that started at step 0), each next one from a copy of
a checkpoint the round committed itself, at most 60 steps on (three checkpoint intervals;
about 70 times below the tolerance, 1e-4; a 20-minute soak checked this way stayed within
2.3e-6 in all its 19,372 records). A recovery that changed the math (a checkpoint that
misses state, a data position or optimizer state loaded wrong, a reshard that moves a value)
still shows at once: the first segment of every round starts from the very checkpoint it
resumed from. The later segments check the round's own checkpoints too: the reference
resumes from the file, while the round went on from its memory.

This file is both sides:

- the server (``__main__``), one process at the lowest CPU priority that runs the
  requests in turn, importing torch once (a process per segment would spend seconds on
  that each time): a request is a JSON line ``{"name": N, "from": S, "to": T}``; it
  copies ``CKPT_DIR/step-S`` (never writing there) into ``OUT_DIR/N/ckpt`` with a
  `latest` pointer naming it (``S`` 0: from scratch), trains the job to step ``T``
  (``OUT_DIR/N/metrics.jsonl``), deletes the copy, and appends ``{"name", "rc", "error",
  "seconds"}`` to ``OUT_DIR/done.jsonl``;
- :class:`ResumedReferences`, the soak's side: it follows the metrics records, decides
  each round's segments as soon as the round has trained past them (or is over: a newer
  round started), sends them to the server, and compares the records with the results.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEGMENT_STEPS = 60
"""The most steps one reference segment trains: within 1.4e-6 of the soak's rounds in the
measurements above, where 100 steps reach 2.2e-5 and 200 steps 8.8e-4."""
LAG_STEPS = 20
"""Steps a round trains past a segment's end before the segment is cut, so that the
checkpoint ending it is committed by then (saves are asynchronous)."""
TOLERANCE = 1e-4
_RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


def clean_env() -> dict[str, str]:
    """This environment without a distributed launcher's variables: a reference is one
    process of its own, not a rank of the soak's world."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICD_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    return env


NICE = "import os, sys; os.nice(19); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
"""``python -c NICE ARGS...``: run ``python ARGS...`` at the lowest CPU priority."""


# -- the server ------------------------------------------------------------------------------


def serve(job_path: str, ckpt_dir: str, out_dir: str, requests: TextIO) -> int:
    from checkpoint.manifest import step_dirname
    from checkpoint.store import write_latest
    from trainer.__main__ import main as train

    with open(job_path, encoding="utf-8") as fh:
        base = json.load(fh)
    done = os.path.join(out_dir, "done.jsonl")
    for line in requests:
        if not line.strip():
            continue
        req = json.loads(line)
        name, start, stop = str(req["name"]), int(req["from"]), int(req["to"])
        seg = os.path.join(out_dir, name)
        ckpt = os.path.join(seg, "ckpt")
        t0, rc, error = time.time(), None, ""
        try:
            shutil.rmtree(seg, ignore_errors=True)
            os.makedirs(seg)
            if start > 0:
                shutil.copytree(os.path.join(ckpt_dir, step_dirname(start)),
                                os.path.join(ckpt, step_dirname(start)))  # fmt: skip
                write_latest(ckpt, start)
            job = {**base, "output_dir": seg, "train": {**base["train"], "steps": stop},
                   "checkpoint": {"every": 0, "keep": 1}}  # fmt: skip
            path = os.path.join(seg, "job.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(job, fh)
            print(f"== {name}: steps {start + 1}..{stop}", flush=True)
            rc = train([path])
        except Exception as exc:  # reported with the segment; the others still run
            error = repr(exc)
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)  # the copy, and the final save
        with open(done, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"name": name, "rc": rc, "error": error,
                                 "seconds": round(time.time() - t0, 2)}) + "\n")  # fmt: skip
    return 0


# -- the soak's side -------------------------------------------------------------------------


@dataclass(kw_only=True)
class Segment:
    name: str
    start: int
    """The checkpoint it resumes from (0: from scratch)."""
    stop: int
    result: dict[str, Any] | None = None


@dataclass(kw_only=True)
class RoundRef:
    """One round of the soak and the reference segments planned for it."""

    round: int
    first: int
    last: int
    world: int | None = None
    resumed_from: int | None = None
    """The step the round resumed from (None until known)."""
    source: str = ""
    """checkpoint (a copy of it starts the reference), scratch, or chained."""
    note: str = ""
    next_from: int = 0
    segments: list[Segment] = field(default_factory=list)
    finished: bool = False
    planned: bool = False
    """Every step the round recorded is in a segment sent."""


class ResumedReferences:
    """Plans, runs (through one server process) and checks the soak's resumed references."""

    def __init__(self, job: dict[str, Any], *, ckpt_dir: str, logs_dir: str, out_dir: str,
                 segment_steps: int = SEGMENT_STEPS) -> None:  # fmt: skip
        self.job, self.ckpt_dir, self.logs_dir = job, ckpt_dir, logs_dir
        self.out_dir, self.h = out_dir, segment_steps
        self.rounds: dict[int, RoundRef] = {}
        self.top_round = 0
        self.proc: subprocess.Popen | None = None
        self.error = ""
        self._done_at = 0
        self._read_t = 0.0
        self.results: dict[str, dict[str, Any]] = {}

    def start(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, "job.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.job, fh)
        log = open(os.path.join(self.out_dir, "server.log"), "wb")  # noqa: SIM115
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", NICE, os.path.abspath(__file__), path, self.ckpt_dir,
                 self.out_dir],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                env=clean_env(),
            )  # fmt: skip

    # -- following the soak ---------------------------------------------------------------------

    def observe(self, records: list[dict[str, Any]]) -> None:
        for rec in records:
            step, rnd = int(rec.get("step", 0)), int(rec.get("round", 0))
            r = self.rounds.get(rnd)
            if r is None:
                r = self.rounds[rnd] = RoundRef(round=rnd, first=step, last=step,
                                                world=rec.get("world"))  # fmt: skip
            r.first, r.last = min(r.first, step), max(r.last, step)
            if r.planned and step > r.segments[-1].stop:
                # A late record (a round's write after a newer one began): its last segment
                # runs again, from the same checkpoint, to the new end.
                r.planned, r.next_from = False, r.segments[-1].start
            self.top_round = max(self.top_round, rnd)
        for rnd, r in self.rounds.items():
            r.finished = r.finished or rnd < self.top_round

    def poll(self, *, final: bool = False) -> None:
        """Send the segments that are due; read the results that are in (once a second)."""
        if final:
            for r in self.rounds.values():
                r.finished = True
        committed: list[int] | None = None
        for rnd in sorted(self.rounds):
            r = self.rounds[rnd]
            if r.planned:
                continue
            if r.resumed_from is None:
                self._resume_point(r)
            while not r.planned:
                a = r.next_from
                if not r.finished and r.last < a + self.h + LAG_STEPS:
                    break  # not trained past this segment yet
                if r.finished and r.last - a <= self.h:
                    self._send(r, a, r.last)
                    r.planned = True
                    break
                if committed is None:
                    committed = _committed(self.ckpt_dir)
                cands = [c for c in committed if a < c <= min(a + self.h, r.last)]
                if cands:
                    self._send(r, a, max(cands))
                elif r.finished:  # no checkpoint of its own in reach: one long segment
                    r.note = (r.note + "; " if r.note else "") + (
                        f"no checkpoint between steps {a} and {a + self.h}: a segment of "
                        f"{r.last - a} steps"
                    )
                    self._send(r, a, r.last)
                    r.planned = True
                else:
                    break  # wait for the round's next commit
        if final or time.time() - self._read_t > 1.0:
            self._read_results()

    def _resume_point(self, r: RoundRef) -> None:
        """Where round ``r`` started: the step before its first record, which its rank 0's
        log names too (``resumed from .../step-S at step S``)."""
        s = r.first - 1
        logged = None
        with contextlib.suppress(OSError):
            # The soak's one run: logs/<run_id>/round-<r>/
            path = next(iter(glob.glob(os.path.join(self.logs_dir, "*", f"round-{r.round}",
                                                    "rank-0.log"))), "")  # fmt: skip
            with open(path, encoding="utf-8", errors="replace") as fh:
                m = _RESUMED.search(fh.read(65536))
            logged = int(m.group(2)) if m else 0
        committed = _committed(self.ckpt_dir)
        if logged is not None and logged != s:
            r.note = f"its log says it resumed at step {logged}, its first record is {r.first}"
            if logged in committed:
                s = logged  # the log names what was loaded
        r.resumed_from = s
        if s <= 0:
            r.source, r.next_from = "scratch", 0
        elif s in committed:
            r.source, r.next_from = "checkpoint", s
        else:  # resumed from something not on disk (say, in-process from its peers)
            older = [c for c in committed if c < s]
            r.next_from = max(older, default=0)
            r.source = "chained"
            r.note = (r.note + "; " if r.note else "") + (
                f"resumed at step {s}, not a checkpoint on disk: its reference starts from "
                f"{'step ' + str(r.next_from) if r.next_from else 'scratch'}, as the "
                "previous round's would continue"
            )

    def _send(self, r: RoundRef, start: int, stop: int) -> None:
        seg = Segment(name=f"r{r.round:03d}-{start:09d}-{stop:09d}", start=start, stop=stop)
        r.segments.append(seg)
        r.next_from = stop
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(json.dumps({"name": seg.name, "from": start, "to": stop}) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            self.error = self.error or f"the reference server went away: {exc}"

    def _read_results(self) -> None:
        self._read_t = time.time()
        with contextlib.suppress(OSError), open(os.path.join(self.out_dir, "done.jsonl")) as fh:
            fh.seek(self._done_at)
            for line in fh:
                if not line.endswith("\n"):
                    break
                self._done_at += len(line.encode())
                with contextlib.suppress(ValueError):
                    res = json.loads(line)
                    self.results[res["name"]] = res

    def pending(self) -> int:
        return sum(s.name not in self.results for r in self.rounds.values() for s in r.segments)

    def finish(self, timeout: float) -> None:
        """Plan the rest (every round is over), let the server run it, and wait."""
        self.poll(final=True)
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=timeout)
            if code != 0:
                self.error = self.error or f"the reference server exited {code}"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.error = self.error or f"the references did not finish within {timeout:.0f} s"
        self._read_results()

    # -- the check ------------------------------------------------------------------------------

    def compare(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Every record against its round's reference (the segment covering its step)."""
        ref: dict[int, dict[int, float]] = {}
        failed, lengths = [], []
        for r in self.rounds.values():
            losses = ref.setdefault(r.round, {})
            for seg in r.segments:
                lengths.append(seg.stop - seg.start)
                res = self.results.get(seg.name)
                if res is None or res.get("rc") != 0 or res.get("error"):
                    failed.append({"segment": seg.name, "from": seg.start, "to": seg.stop,
                                   "result": res or "not run"})  # fmt: skip
                    continue
                got = _losses(os.path.join(self.out_dir, seg.name, "metrics.jsonl"))
                if min(got, default=None) != seg.start + 1 or max(got, default=None) != seg.stop:
                    failed.append({"segment": seg.name, "from": seg.start, "to": seg.stop,
                                   "result": f"steps {min(got, default=None)}.."
                                             f"{max(got, default=None)} in its metrics"})  # fmt: skip
                for step, loss in got.items():
                    if seg.start < step <= seg.stop:
                        losses.setdefault(step, loss)
        mismatches, missing, worst = [], [], 0.0
        per_round: dict[int, dict[str, Any]] = {}
        for rec in records:
            step, rnd, loss = int(rec["step"]), int(rec.get("round", 0)), float(rec["loss"])
            pr = per_round.setdefault(rnd, {"records": 0, "max_abs_diff": 0.0, "mismatches": 0})
            pr["records"] += 1
            want = ref.get(rnd, {}).get(step)
            if want is None:
                missing.append({"round": rnd, "step": step})
                continue
            diff = abs(loss - want) if math.isfinite(loss) else math.inf
            worst = max(worst, diff)
            pr["max_abs_diff"] = max(pr["max_abs_diff"], diff)
            if diff > TOLERANCE:
                pr["mismatches"] += 1
                mismatches.append({"step": step, "round": rnd, "loss": loss, "reference": want,
                                   "diff": diff})  # fmt: skip
        rounds = []
        for rnd in sorted(self.rounds):
            r = self.rounds[rnd]
            pr = per_round.get(rnd, {"records": 0, "max_abs_diff": 0.0, "mismatches": 0})
            rounds.append({"round": rnd, "world": r.world, "steps": [r.first, r.last],
                           "resumed_from": r.resumed_from, "source": r.source,
                           "segments": len(r.segments), **pr, "note": r.note})  # fmt: skip
        return {
            "records": len(records),
            "compared": len(records) - len(missing),
            "without_reference": missing[:20],
            "without_reference_count": len(missing),
            "mismatch_count": len(mismatches),
            "mismatches": mismatches[:20],
            "max_abs_diff": worst,
            "tolerance": TOLERANCE,
            "segment_steps": self.h,
            "segments": len(lengths),
            "longest_segment": max(lengths, default=0),
            "failed_segments": failed[:20],
            "failed_segment_count": len(failed),
            "chained_rounds": [r["round"] for r in rounds if r["source"] == "chained"],
            "error": self.error,
            "rounds": rounds,
        }


def _committed(ckpt_dir: str) -> list[int]:
    from checkpoint.store import committed_steps

    return committed_steps(ckpt_dir)


def _losses(path: str) -> dict[int, float]:
    losses = {}
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as fh:
        for line in fh:
            with contextlib.suppress(ValueError, KeyError):
                rec = json.loads(line)
                losses[int(rec["step"])] = float(rec["loss"])
    return losses


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(*sys.argv[1:4], requests=sys.stdin))
