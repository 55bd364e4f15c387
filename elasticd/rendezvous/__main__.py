"""``python -m elasticd.rendezvous``: one rendezvous node as a process, for tests, the
benchmark and debugging a cluster by hand.

It prints one JSON line per event on stdout: ``{"event": "world", ...}`` when a world
forms, ``{"event": "change", ...}`` when it goes stale, ``{"event": "error", ...}``. With
``--reform`` it re-forms after every change. SIGTERM leaves gracefully (lease revoke).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from elasticd.errors import ElasticdError
from elasticd.etcd.client import connect
from elasticd.etcd.config import config_from_options
from elasticd.rendezvous.core import EtcdRendezvous
from elasticd.rendezvous.decisions import Change, RendezvousSettings


class _Terminated(Exception):
    pass


def _emit(**fields: object) -> None:
    sys.stdout.write(json.dumps({"t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticd.rendezvous")
    p.add_argument("--etcd", required=True, help="host:port[,host:port]")
    p.add_argument("--cacert")
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--etcd-timeout", type=float, default=5.0)
    p.add_argument("--run-id", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=1)
    p.add_argument("--ttl", type=float, default=3.0)
    p.add_argument("--settle", type=float, default=1.0)
    p.add_argument("--join-timeout", type=float, default=300.0)
    p.add_argument("--reform", action="store_true", help="re-form after every change")
    p.add_argument("--rounds", type=int, default=0, help="exit after this many worlds (0: never)")
    args = p.parse_args(argv)

    stop = threading.Event()

    def on_term(*_: object) -> None:
        # Interrupt a blocked next_world too: a terminated node leaves at once.
        stop.set()
        raise _Terminated

    signal.signal(signal.SIGTERM, on_term)
    try:
        config = config_from_options(
            {
                "endpoints": args.etcd,
                "ca_cert": args.cacert,
                "cert": args.cert,
                "key": args.key,
                "timeout": args.etcd_timeout,
            }
        )
        settings = RendezvousSettings(
            run_id=args.run_id,
            min_nodes=args.min,
            max_nodes=args.max,
            ttl=args.ttl,
            settle=args.settle,
            join_timeout=args.join_timeout,
        )
        client = connect(config)
    except ElasticdError as exc:
        _emit(event="error", error=type(exc).__name__, message=str(exc))
        return 2

    def on_change(change: Change) -> None:
        _emit(event="change", node=args.node_id, kind=change.kind, nodes=list(change.nodes),
              round=change.round)  # fmt: skip

    handler = EtcdRendezvous(
        client=client,
        settings=settings,
        node_id=args.node_id,
        on_change=on_change,
        owns_client=True,
    )
    worlds = 0
    try:
        while not stop.is_set():
            world = handler.next_world()
            worlds += 1
            _emit(
                event="world",
                node=args.node_id,
                round=world.round,
                rank=world.rank_of(args.node_id),
                nodes=list(world.nodes),
                master=f"{world.master_addr}:{world.master_port}",
            )
            if args.rounds and worlds >= args.rounds:
                break
            while not stop.is_set() and not handler.changed.wait(0.1):
                pass
            if not args.reform:
                stop.wait()
    except _Terminated:
        pass
    except ElasticdError as exc:
        _emit(event="error", error=type(exc).__name__, message=str(exc))
        handler.close()
        return 2
    handler.close()
    _emit(event="left", node=args.node_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
