"""`elasticd run`: a one-command local cluster with optional fault injection.

The cluster, the faults and the loop that follows the job live in
:mod:`elasticd.localcluster`; this is the command-line shell around them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from elasticd.cli.jobs import Progress
from elasticd.errors import UsageError
from elasticd.localcluster import INTERRUPT_GRACE, CtrlC, print_summary, run_cluster

__all__ = ["print_summary", "register", "run", "run_cluster"]

FAULT_HELP = (
    "kill-node=I@step=S (SIGKILL agent I and its workers), kill-worker=RANK@step=S, "
    "hang-worker=RANK@step=S (SIGSTOP), term-node=I@step=S (preemption), add-node@step=S, "
    "freeze-node=I@step=S[:for=T] (SIGSTOP agent I and all its workers, SIGCONT after T s, "
    "default 10), restart-node=I@step=S (SIGKILL agent I and its workers, start the agent "
    "again at once under its id), etcd-outage@step=S[:for=T] (stop all of etcd for T s, default 10), "
    "kill-etcd-member=M@step=S[:for=T] and kill-etcd-leader@step=S[:for=T] (SIGKILL one "
    "member, restart it after T s, default 5; need --etcd-members 3). Repeatable."
)


MAX_STOP_GRACE = 3600.0
"""The longest --stop-grace: a Ctrl-C must end the run, however late."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a job on a local cluster (embedded etcd, N agents), with faults",
        description="Start an embedded etcd and N agents as separate processes, submit the "
        "job, follow it to the end, and print a summary. Exit 0 iff the job succeeded.",
    )
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="agents to start")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="K",
                   help="workers per node (sets the job's nproc_per_node)")  # fmt: skip
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help=FAULT_HELP)
    p.add_argument("--etcd-members", type=int, default=1, metavar="M",
                   help="1: one embedded etcd (default); 3: a 3-member etcd cluster, every "
                   "agent given every member")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job setting, e.g. train.steps=50")  # fmt: skip
    p.add_argument("--fresh", action="store_true",
                   help="delete the job's output_dir first, if elasticd made it (else the job "
                   "resumes from its checkpoints)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="give up after this many seconds (default 1800)")  # fmt: skip
    p.add_argument("--stop-grace", type=float, default=INTERRUPT_GRACE, metavar="S",
                   help="on Ctrl-C, give the workers this many seconds to save their step "
                   f"before everything is killed (default {INTERRUPT_GRACE:g}); a second "
                   "Ctrl-C kills at once")  # fmt: skip
    p.add_argument("--metrics", action="store_true",
                   help="each agent serves Prometheus metrics and /healthz on a free port "
                   "(named at the start), for a Prometheus or curl to scrape")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="print the final status (state, history with every recovery, "
                   "faults, metrics) as one JSON object on stdout; progress goes to stderr")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from elasticd.jobspec import load_job
    from elasticd.localcluster import check_plan, parse_fault, prepare_output_dir

    if args.nodes < 1:
        raise UsageError(f"--nodes: {args.nodes} must be >= 1")
    if args.etcd_members not in (1, 3, 5):
        raise UsageError(f"--etcd-members: {args.etcd_members} must be 1, 3 or 5")
    if not args.timeout > 0:
        raise UsageError(f"--timeout: {args.timeout:g} must be > 0")
    stop_grace = getattr(args, "stop_grace", INTERRUPT_GRACE)
    if not 0 <= stop_grace <= MAX_STOP_GRACE:
        raise UsageError(f"--stop-grace: {stop_grace:g} must be between 0 and {MAX_STOP_GRACE:g}")
    faults = [parse_fault(f) for f in args.fault]
    overrides = list(args.overrides)
    if args.nproc_per_node is not None:
        overrides.append(f"nproc_per_node={args.nproc_per_node}")
    job = load_job(args.job, overrides).with_paths_resolved(os.getcwd())
    # Everything that would make the run wait forever or fail half-way is refused here,
    # before a process starts.
    check_plan(nodes_min=job.nodes.min, nproc=job.nproc_per_node, nodes=args.nodes,
               faults=faults, etcd_members=args.etcd_members,
               where=os.path.basename(args.job),
               steps=job.train.steps if job.command is None else None,
               restart_mode=job.restart.mode,
               nodes_start=job.nodes.start)  # fmt: skip
    if job.checkpoint.key_file is not None:  # every local node reads this very file
        from checkpoint.seal import KeyFileError, read_key

        try:
            read_key(job.checkpoint.key_file)
        except KeyFileError as exc:
            raise UsageError(f"{os.path.basename(args.job)}: checkpoint.key_file: {exc}") from None
    prepare_output_dir(job.out_dir, fresh=args.fresh)
    as_json = getattr(args, "json", False)
    progress = sys.stderr if as_json else sys.stdout
    if job.command is None:  # the built-in trainer resumes from its checkpoints: say so
        finished = _finished_note(job, where=os.path.basename(args.job), faults=bool(faults))
        if finished:
            progress.write(finished + "\n")
            progress.flush()
    # On a terminal one live line (step/total, loss, tokens/s, world, ETA) under the
    # fault and recovery lines; elsewhere (a log, a pipe) a plain line per change.
    live = Progress(progress) if progress.isatty() else None
    # Ctrl-C: the first stops the cluster gracefully (the workers save their step), within
    # --stop-grace s, and says so; a second kills it at once. Either way: exit 130.
    with CtrlC(out=sys.stderr, grace=stop_grace) as ctrl_c:
        result = run_cluster(job, nodes=args.nodes, faults=faults, timeout=args.timeout,
                             out=progress, etcd_members=args.etcd_members, progress=live,
                             metrics=args.metrics, ctrl_c=ctrl_c)  # fmt: skip
    if as_json:
        print(json.dumps(result, sort_keys=True, default=str))
    else:
        print_summary(result, out=sys.stdout)
    write_report(job.out_dir, result, out=progress)
    return 0 if result["state"] == "succeeded" else 1


def _finished_note(job: Any, *, where: str, faults: bool) -> str | None:
    """One line when the job's checkpoints already hold its last step: the run then
    trains nothing (each rank resumes there and ends), and no fault of it fires. Run
    again, a finished job otherwise looked like one whose training was lost (its summary
    showed no step, its faults "never fired")."""
    from elasticd.agent.policy import latest_checkpoint_step

    at = latest_checkpoint_step(job.ckpt_dir)
    if at is None or at < job.train.steps:
        return None
    fired = ", and no --fault can fire" if faults else ""
    return (f"{where}: its checkpoint in {job.ckpt_dir} is at step {at} and train.steps is "
            f"{job.train.steps}: nothing is left to train{fired} (--fresh starts over)")  # fmt: skip


def write_report(out_dir: str, result: dict, *, out) -> None:
    """Leave the run's final record (run.json: state, history, faults; the steps are in
    metrics.jsonl) and its report (report.html, report.png) in its output_dir."""
    from elasticd.errors import ElasticdError
    from elasticd.report import load_run, png_bytes, write_html, write_png

    final = {k: v for k, v in result.items() if k != "metrics"}
    try:
        with open(os.path.join(out_dir, "run.json"), "w", encoding="utf-8") as fh:
            json.dump(final, fh, sort_keys=True, default=str)
        run = load_run(out_dir)
        picture = png_bytes(run)
        write_html(run, os.path.join(out_dir, "report.html"), png=picture)
        write_png(run, os.path.join(out_dir, "report.png"), png=picture)
    except (OSError, ElasticdError) as exc:  # the run's outcome stands; the report is extra
        out.write(f"report not written: {exc}\n")
        return
    out.write(f"report: {os.path.join(out_dir, 'report.html')} (picture: report.png)\n")
