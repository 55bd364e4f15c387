"""Run reports: a run's output directory drawn as pictures (``elasticd report``).

Reads what a run leaves in its ``output_dir``:

- ``metrics.jsonl``: one record per step from global rank 0 (the last record of each step
  counts: a resumed run repeats steps);
- ``events.jsonl``: worlds, recoveries (with their parts), checkpoint saves and loads,
  appended by the agent of node rank 0 (:class:`elasticd.agent.report.JobReporter`);
- ``run.json`` if there: the final record ``elasticd run`` wrote, with the injected faults.

and draws, with matplotlib: loss, tokens/s and the world's size over steps, with world
changes, faults and recoveries marked; a bar per recovery split into its parts; and the
checkpoint save and load times. :func:`write_html` embeds the picture in one HTML page
with tables of the same facts.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from elasticd.errors import UsageError

PART_COLORS = {
    "detect": "#9e9e9e",
    "stop": "#8d6e63",
    "abort": "#8d6e63",
    "rendezvous": "#42a5f5",
    "spawn": "#ab47bc",
    "pg_init": "#ffa726",
    "ckpt_load": "#26a69a",
    "state_transfer": "#26a69a",
    "first_step": "#66bb6a",
}
"""One colour per recovery part (the two restart modes share the colours of like parts)."""


@dataclass(kw_only=True, slots=True)
class Run:
    """What a run directory says about the run."""

    name: str
    steps: list[int] = field(default_factory=list)
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The last metrics.jsonl record of each step."""
    worlds: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    state: str | None = None
    """The job's final state, when run.json says it."""


def _jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; torn or foreign lines are skipped."""
    out = []
    try:
        with open(path, "rb") as fh:  # bytes: a torn write may split a UTF-8 character
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:  # UnicodeDecodeError included
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UsageError(f"report: cannot read {path}: {exc.strerror or exc}") from exc
    return out


def load_run(run_dir: str) -> Run:
    """Read a run's output directory (one-line errors when it is not one)."""
    if not os.path.isdir(run_dir):
        raise UsageError(f"report: {run_dir}: no such directory")
    metrics = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not any("step" in r for r in metrics):
        raise UsageError(
            f"report: {run_dir}: no metrics.jsonl with steps in it (give the job's output_dir)"
        )
    run = Run(name=os.path.basename(os.path.abspath(run_dir)))
    for rec in metrics:
        if isinstance(rec.get("step"), int):
            run.records[rec["step"]] = rec
    run.steps = sorted(run.records)
    for event in _jsonl(os.path.join(run_dir, "events.jsonl")):
        kind = event.get("kind")
        target = {"world": run.worlds, "recovery": run.recoveries,
                  "checkpoint_save": run.saves, "checkpoint_load": run.loads}.get(kind)  # fmt: skip
        if target is not None:
            target.append(event)
    try:
        with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as fh:
            final = json.load(fh)
        run.name = str(final.get("name") or run.name)
        run.state = final.get("state")
        run.faults = [f for f in final.get("faults", []) if not f.get("skipped")]
    except (OSError, ValueError, AttributeError):
        pass
    return run


def _fault_before(run: Run, t: float) -> dict[str, Any] | None:
    before = [f for f in run.faults if isinstance(f.get("t"), int | float) and f["t"] <= t]
    return max(before, key=lambda f: f["t"]) if before else None


def recovery_bars(run: Run) -> list[tuple[str, list[tuple[str, float]]]]:
    """Each recovery as (label, [(part, seconds), ...]) in order; ``detect`` (from the
    injected fault to the failure being known) leads when the fault's time is known."""
    bars = []
    for rec in run.recoveries:
        parts = [(k, float(v)) for k, v in (rec.get("parts") or {}).items()]
        fault = _fault_before(run, float(rec.get("detected_at", 0.0)))
        if fault is not None:
            parts.insert(0, ("detect", max(0.0, float(rec["detected_at"]) - float(fault["t"]))))
        total = sum(s for _, s in parts)
        label = (f"round {rec.get('round')}: {rec.get('reason')}\n"
                 f"{rec.get('mode', 'process')} from {rec.get('source', '?')}, {total:.2f} s")  # fmt: skip
        bars.append((label, parts))
    return bars


def draw(run: Run):
    """The report's figure (a matplotlib Figure, drawn off-screen)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UsageError("report: needs matplotlib (pip install matplotlib)") from exc

    fig = Figure(figsize=(13, 15), layout="constrained")
    grid = fig.add_gridspec(5, 2, height_ratios=[3, 3, 2, 3.2, 3.2])
    ax_loss = fig.add_subplot(grid[0, :])
    ax_tok = fig.add_subplot(grid[1, :], sharex=ax_loss)
    ax_world = fig.add_subplot(grid[2, :], sharex=ax_loss)
    ax_rec = fig.add_subplot(grid[3, :])
    ax_ckpt = fig.add_subplot(grid[4, :])
    title = f"elasticd run {run.name}" + (f": {run.state}" if run.state else "")
    fig.suptitle(title, fontsize=14, fontweight="bold")

    steps = run.steps
    recs = [run.records[s] for s in steps]
    ax_loss.plot(steps, _series(recs, "loss"), color="#1565c0", lw=1.4)
    ax_loss.set_ylabel("loss")
    # A script's own records may lack a field (tokens/s, the loss): a gap, not an error.
    ax_tok.plot(steps, _series(recs, "tokens_per_s"), color="#2e7d32", lw=1.2)
    ax_tok.set_ylabel("tokens/s")
    ax_world.step(steps, _series(recs, "world"), where="post", color="#6a1b9a", lw=1.6)
    ax_world.set_ylabel("world (nodes)")
    ax_world.set_xlabel("step")
    ax_world.xaxis.get_major_locator().set_params(integer=True)
    worlds = [r.get("world") for r in recs]
    if worlds and all(isinstance(w, int) for w in worlds):
        ax_world.set_ylim(0, max(worlds) + 1)
        ax_world.yaxis.get_major_locator().set_params(integer=True)

    # Marks: a world change where the world field changes, each fault at its step, each
    # recovery at its first step.
    changes = [(s, w) for i, (s, w) in enumerate(zip(steps, worlds, strict=True))
               if i > 0 and w != worlds[i - 1]]  # fmt: skip
    for ax in (ax_loss, ax_tok, ax_world):
        for s, _w in changes:
            ax.axvline(s, color="#6a1b9a", ls=":", lw=1)
        for f in run.faults:
            if isinstance(f.get("step"), int):
                ax.axvline(f["step"], color="#c62828", ls="--", lw=1.2)
        for rec in run.recoveries:
            if isinstance(rec.get("first_step"), int):
                ax.axvline(rec["first_step"], color="#2e7d32", ls="-.", lw=1)
                lost = rec.get("lost_steps") or 0
                if lost:  # the steps trained again after this recovery
                    ax.axvspan(rec["first_step"] - 0.5, rec["first_step"] + lost - 0.5,
                               color="#ffcc80", alpha=0.35, lw=0)  # fmt: skip
        ax.grid(alpha=0.3)
    top = ax_loss.get_ylim()[1]
    for f in run.faults:
        if isinstance(f.get("step"), int):
            ax_loss.annotate(f"fault {f.get('fault')}", (f["step"], top), rotation=90, va="top",
                             ha="right", fontsize=8, color="#c62828")  # fmt: skip
    for rec, (_label, parts) in zip(run.recoveries, recovery_bars(run), strict=True):
        if isinstance(rec.get("first_step"), int):
            text = f"recovered in {sum(sec for _, sec in parts):.1f} s"
            if rec.get("lost_steps"):
                text += f", {rec['lost_steps']} steps again"
            ax_loss.annotate(text, (rec["first_step"], top), rotation=90, va="top", ha="left",
                             fontsize=8, color="#2e7d32")  # fmt: skip
    for s, w in ([(steps[0], worlds[0])] if steps else []) + changes:
        if isinstance(w, int):  # a script's own records may not say
            ax_world.annotate(f"{w}", (s, w), xytext=(3, 3), textcoords="offset points",
                              fontsize=8)  # fmt: skip
    ax_loss.set_title("loss, throughput and world size over steps (red --: fault; green -.: "
                      "training resumed; orange: steps trained again; purple :: world change)",
                      fontsize=10)  # fmt: skip

    # One horizontal bar per recovery, split into its parts.
    bars = recovery_bars(run)
    if bars:
        seen: set[str] = set()
        for i, (_label, parts) in enumerate(bars):
            left = 0.0
            for name, sec in parts:
                ax_rec.barh(i, sec, left=left, color=PART_COLORS.get(name, "#bdbdbd"),
                            edgecolor="white", label=None if name in seen else name)  # fmt: skip
                if sec >= 0.08 * max(1e-9, sum(s for _, s in parts)):
                    ax_rec.text(left + sec / 2, i, f"{sec:.2f}", ha="center", va="center",
                                fontsize=8)  # fmt: skip
                seen.add(name)
                left += sec
        ax_rec.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
        ax_rec.invert_yaxis()
        ax_rec.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8,
                      ncols=len(seen))  # fmt: skip
    else:
        ax_rec.text(0.5, 0.5, "no recoveries in this run", ha="center", va="center",
                    transform=ax_rec.transAxes)  # fmt: skip
        ax_rec.set_yticks([])
    ax_rec.set_xlabel("seconds")
    ax_rec.set_title("recoveries, split into their parts (detect: from the injected fault)",
                     fontsize=10)  # fmt: skip
    ax_rec.grid(axis="x", alpha=0.3)

    # Checkpoint save and load times by step.
    if run.saves or run.loads:
        width = max(0.4, (max(steps) - min(steps) + 1) / 120) if steps else 0.8
        if run.saves:
            ax_ckpt.bar([e["step"] for e in run.saves], [e["seconds"] for e in run.saves],
                        width=width, color="#1e88e5", label="save (start to commit)")  # fmt: skip
        if run.loads:
            ax_ckpt.bar([e["step"] + width for e in run.loads], [e["seconds"] for e in run.loads],
                        width=width, color="#fb8c00", label="load at a world's start")  # fmt: skip
        ax_ckpt.legend(fontsize=8)
        ax_ckpt.set_xlabel("checkpoint step")
        ax_ckpt.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax_ckpt.text(0.5, 0.5, "no checkpoint saves or loads recorded", ha="center",
                     va="center", transform=ax_ckpt.transAxes)  # fmt: skip
    ax_ckpt.set_ylabel("seconds")
    ax_ckpt.set_title("checkpoint save and load times", fontsize=10)
    ax_ckpt.grid(axis="y", alpha=0.3)
    return fig


def _series(recs: list[dict[str, Any]], key: str) -> list[float]:
    """``key`` of each record as a float, NaN (a gap in the line) where it is missing or
    not a number."""
    out = []
    for r in recs:
        v = r.get(key)
        out.append(float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan)
    return out


def png_bytes(run: Run) -> bytes:
    buf = io.BytesIO()
    draw(run).savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def write_png(run: Run, path: str, *, png: bytes | None = None) -> None:
    _write(path, png if png is not None else png_bytes(run))


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"report: cannot write {path}: {exc.strerror or exc}") from exc


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_html(run: Run, path: str, *, png: bytes | None = None) -> None:
    """One self-contained page: the picture (embedded) and the facts it shows, in tables."""
    png = png if png is not None else png_bytes(run)
    last = run.records[run.steps[-1]] if run.steps else {}
    worlds = " → ".join(f"{w.get('world')} ({w.get('layout')}, round {w.get('round')})"
                        for w in run.worlds) or "-"  # fmt: skip
    rec_rows = []
    for (label, parts), rec in zip(recovery_bars(run), run.recoveries, strict=True):
        rec_rows.append([label.replace("\n", "; "), rec.get("lost_steps"),
                         ", ".join(f"{k} {v:.2f}s" for k, v in parts)])  # fmt: skip
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>elasticd report: {html.escape(run.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;
text-align:left;font-size:90%}}img{{max-width:100%}}</style></head><body>
<h1>elasticd run {html.escape(run.name)}</h1>
<p>state: {html.escape(_cell(run.state))}; steps: {len(run.steps)}
(last {_cell(run.steps[-1] if run.steps else None)}); final loss: {_cell(last.get("loss"))};
worlds: {html.escape(worlds)}</p>
<img alt="loss, throughput, world, recoveries and checkpoint times"
 src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Faults</h2>
{
        _table(
            ["fault", "step", "detail"],
            [[f.get("fault"), f.get("step"), f.get("detail")] for f in run.faults],
        )
    }
<h2>Recoveries</h2>
{_table(["recovery", "lost steps", "parts"], rec_rows)}
<h2>Checkpoints</h2>
{
        _table(
            ["kind", "step", "seconds", "bytes"],
            [["save", e.get("step"), e.get("seconds"), e.get("bytes")] for e in run.saves]
            + [["load", e.get("step"), e.get("seconds"), e.get("bytes")] for e in run.loads],
        )
    }
</body></html>
"""
    _write(path, page.encode())
