"""`elasticd ckpt`: list, inspect, verify, export and prune checkpoints.

`checkpoint` (and `trainer.hf`, for ``export --format hf``: the GPT-2 names are the
trainer's) is imported inside each run function (the CLI's rule), and its errors become
:class:`~elasticd.errors.ElasticdError` here, so the user sees one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from elasticd.errors import ElasticdError, UsageError


class CheckpointCheckFailed(ElasticdError):
    """`ckpt verify` found problems (one line: how many, and the first few)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ckpt",
        help="list, inspect, verify, export or prune checkpoints",
        description="Work with a checkpoint directory (the job's checkpoint.dir).",
    )
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", parser_class=type(p))
    cmds.required = True

    ls = cmds.add_parser("ls", help="committed steps, their sizes, and which is latest")
    ls.add_argument("dir", metavar="DIR")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(func=_guard(run_ls))

    for name, text, func in (
        ("inspect", "tensors, global shapes, layout at save and sizes", run_inspect),
        ("verify", "check every checksum and that every tensor is covered exactly", run_verify),
    ):
        c = cmds.add_parser(name, help=text)
        c.add_argument("dir", metavar="DIR")
        c.add_argument("--step", type=int, default=None, help="step (default: the newest commit)")
        if name == "inspect":
            c.add_argument("--json", action="store_true", help="print one JSON object")
        _key_option(c)
        c.set_defaults(func=_guard(func))

    ex = cmds.add_parser("export", help="consolidated model weights as safetensors")
    ex.add_argument("dir", metavar="DIR")
    ex.add_argument("out", metavar="OUT", help="output directory")
    ex.add_argument("--step", type=int, default=None, help="step (default: the newest commit)")
    ex.add_argument(
        "--format",
        choices=("raw", "hf"),
        default="raw",
        help="raw: our global tensor names (default); hf: a Hugging Face GPT-2 directory "
        "(config.json, model.safetensors) that transformers loads; dense models only",
    )
    ex.add_argument(
        "--max-file-size",
        type=_size,
        default=_size("5GB"),
        help="split into model-0000i-of-0000n files plus an index above this (default 5GB)",
    )
    _key_option(ex)
    ex.set_defaults(func=_guard(run_export))

    pr = cmds.add_parser(
        "prune",
        help="keep the newest N loadable steps of the current lineage (never the newest commit)",
    )
    pr.add_argument("dir", metavar="DIR")
    pr.add_argument("--keep", type=int, required=True, help="committed steps to keep")
    _key_option(pr, "a sealed job's key: only steps sealed with it count as kept")
    pr.add_argument(
        "--job",
        metavar="NAME",
        default=None,
        help="with --key-file: the job whose directory it is (default: the job of its "
        "owner.json); a step another job sealed with the same key counts as unsealed",
    )
    pr.set_defaults(func=_guard(run_prune))

    se = cmds.add_parser(
        "seal",
        help="seal committed steps saved without the key (a job moving to checkpoint.key_file)",
        description="Check each committed step whole (every byte against its CRC), then write "
        "it anew sealed with the key (a MAC per block, one over the manifest), replacing it. "
        "Seal a directory nobody without the key could write: the seal certifies the step as "
        "it is now. Steps already sealed with the key are left as they are.",
    )
    se.add_argument("dir", metavar="DIR")
    se.add_argument("--key-file", metavar="PATH", required=True, help="the job's key")
    se.add_argument("--step", type=int, default=None, help="only this step (default: every one)")
    se.set_defaults(func=_guard(run_seal))

    kg = cmds.add_parser(
        "keygen",
        help="make a new key for sealed checkpoints (checkpoint.key_file)",
        description="Write a new random key to PATH (mode 600; never over an existing "
        "file) and print its id. Copy it to the same path on every node.",
    )
    kg.add_argument("path", metavar="PATH")
    kg.set_defaults(func=run_keygen)


def _key_option(parser: argparse.ArgumentParser, text: str = "") -> None:
    parser.add_argument(
        "--key-file",
        metavar="PATH",
        default=None,
        help=text
        or "the job's checkpoint.key_file: take only a step sealed with it, and check every "
        "block's MAC",
    )


def _key(args: argparse.Namespace) -> bytes | None:
    """The key of ``--key-file`` (None without one); a bad key file is a one-line error."""
    if getattr(args, "key_file", None) is None:
        return None
    from checkpoint.seal import KeyFileError, read_key

    try:
        return read_key(args.key_file)
    except KeyFileError as exc:
        raise UsageError(f"ckpt {args.ckpt_command}: {exc}") from exc


def run_seal(args: argparse.Namespace) -> int:
    from checkpoint import committed_steps
    from checkpoint.errors import CheckpointError
    from checkpoint.owner import describe_holder, holding
    from checkpoint.seal import key_id
    from checkpoint.sealstep import seal_step
    from checkpoint.store import recover_replaced

    key = _key(args)
    steps = committed_steps(args.dir)
    if args.step is not None:
        if args.step not in steps:
            raise UsageError(f"ckpt seal: {args.dir} has no committed step {args.step}")
        steps = [args.step]
    if not steps:
        print(_shown(f"{args.dir}: no committed checkpoints"))
        return 0
    failed = []
    with holding(args.dir, what="elasticd ckpt seal") as holder:
        if holder is not None:
            raise UsageError(
                f"ckpt seal: {args.dir} is in use by {describe_holder(holder)}; seal it when "
                "that run has ended"
            )
        recover_replaced(args.dir)  # a step a save (or a seal) moved aside and then died
        for step in steps:
            try:
                done = seal_step(args.dir, step, key)
            except CheckpointError as exc:
                failed.append(f"step {step}: {exc}")
                print(_shown(f"step {step}: not sealed: {exc}"))
                continue
            said = "already sealed with this key" if done == "already" else "sealed"
            print(f"step {step}: {said} (key id {key_id(key)})")
    if failed:
        raise UsageError(
            f"ckpt seal: {len(failed)} of {len(steps)} step(s) not sealed: {failed[0]}"
        )
    return 0


def run_keygen(args: argparse.Namespace) -> int:
    from checkpoint.seal import KeyFileError, write_new_key

    try:
        kid = write_new_key(args.path)
    except KeyFileError as exc:
        raise UsageError(f"ckpt keygen: {exc}") from exc
    print(f"wrote a new checkpoint key to {args.path} (key id {kid}); set checkpoint.key_file "
          "to it, with the file at that path on every node")  # fmt: skip
    return 0


def _size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
    }
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        size = float(num) * units[t[len(num) :]]
    except (ValueError, KeyError) as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 5GB)") from exc
    # inf (or 1e400) made int() raise OverflowError, which argparse does not catch.
    if not math.isfinite(size) or size < 1:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (a finite size of at least 1 byte, e.g. 500MB, 5GB)"
        )
    return int(size)


def _guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn checkpoint errors into one-line user errors."""

    def run(args: argparse.Namespace) -> int:
        from checkpoint import CheckpointError

        if not os.path.isdir(args.dir):
            raise UsageError(f"ckpt {args.ckpt_command}: {args.dir}: no such directory")
        try:
            return func(args)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from exc
        except OSError as exc:
            raise UsageError(f"ckpt {args.ckpt_command}: {exc}") from exc

    return run


def _open(args: argparse.Namespace, *, tensors: bool = False):
    """The step the command names, opened: for reading its tensors (``tensors``: imports
    torch), else for checking it (``checkpoint.step.CheckpointFiles``, without torch)."""
    from checkpoint import committed_steps
    from checkpoint.errors import NoCheckpointError
    from checkpoint.manifest import parse_step_dirname
    from checkpoint.step import CheckpointFiles, step_to_open

    path = args.dir
    # A step directory itself, by its name (a stray manifest.json in a checkpoint
    # directory does not make one).
    if parse_step_dirname(os.path.basename(os.path.abspath(args.dir))) is not None:
        if args.step is not None:
            raise UsageError("--step cannot be used with a step directory")
    else:
        try:
            path = step_to_open(args.dir, args.step, _key(args))
        except NoCheckpointError as exc:
            inner = os.path.join(args.dir, "ckpt")
            if args.step is None and committed_steps(inner):  # a job's output_dir
                raise UsageError(f"{exc} (a job's output dir? its checkpoints: {inner})") from exc
            raise
    if tensors:
        from checkpoint.load import Checkpoint

        return Checkpoint.open(path, key=_key(args))
    return CheckpointFiles.open(path, key=_key(args))


def _shown(value: Any) -> str:
    """Text from a checkpoint, safe to print on one line: as is when it is printable (and
    encodable: a lone surrogate is not), else as Python writes the string (``ascii``)."""
    text = str(value)
    if text.isprintable():
        try:
            text.encode(sys.stdout.encoding or "utf-8")
            return text
        except (UnicodeEncodeError, LookupError):
            pass
    return ascii(text)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run_ls(args: argparse.Namespace) -> int:
    from checkpoint import committed_steps, read_latest
    from checkpoint.step import CheckpointFiles
    from checkpoint.store import leftovers, step_path

    latest = read_latest(args.dir)
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[int, int], Any] = {}
    for step in committed_steps(args.dir):
        row: dict[str, Any] = {"step": step, "latest": step == latest}
        linked = _linked_manifest(step_path(args.dir, step), step, seen)
        if linked:
            row["error"] = linked
            rows.append(row)
            continue
        try:
            m = CheckpointFiles.open(step_path(args.dir, step)).manifest
            row.update(
                bytes=m.total_bytes,
                files=len(m.files),
                world=m.world,
                consumed_samples=m.consumed_samples,
                sealed=m.seal.get("key_id") if m.seal is not None else None,
            )
        except Exception as exc:  # one unreadable manifest must not hide the others
            row["error"] = str(exc)
        rows.append(row)
    if args.json:
        print(
            json.dumps(
                {"dir": args.dir, "latest": latest, "steps": rows, "leftovers": leftovers(args.dir)}
            )
        )
        return 0
    if not rows:
        inner = os.path.join(args.dir, "ckpt")
        hint = ""
        if committed_steps(inner):  # a job's output_dir: its checkpoints are in ckpt/
            hint = f" (a job's output dir? its checkpoints: elasticd ckpt ls {inner})"
        print(_shown(f"{args.dir}: no committed checkpoints{hint}"))
        return 0
    print(f"{'STEP':>10}  {'SIZE':>12}  {'FILES':>5}  {'WORLD':>5}  {'SAMPLES':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['step']:>10}  unreadable: {_shown(r['error'])}")
            continue
        mark = "  latest" if r["latest"] else ""
        if r["sealed"] is not None:
            mark += f"  sealed ({_shown(r['sealed'])})"
        print(
            f"{r['step']:>10}  {_mb(r['bytes']):>12}  {r['files']:>5}  {r['world']:>5}  {r['consumed_samples']:>10}{mark}"
        )
    return 0


def _layout_lines(layout: dict[str, Any] | None) -> list[str]:
    """The layout at save as a few readable lines (``--json`` has it whole)."""
    if not layout:
        return ["layout at save: -"]
    dims = " ".join(f"{k}{layout[k]}" for k in ("tp", "pp", "vpp", "cp", "dp", "ep", "etp")
                    if layout.get(k) is not None)  # fmt: skip
    # Shown as read: a hand-edited (or hostile) layout may hold anything JSON can.
    spares = layout.get("spares")
    spares = len(spares) if isinstance(spares, list) else "-"
    out = [f"layout at save: world {layout.get('world', '-')}  active {layout.get('active', '-')}"
           f"  spares {spares}  {dims}  order {layout.get('order', '-')}"]  # fmt: skip
    batch = [
        f"{k} {layout[k]}" for k in ("global_batch", "micro_batch", "grad_accum") if k in layout
    ]
    if batch:
        out.append("  batch: " + "  ".join(batch))
    return out


def _optimizer_lines(optimizer: dict[str, Any] | None) -> list[str]:
    """The optimizer's type and one line per parameter group (``--json`` has it whole)."""
    if not optimizer:
        return []
    out = [f"optimizer: {optimizer.get('type', '-')}"]
    shown = ("lr", "betas", "eps", "weight_decay")
    groups = optimizer.get("param_groups")
    for i, group in enumerate(groups if isinstance(groups, list) else []):
        if not isinstance(group, dict):
            continue
        facts = "  ".join(f"{k} {group[k]}" for k in shown if k in group)
        params = group.get("params")
        count = f"  ({len(params)} params)" if isinstance(params, list) else ""
        out.append(f"  group {i}: {facts}{count}")
    return out


def run_inspect(args: argparse.Namespace) -> int:
    ckpt = _open(args)
    ckpt.check_files()  # headers and sizes only: what is shown is what a load would find
    m = ckpt.manifest
    if args.json:
        print(
            json.dumps(
                {
                    "step": m.step,
                    "consumed_samples": m.consumed_samples,
                    "job": m.job,
                    "world": m.world,
                    "layout": m.layout,
                    "bytes": m.total_bytes,
                    "optimizer": m.optimizer,
                    "extra": m.extra,
                    "commit": m.commit,
                    "writer": m.writer,
                    "format_version": m.version,
                    "tensors": {
                        n: {
                            "kind": t.kind,
                            "dtype": t.dtype_name,
                            "shape": list(t.shape),
                            "shards": len(t.chunks),
                        }
                        for n, t in m.tensors.items()
                    },
                }
            )
        )
        return 0
    print(
        f"step {m.step}  consumed_samples {m.consumed_samples}  job {_shown(m.job or '-')}  "
        f"world {m.world}"
    )
    print(f"size {_mb(m.total_bytes)} in {len(m.files)} files  format version {m.version}")
    writer = (
        f"round {m.writer['round']} of run {_shown(m.writer['run_id'] or '-')}"
        if m.writer is not None
        else "unfenced"
    )
    print(f"commit {m.commit}  written by {writer}")
    for line in _layout_lines(m.layout):
        print(_shown(line))
    for line in _optimizer_lines(m.optimizer):
        print(_shown(line))
    print(f"{'KIND':<10} {'DTYPE':<9} {'SHAPE':<18} {'SHARDS':>6} {'SIZE':>10}  NAME")
    for n, t in sorted(m.tensors.items()):
        shape = "x".join(map(str, t.shape)) or "scalar"
        dtype = t.dtype_name
        print(
            f"{t.kind:<10} {dtype:<9} {shape:<18} {len(t.chunks):>6} {_mb(t.nbytes):>10}  "
            f"{_shown(n)}"
        )
    return 0


VERIFY_SHOWN = 3
"""Problems ``ckpt verify`` names in its one line (it counts them all)."""


def run_verify(args: argparse.Namespace) -> int:
    from checkpoint import verify

    ckpt = _open(args)
    problems = verify(ckpt)
    skipped = _newer_unopenable(args, ckpt.step)
    if skipped:
        # A load passes over them to an older step, so the default step verifies; a
        # health check must still fail (the newest commit is what it is asked about).
        problems.total = problems.total + len(skipped)
        problems[:0] = skipped
    if problems:  # one line, as every other refusal: the count and the first few
        shown = "; ".join(problems[:VERIFY_SHOWN])
        total = problems.total  # it keeps the first few only
        more = total - VERIFY_SHOWN
        raise CheckpointCheckFailed(
            f"{ckpt.path}: {total} problem{'s' if total > 1 else ''} found: "
            + shown
            + (f" (and {more} more)" if more > 0 else "")
        )
    m = ckpt.manifest
    held = f"{len(m.files)} files, {len(m.tensors)} tensors, {_mb(m.total_bytes)}"
    if m.seal is not None:
        kid = m.seal.get("key_id", "?")
        held += (
            f"; sealed with key id {kid}, every MAC checked"
            if ckpt.key is not None
            else f"; sealed with key id {kid}, not checked (no --key-file)"
        )
    print(_shown(f"{ckpt.path}: ok ({held})"))
    return 0


def _linked_manifest(step_dir: str, step: int, seen: dict[tuple[int, int], Any]) -> str:
    """Why ``step``'s manifest is not opened, or "" to open it: a manifest with several
    links (no save writes one) is parsed once for all of them (``seen``: (device, inode)
    -> the step it names, or its error), and only the link under the step it names is
    opened. Each link of a large manifest cost a whole parse: 30 links of a 63 MB one
    made `ckpt ls` and `verify` run past a minute (a review)."""
    from checkpoint.errors import CheckpointError
    from checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
    from checkpoint.stfile import read_regular

    path = os.path.join(step_dir, "manifest.json")
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return ""  # the open names it
    if st.st_nlink <= 1:
        return ""
    ident = (st.st_dev, st.st_ino)
    if ident not in seen:
        try:
            data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES)
            seen[ident] = Manifest.from_json(data, where=path).step
        except (CheckpointError, OSError) as exc:
            seen[ident] = exc
    named = seen[ident]
    if isinstance(named, Exception):
        return str(named)
    if named == step:
        return ""
    return (f"{path} is a hard link to the manifest of step {named} (no save writes one); "
            "not opened")  # fmt: skip


def _newer_unopenable(args: argparse.Namespace, verified: int) -> list[str]:
    """Without ``--step``: the committed steps newer than the one verified (the one a
    load would take) that cannot be opened (a manifest overwritten or torn), each as a
    problem line. A step of an abandoned lineage that opens is not a problem."""
    from checkpoint import committed_steps
    from checkpoint.errors import CheckpointError
    from checkpoint.manifest import parse_step_dirname
    from checkpoint.step import CheckpointFiles
    from checkpoint.store import step_path

    if args.step is not None or parse_step_dirname(os.path.basename(os.path.abspath(args.dir))):
        return []
    out = []
    seen: dict[tuple[int, int], Any] = {}
    for step in committed_steps(args.dir):
        if step <= verified:
            continue
        path = step_path(args.dir, step)
        linked = _linked_manifest(path, step, seen)
        if linked:
            out.append(f"step {step}, newer than the step a load takes, cannot be opened: {linked}")
            continue
        try:
            CheckpointFiles.open(path, key=_key(args)).close()
        except CheckpointError as exc:
            if os.path.isdir(path):  # not a step pruned meanwhile (a live job's retention)
                out.append(
                    f"step {step}, newer than the step a load takes, cannot be opened: {exc}"
                )
    return out


def run_export(args: argparse.Namespace) -> int:
    from checkpoint import export

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"ckpt export: {args.out} exists and is not a directory")
    ckpt = _open(args, tensors=True)
    if args.format == "hf":
        from trainer.errors import TrainerConfigError
        from trainer.hf import export_hf

        try:
            files = export_hf(ckpt, args.out)
        except TrainerConfigError as exc:
            raise UsageError(f"ckpt export: {exc}") from exc
    else:
        files = export(ckpt, args.out, max_file_bytes=args.max_file_size)
    print(_shown(f"exported step {ckpt.step} to {args.out}: {', '.join(files)}"))
    return 0


def run_prune(args: argparse.Namespace) -> int:
    from checkpoint import committed_steps, prune
    from checkpoint.owner import describe_holder, holding, read_owner

    if args.keep < 1:
        raise UsageError(f"ckpt prune: --keep must be at least 1, got {args.keep}")
    key = _key(args)
    if args.job is not None and key is None:
        raise UsageError("ckpt prune: --job takes effect only with --key-file")
    if not committed_steps(args.dir):  # not a checkpoint directory: leave no lock file there
        print("removed 0 step(s)")
        return 0
    # Held while pruning: a run's own retention works there, and no run may claim the
    # directory between the look and the deletes.
    with holding(args.dir, what="elasticd ckpt prune") as holder:
        if holder is not None:
            raise UsageError(
                f"ckpt prune: {args.dir} is in use by {describe_holder(holder)}; prune it "
                "when that run has ended"
            )
        # Whose directory it is: a step sealed with the key by another job (the key
        # shared, the step copied in) must not head the lineage. Without --job, the job
        # its runs recorded in owner.json; with neither, the key alone vouches.
        job = args.job
        if job is None and key is not None:
            owner = read_owner(args.dir)
            job = owner["job"] if owner is not None else None
        removed = prune(args.dir, keep=args.keep, key=key, job=job)
    print(
        f"removed {len(removed)} step(s)" + (f": {', '.join(map(str, removed))}" if removed else "")
    )
    return 0
