"""Client commands of the job registry: submit, status, list, cancel, logs (and nodes).

Every command reaches etcd with ``--etcd URLS`` (default ``$ELASTICD_ETCD``, else
127.0.0.1:2379) plus TLS and auth options; an unreachable etcd is a one-line error within
``--etcd-timeout``, never a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from elasticd.errors import UsageError
from elasticd.jobs import (
    JobRecord,
    JobRegistry,
    JobState,
    event_lines,
    last_recovery,
    recovery_text,
    shown_restarts,
)
from elasticd.jobspec import load_job, run_logs_dir


def add_etcd_options(p: argparse.ArgumentParser) -> None:
    """The connection options every etcd-speaking command takes."""
    g = p.add_argument_group("etcd")
    g.add_argument("--etcd", metavar="URLS", default=None,
                   help="comma-separated host:port of etcd members "
                   "(default $ELASTICD_ETCD, else 127.0.0.1:2379)")  # fmt: skip
    g.add_argument(
        "--etcd-cacert", metavar="PEM", default=None, help="CA of the server certs (TLS)"
    )
    g.add_argument("--etcd-cert", metavar="PEM", default=None, help="client certificate")
    g.add_argument("--etcd-key", metavar="PEM", default=None, help="client certificate's key")
    g.add_argument("--etcd-user", default=None, help="etcd user (auth)")
    g.add_argument("--etcd-password", default=None,
                   help="etcd password (default $ELASTICD_ETCD_PASSWORD)")  # fmt: skip
    g.add_argument("--etcd-timeout", type=float, default=5.0, metavar="S",
                   help="give up on etcd after this many seconds (default 5)")  # fmt: skip


def etcd_config(args: argparse.Namespace, env: dict[str, str] | None = None):
    from elasticd.etcd import config_from_options

    env = dict(os.environ) if env is None else env
    return config_from_options(
        {
            "endpoints": args.etcd,
            "ca_cert": args.etcd_cacert,
            "cert": args.etcd_cert,
            "key": args.etcd_key,
            "user": args.etcd_user,
            "password": args.etcd_password or env.get("ELASTICD_ETCD_PASSWORD"),
            "timeout": args.etcd_timeout,
        },
        env=env,
    )


def open_registry(args: argparse.Namespace) -> tuple[Any, JobRegistry]:
    from elasticd.etcd import connect

    client = connect(etcd_config(args))
    return client, JobRegistry(client)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="validate a job.yaml and submit it to the cluster")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job setting (YAML value), e.g. train.steps=50")  # fmt: skip
    p.add_argument("--replace", action="store_true", help="overwrite a finished job of that name")
    p.add_argument("--fresh", action="store_true",
                   help="start over from step 0: delete the job's checkpoints (only what the "
                   "checkpoint store wrote in its checkpoint dir) and overwrite a finished "
                   "job of that name (else the job resumes from its newest checkpoint)")  # fmt: skip
    p.add_argument("--follow", action="store_true", help="show progress until the job ends")
    p.add_argument("--attach", action="store_true",
                   help="if this job (same name and settings) is queued or running already, "
                   "take it as submitted rather than refuse (a requeued batch script)")  # fmt: skip
    add_etcd_options(p)
    p.set_defaults(func=run_submit)

    p = sub.add_parser("status", help="state, world, layout, step, checkpoint, restarts")
    p.add_argument("name", metavar="JOB", nargs="?", help="one job (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_etcd_options(p)
    p.set_defaults(func=run_status)

    p = sub.add_parser("list", help="list jobs and their states")
    add_etcd_options(p)
    p.set_defaults(func=run_list)

    p = sub.add_parser("nodes", help="list the agents registered in etcd (leases alive)")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_etcd_options(p)
    p.set_defaults(func=run_nodes)

    p = sub.add_parser("cancel", help="stop a job's workers and mark it cancelled")
    p.add_argument("name", metavar="JOB")
    add_etcd_options(p)
    p.set_defaults(func=run_cancel)

    p = sub.add_parser("delete", help="remove a finished job (and its rendezvous) from etcd")
    p.add_argument("name", metavar="JOB")
    add_etcd_options(p)
    p.set_defaults(func=run_delete)

    p = sub.add_parser("logs", help="print worker logs of the latest round of a job's latest run")
    p.add_argument("name", metavar="JOB")
    p.add_argument("--rank", type=int, default=None, help="only this global rank")
    p.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    add_etcd_options(p)
    p.set_defaults(func=run_logs)


# -- submit / follow ----------------------------------------------------------------------


def run_submit(args: argparse.Namespace) -> int:
    # Validate everything before touching etcd: a bad job writes nothing.
    job = load_job(args.job, args.overrides).with_paths_resolved(os.getcwd())
    if args.attach and args.fresh:
        raise UsageError("--attach and --fresh: a job attached to is not started over")
    client, registry = open_registry(args)
    with client:
        if args.fresh:
            start_over(registry, job)
        record = attached(registry, job) if args.attach else None
        if record is not None:
            print(f"job {record.name} is {record.state} already; attached to it")
        else:
            record = registry.submit(job, replace=args.replace or args.fresh)
            print(f"job {record.name} submitted ({record.state}); output in {job.out_dir}")
            if not args.fresh:
                say_resume(job)
        if not args.follow:
            return 0
        final = follow(registry, record.name, out=sys.stdout)
    return 0 if final.state == JobState.SUCCEEDED else 1


def attached(registry: JobRegistry, job) -> JobRecord | None:
    """``submit --attach``: the job of this name when it is still active with the same
    settings (a Slurm allocation requeued after a preemption runs its script again, while
    the job, with an etcd outside the allocation, is still running: its agents left, the
    job waits for nodes); None when there is none or it has finished (submit as usual).
    Refused in one line when it is active with other settings."""
    old = registry.get(job.name)
    if old is None or old.state.terminal:
        return None
    if old.spec != json.loads(json.dumps(job.to_dict())):  # as stored: lists, not tuples
        raise UsageError(
            f"--attach: job {job.name!r} is {old.state} with other settings than {job.name}'s "
            "in this file; cancel it, or give this job another name"
        )
    return old


def start_over(registry: JobRegistry, job) -> None:
    """``submit --fresh``: refuse a job of that name that is still active, then delete the
    job's checkpoints (the store's own files only; refused, deleting nothing, when the
    directory is another job's or a run holds it), saying what was deleted in one line."""
    old = registry.get(job.name)
    if old is not None and not old.state.terminal:
        raise UsageError(
            f"--fresh: job {job.name!r} is {old.state}; cancel it before starting it over"
        )
    from checkpoint import CheckpointError
    from checkpoint.store import start_over as delete_checkpoints

    try:
        steps = delete_checkpoints(job.ckpt_dir, job=job.name)
    except (CheckpointError, OSError) as exc:
        raise UsageError(f"--fresh: {exc}") from None
    if steps:
        print(
            f"--fresh: deleted {len(steps)} checkpoint(s) (steps {', '.join(map(str, steps))}) from {job.ckpt_dir}"
        )
    else:
        print(f"--fresh: no checkpoint in {job.ckpt_dir}; the job starts from step 0")


def say_resume(job) -> None:
    """One line when the job will resume from a checkpoint (its newest commit, as the
    trainer loads it), naming the step; nothing when there is none."""
    try:
        names = os.listdir(job.ckpt_dir)
    except OSError:
        return
    if not any(n.startswith("step-") and "." not in n for n in names):
        return  # nothing committed: no need to import the store (and torch)
    from checkpoint.seal import KeyFileError, read_key
    from checkpoint.store import load_order, step_path

    key = None
    if job.checkpoint.key_file:  # the step a sealed job's resume takes, when this user can tell
        with contextlib.suppress(KeyFileError):
            key = read_key(job.checkpoint.key_file)
    order = load_order(job.ckpt_dir, key, job.name)
    if order:
        print(
            f"job {job.name} resumes from {step_path(job.ckpt_dir, order[0])} at step "
            f"{order[0]} (--fresh starts over)"
        )


def progress_line(record: JobRecord, eta: float | None = None) -> str:
    """One line: a bar of steps, loss, tokens/s, world, restarts and the ETA."""
    st = record.status
    total = int(record.spec.get("train", {}).get("steps", 0)) or 1
    step = int(st.get("step", 0) or 0)
    width = 24
    filled = min(width, step * width // total)
    bar = "#" * filled + "." * (width - filled)
    return f"{record.name} [{bar}] step {step}/{total} " + _facts(record, eta)


def _facts(record: JobRecord, eta: float | None) -> str:
    st = record.status
    loss, tokens = st.get("loss"), st.get("tokens_per_s")
    loss_text = f"{loss:.4f}" if isinstance(loss, int | float) else "-"
    tokens_text = f"{tokens:,.0f}" if isinstance(tokens, int | float) else "-"
    waiting = f" ({record.reason})" if record.state == JobState.QUEUED else ""
    eta_text = f" eta {_duration(eta)}" if eta is not None and not record.state.terminal else ""
    return (
        f"loss {loss_text} tokens/s {tokens_text} world {show(st.get('world'))} "
        f"restarts {shown_restarts(st)} {record.state}{waiting}{eta_text}"
    )


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _has_fd(out) -> bool:
    try:
        out.fileno()
        os.get_terminal_size(out.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return True


class Progress:
    """A job's progress: one live line (a tqdm bar: step/total, loss, tokens/s, world,
    ETA) on a terminal; plain lines, one per change, anywhere else (a log, a pipe)."""

    def __init__(self, out, *, clock=time.monotonic) -> None:
        self._out = out
        self._clock = clock
        self._tty = hasattr(out, "isatty") and out.isatty()
        self._bar = None
        self._last = ""
        self._first: tuple[float, int] | None = None

    def eta(self, record: JobRecord) -> float | None:
        """Seconds left at the step rate seen since the first step we saw."""
        step = int(record.status.get("step", 0) or 0)
        total = int(record.spec.get("train", {}).get("steps", 0) or 0)
        now = self._clock()
        if self._first is None or step < self._first[1]:
            self._first = (now, step)
            return None
        t0, s0 = self._first
        if step <= s0 or now <= t0:
            return None
        return (total - step) * (now - t0) / (step - s0)

    def show(self, record: JobRecord) -> None:
        eta = self.eta(record)
        if not self._tty:
            # A line when something but the ETA changed: in a log (a Slurm output file)
            # the ETA alone, recomputed every poll, printed a line a second.
            key = progress_line(record, None)
            if key != self._last:
                self._out.write(progress_line(record, eta) + "\n")
                self._out.flush()
                self._last = key
            return
        from tqdm import tqdm

        total = int(record.spec.get("train", {}).get("steps", 0) or 0) or None
        step = int(record.status.get("step", 0) or 0)
        if self._bar is None:
            # A terminal that reports no size (a bare pty) would get no bar at all.
            size = os.get_terminal_size(self._out.fileno()).columns if _has_fd(self._out) else 0
            width = {"dynamic_ncols": True} if size > 0 else {"ncols": 100, "nrows": 24}
            self._bar = tqdm(total=total, desc=record.name, unit="step", file=self._out,
                             leave=True, **width,
                             bar_format="{desc} {bar:24} {n_fmt}/{total_fmt}{postfix}")  # fmt: skip
        self._bar.n = step
        self._bar.set_postfix_str(_facts(record, eta), refresh=True)

    def say(self, text: str) -> None:
        """Print ``text`` (whole lines) above the live line, which stays last."""
        if self._bar is None:
            self._out.write(text)
            self._out.flush()
            return
        self._bar.clear()
        self._out.write(text)
        self._out.flush()
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def follow(
    registry: JobRegistry, name: str, *, out, interval: float = 0.5, timeout: float | None = None
) -> JobRecord:
    """Print progress until the job reaches a terminal state; returns its final record."""
    deadline = None if timeout is None else time.monotonic() + timeout
    hinted = False
    progress = Progress(out)
    seen: set[tuple] = set()
    try:
        while True:
            record = registry.get(name)
            if record is None:
                raise UsageError(f"job {name!r} disappeared")
            for line in event_lines(record.status, seen, final=record.state.terminal):
                progress.say(line + "\n")
            if not hinted and record.state == JobState.PENDING and not registry.node_count():
                out.write(
                    f"{name}: waiting: no agent is registered (start one with `elasticd agent`)\n"
                )
                hinted = True
            progress.show(record)
            if record.state.terminal:
                progress.close()
                if record.reason and record.state != JobState.SUCCEEDED:
                    out.write(f"{name}: {record.state}: {record.reason}\n")
                return record
            if deadline is not None and time.monotonic() > deadline:
                raise UsageError(f"job {name!r} still {record.state} after {timeout:g} s")
            time.sleep(interval)
    finally:
        progress.close()


# -- status / list / cancel ---------------------------------------------------------------


def _summary(record: JobRecord) -> dict[str, Any]:
    st = record.status
    return {
        "name": record.name,
        "state": str(record.state),
        "reason": record.reason,
        "world": st.get("world"),
        "round": st.get("round"),
        "layout": st.get("layout"),
        "step": st.get("step"),
        "steps": record.spec.get("train", {}).get("steps"),
        "loss": st.get("loss"),
        "checkpoint": st.get("checkpoint"),
        "restarts": shown_restarts(st),  # decided ones (the raw count is in "status")
        "restart_streak": st.get("restart_streak", 0),
        "last_failure": st.get("last_failure"),
        "troubles": st.get("troubles") or {},
        "last_recovery": last_recovery(st),
        "output_dir": record.spec.get("output_dir"),
    }


def run_status(args: argparse.Namespace) -> int:
    client, registry = open_registry(args)
    with client:
        if args.name:
            record = registry.get(args.name)
            if record is None:
                raise UsageError(f"job {args.name!r}: no such job")
            records = [record]
        else:
            records = registry.list()
        # A pending job with no agent anywhere says why it waits (as submit --follow does).
        no_agents = any(r.state == JobState.PENDING for r in records) and not registry.node_count()
    if args.json:
        docs = [{**_summary(r), "status": r.status} for r in records]
        print(json.dumps(docs[0] if args.name else docs, indent=2, sort_keys=True))
        return 0
    if not records:
        print("no jobs")
    for r in records:
        s = {k: show(v) for k, v in _summary(r).items()}
        reason = r.reason
        if no_agents and r.state == JobState.PENDING:
            why = "no agent is registered: start one with `elasticd agent`"
            reason = f"{reason}; {why}" if reason else why
        print(f"job {s['name']}: {s['state']}" + (f" ({show(reason)})" if reason else ""))
        layout = show(r.status.get("layout_text") or r.status.get("layout"))
        print(f"  world {s['world']}  round {s['round']}  layout {layout}")
        print(f"  step {s['step']}/{s['steps']}  loss {s['loss']}  checkpoint {s['checkpoint']}")
        print(f"  restarts {s['restarts']} ({s['restart_streak']} in a row)  "
              f"last failure {s['last_failure']}")  # fmt: skip
        recovery = last_recovery(r.status)
        if recovery is not None:
            print(f"  last recovery {recovery_text(recovery)}")
        print(f"  output {s['output_dir']}")
        troubles = r.status.get("troubles")
        if troubles and not r.state.terminal:  # moot once the job is over
            for line in event_lines({"troubles": troubles}, set(), now=time.time()):
                print(line)
    return 0


def show(value: Any) -> str:
    """A status value for people: ``-`` for unknown (never Python's ``None``)."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def run_list(args: argparse.Namespace) -> int:
    client, registry = open_registry(args)
    with client:
        records = registry.list()
    if not records:
        print("no jobs")
    for r in records:
        st = r.status
        print(
            f"{r.name:<24} {r.state!s:<11} step {show(st.get('step', 0))}/"
            f"{show(r.spec.get('train', {}).get('steps'))}  world {show(st.get('world'))}  "
            f"restarts {shown_restarts(st)}"
        )
    return 0


def run_nodes(args: argparse.Namespace) -> int:
    from elasticd.jobs import NODES_PREFIX, USAGE_PREFIX

    client, _ = open_registry(args)
    with client:
        kvs, _ = client.get_prefix(NODES_PREFIX)
        usage_kvs, _ = client.get_prefix(USAGE_PREFIX)
    usage = {}
    for kv in usage_kvs:
        with contextlib.suppress(ValueError):
            usage[kv.key[len(USAGE_PREFIX) :]] = json.loads(kv.value)
    nodes = []
    for kv in kvs:
        try:
            # The node record, with its free slots and jobs held from its usage record.
            nodes.append({**json.loads(kv.value), **usage.get(kv.key[len(NODES_PREFIX) :], {})})
        except ValueError:
            continue
    if args.json:
        print(json.dumps(nodes, indent=2, sort_keys=True))
        return 0
    if not nodes:
        print("no agents registered")
    for n in nodes:
        print(
            f"{show(n.get('node')):<20} {show(n.get('addr')):<16} nproc {show(n.get('nproc'))}  "
            f"devices {show(n.get('devices'))}  host {show(n.get('hostname'))}  "
            f"version {show(n.get('version'))}"
        )
    return 0


def run_delete(args: argparse.Namespace) -> int:
    client, registry = open_registry(args)
    with client:
        record = registry.delete(args.name)
    print(f"job {record.name} ({record.state}) deleted; its output stays in "
          f"{show(record.spec.get('output_dir'))}")  # fmt: skip
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    client, registry = open_registry(args)
    with client:
        record = registry.cancel(args.name)
    print(f"job {record.name} {record.state}")
    return 0


# -- logs ---------------------------------------------------------------------------------


def _latest_round_dir(logs_dir: str) -> str | None:
    try:
        rounds = [d for d in os.listdir(logs_dir) if d.startswith("round-")]
    except OSError:
        return None
    if not rounds:
        return None
    return os.path.join(logs_dir, max(rounds, key=lambda d: int(d.split("-", 1)[1])))


def _rank_files(round_dir: str, rank: int | None) -> list[str]:
    names = sorted(
        (f for f in os.listdir(round_dir) if f.startswith("rank-") and f.endswith(".log")),
        key=lambda f: int(f[5:-4]),
    )
    if rank is not None:
        names = [f for f in names if f == f"rank-{rank}.log"]
    return [os.path.join(round_dir, f) for f in names]


def _warm_files(logs_dir: str) -> list[str]:
    """The logs of an in-process job's warm workers: one per node and local rank
    (``warm/<node>/local-<i>.log``), for every round they served; not per global rank,
    which may change from round to round."""
    warm = os.path.join(logs_dir, "warm")
    try:
        nodes = sorted(os.listdir(warm))
    except OSError:
        return []
    out = []
    for node in nodes:
        with contextlib.suppress(OSError):
            out += [os.path.join(warm, node, f) for f in sorted(os.listdir(os.path.join(warm, node)))
                    if f.endswith(".log")]  # fmt: skip
    return out


def run_logs(args: argparse.Namespace) -> int:
    client, registry = open_registry(args)
    with client:
        record = registry.get(args.name)
        if record is None:
            raise UsageError(f"job {args.name!r}: no such job")
        logs_dir = run_logs_dir(record.spec["output_dir"], record.run_id)
        offsets: dict[str, int] = {}
        while True:
            round_dir = _latest_round_dir(logs_dir)
            files = _rank_files(round_dir, args.rank) if round_dir else []
            # An in-process job's kept workers log on in their warm logs: shown with the
            # rank logs of the processes a round started (a replacement).
            warm = _warm_files(logs_dir) if args.rank is None else []
            if not files and args.rank is not None and _warm_files(logs_dir):
                raise UsageError(
                    f"job {args.name!r} restarts in-process: its workers log per node and "
                    f"local rank ({os.path.join(logs_dir, 'warm')}/<node>/local-<i>.log), "
                    "not per global rank; leave out --rank"
                )
            files = files + warm
            for path in files:
                with open(path, "rb") as fh:
                    fh.seek(offsets.get(path, 0))
                    data = fh.read()
                if path not in offsets:
                    print(f"==> {path} <==", flush=True)
                if data:
                    sys.stdout.write(data.decode(errors="replace"))
                    sys.stdout.flush()
                offsets[path] = offsets.get(path, 0) + len(data)
            if not args.follow:
                if not files:
                    where = f"rank {args.rank} in " if args.rank is not None else ""
                    raise UsageError(f"job {args.name!r}: no logs for {where}{logs_dir}")
                return 0
            record = registry.get(args.name)
            if record is None or record.state.terminal:
                return 0
            time.sleep(0.5)
