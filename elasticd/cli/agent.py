"""`elasticd agent`: the per-node daemon."""

from __future__ import annotations

import argparse
import os
import socket

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
    p.add_argument("--node-id", default=None, help="stable node id (default: the host name)")
    p.add_argument("--addr", default=None,
                   help="address peers reach this node at (default: $ELASTICD_ADDR, else the "
                   "host name's address)")  # fmt: skip
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="workers this node offers per job (default: the job's nproc_per_node)")  # fmt: skip
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="scratch space and embedded etcd data (default ~/.local/state/elasticd)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=9400, metavar="P",
                   help="Prometheus port (default 9400; 0 turns it off)")  # fmt: skip
    add_etcd_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from elasticd.agent.daemon import Agent, AgentConfig, default_addr

    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node: {args.nproc_per_node} must be >= 1")
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port: {args.metrics_port} is not a TCP port")
    given = args.etcd or os.environ.get("ELASTICD_ETCD")
    state_dir = args.state_dir or os.path.join(
        os.path.expanduser("~"), ".local", "state", "elasticd"
    )
    config = AgentConfig(
        etcd=etcd_config(args) if given else None,
        node_id=args.node_id or socket.gethostname(),
        addr=args.addr or os.environ.get("ELASTICD_ADDR") or default_addr(),
        nproc=args.nproc_per_node,
        state_dir=os.path.abspath(state_dir),
        metrics_port=args.metrics_port,
    )
    return Agent(config).run()
