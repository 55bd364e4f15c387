"""`elasticd agent`: the per-node daemon."""

from __future__ import annotations

import argparse
import os
import socket

from elasticd.agent import METRICS_PORT
from elasticd.cli.jobs import add_etcd_options, etcd_config
from elasticd.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="run the per-node daemon that trains submitted jobs",
        description="Register this node in etcd, take every submitted job, run its workers, "
        "and re-form the world when a node dies, is preempted or joins. Without --etcd and "
        "with nothing at 127.0.0.1:2379, an embedded etcd is started in --state-dir.",
    )
    p.add_argument("--node-id", default=None,
                   help="stable node id (default: $ELASTICD_NODE_ID, else the host name)")  # fmt: skip
    p.add_argument("--addr", default=None,
                   help="address peers reach this node at (default: $ELASTICD_ADDR, else the "
                   "host name's address, or where that is loopback the source address of "
                   "the route to etcd, or off the host)")  # fmt: skip
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="device slots this node offers; jobs take slots and queue when none "
                   "are free (default: one per GPU; without GPUs, no accounting)")  # fmt: skip
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="scratch space and embedded etcd data (default ~/.local/state/elasticd)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=METRICS_PORT, metavar="P",
                   help=f"Prometheus port (default {METRICS_PORT}; 0 turns it off)")  # fmt: skip
    g = p.add_mutually_exclusive_group()
    g.add_argument("--allow-commands", action="store_true",
                   help="run jobs with a `command:` of their own (default: only the built-in "
                   "trainer)")  # fmt: skip
    g.add_argument("--allow-command", action="append", default=[], metavar="EXE",
                   help="run jobs whose command starts with EXE (name or path; repeatable)")  # fmt: skip
    p.add_argument("--ttl-after-finished", default="7d", metavar="DURATION",
                   help="delete finished jobs from the registry after this long (e.g. 7d, 12h, "
                   "30m, 90s; 0 keeps them; default 7d)")  # fmt: skip
    p.add_argument("--keep-finished-metrics", default="2m", metavar="DURATION",
                   help="keep a finished job's series on /metrics this long, so Prometheus "
                   "scrapes its final values, then remove them (default 2m)")  # fmt: skip
    p.add_argument("--stale-after", default="120s", metavar="DURATION",
                   help="answer 503 on /healthz and stop feeding systemd's watchdog when "
                   "the agent's main loop has not turned for this long (default 120s)")  # fmt: skip
    add_etcd_options(p)
    p.set_defaults(func=run)


def parse_duration(text: str, flag: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s`` or plain seconds → seconds (one-line errors)."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    raw = text.strip().lower()
    scale = units.get(raw[-1:])
    number = raw[:-1] if scale is not None else raw
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not a duration (e.g. 7d, 12h, 30m, 90s)") from None
    if value < 0 or value != value:
        raise UsageError(f"{flag}: {text!r} must be >= 0")
    return value


def run(args: argparse.Namespace) -> int:
    from elasticd.agent.daemon import Agent, AgentConfig, default_addr

    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node: {args.nproc_per_node} must be >= 1")
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port: {args.metrics_port} is not a TCP port")
    stale_after = parse_duration(args.stale_after, "--stale-after")
    if stale_after < 5:
        raise UsageError(f"--stale-after: {args.stale_after!r} must be at least 5s")
    given = args.etcd or os.environ.get("ELASTICD_ETCD")
    state_dir = args.state_dir or os.path.join(
        os.path.expanduser("~"), ".local", "state", "elasticd"
    )
    etcd = etcd_config(args) if given else None
    config = AgentConfig(
        etcd=etcd,
        node_id=args.node_id or os.environ.get("ELASTICD_NODE_ID") or socket.gethostname(),
        addr=args.addr
        or os.environ.get("ELASTICD_ADDR")
        or default_addr(etcd.endpoints if etcd is not None else ()),
        nproc=args.nproc_per_node,
        state_dir=os.path.abspath(state_dir),
        metrics_port=args.metrics_port,
        allow_commands="all" if args.allow_commands else (tuple(args.allow_command) or "none"),
        ttl_after_finished=parse_duration(args.ttl_after_finished, "--ttl-after-finished"),
        keep_finished_metrics=parse_duration(args.keep_finished_metrics, "--keep-finished-metrics"),
        stale_after=stale_after,
    )
    return Agent(config).run()
