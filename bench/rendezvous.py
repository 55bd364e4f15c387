"""Rendezvous benchmark: elasticd's etcd-v3 against torch's c10d backend, side by side.

Part 1 — time to form a world of N simulated nodes (N = 8, 64, 256 by default). Nodes
are threads spread over a few processes; each etcd-v3 node has its own lease, watches
and keep-alive (the nodes of one process share one gRPC connection); each c10d node has
its own TCPStore connection and runs torch's DynamicRendezvousHandler on the c10d backend.
min = max = N on both sides, so neither waits a last call. A node counts as formed when
``next_world`` returns, i.e. with its post-formation watch on the members in place.

Part 2 — time from SIGKILL of one node (one node per process) until every survivor
knows. etcd-v3: the survivor's watch reports the lease expiry (defaults: TTL 3 s).
c10d: torch's defaults (keep-alive 5 s, 3 missed beats); a survivor "knows" when a sync
of the rendezvous state no longer lists the dead node. We sync every 0.1 s, far more
often than torch does (it syncs on its 5 s heartbeat), so the c10d figure is a lower
bound.

    python bench/rendezvous.py [--sizes 8,64,256] [--procs 4] [--detect-nodes 4]
                               [--parts formation,detection]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- workers (run in child processes) -------------------------------------------------------


def _make_nodes(kind: str, endpoint: str, run_id: str, names: list[str], n: int, detect: bool):
    """Build the nodes of this process: a list of (name, form(), knows_loss(timeout))."""
    if kind == "etcd-v3":
        from elasticd.etcd import EtcdConfig, connect
        from elasticd.rendezvous import EtcdRendezvous, RendezvousSettings

        client = connect(EtcdConfig(endpoints=(endpoint,), timeout=30, request_timeout=10))
        settings = RendezvousSettings(run_id=run_id, min_nodes=n, max_nodes=n, join_timeout=600)
        out = []
        for name in names:
            r = EtcdRendezvous(client=client, settings=settings, node_id=name)
            r.start()
            out.append((name, r.next_world, lambda t, r=r: r.changed.wait(t)))
        return out

    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = endpoint.rsplit(":", 1)
    out = []
    for name in names:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=600))
        backend = C10dRendezvousBackend(store, run_id)
        params = RendezvousParameters(
            backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=n, max_nodes=n,
            join_timeout="600", local_addr="127.0.0.1",
        )  # fmt: skip
        h = create_handler(store, backend, params)

        def knows_loss(timeout: float, h=h) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with h._heartbeat_lock:
                    h._state_holder.sync()
                    if len(h._state_holder.state.participants) < n:
                        return True
                time.sleep(0.1)
            return False

        out.append((name, h.next_rendezvous, knows_loss))
    return out


def _worker(kind, endpoint, run_id, names, n, detect, go, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    nodes = _make_nodes(kind, endpoint, run_id, names, n, detect)
    results.put(("ready", os.getpid(), len(nodes)))
    go.wait()

    def run(name, form, knows_loss):
        form()
        results.put(("formed", name, time.time()))
        if detect and knows_loss(120.0):
            results.put(("knows", name, time.time()))

    threads = [threading.Thread(target=run, args=node, daemon=True) for node in nodes]
    for t in threads:
        t.start()
    # Run until the parent terminates us. (No shared "stop" event: a multiprocessing
    # Event's set() waits for every sleeper, and the SIGKILLed node never wakes.)
    threading.Event().wait()


# -- the parent -----------------------------------------------------------------------------


def _host(kind: str, tmp: str):
    """Start what the nodes talk to: an etcd member, or the c10d TCPStore server."""
    if kind == "etcd-v3":
        from elasticd.etcd import EmbeddedEtcd

        server = EmbeddedEtcd(data_dir=os.path.join(tmp, f"etcd-{uuid.uuid4().hex[:6]}")).start()
        return server.endpoint, server.stop
    from datetime import timedelta

    import torch.distributed as dist

    from elasticd.etcd.server import free_port

    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )
    return f"127.0.0.1:{port}", lambda: store  # kept alive by the closure until the run ends


def run_case(kind: str, n: int, procs: int, detect: bool, limit: float, tmp: str) -> dict:
    ctx = mp.get_context("spawn")
    endpoint, shutdown = _host(kind, tmp)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    names = [f"node{i:04d}" for i in range(n)]
    per = [names[i::procs] for i in range(procs) if names[i::procs]]
    go, results = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(kind, endpoint, run_id, chunk, n, detect, go, results))
        for chunk in per
    ]
    for w in workers:
        w.start()
    out: dict = {"kind": kind, "n": n}
    try:
        ready = 0
        while ready < len(workers):
            ready += results.get(timeout=120)[0] == "ready"
        t_go = time.time()
        go.set()
        formed = []
        while len(formed) < n:
            left = t_go + limit - time.time()
            if left <= 0:
                out["form_s"] = None
                return out
            try:
                ev = results.get(timeout=left)
            except Exception:
                continue
            if ev[0] == "formed":
                formed.append(ev[2])
        out["form_s"] = max(formed) - t_go
        if detect:
            time.sleep(0.5)  # steady state: keep-alives flowing
            victim = workers[0]
            t_kill = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            knows = []
            while len(knows) < n - 1:
                left = t_kill + limit - time.time()
                if left <= 0:
                    break
                try:
                    ev = results.get(timeout=left)
                except Exception:
                    continue
                if ev[0] == "knows":
                    knows.append(ev[2])
            out["detect_s"] = (max(knows) - t_kill) if len(knows) == n - 1 else None
        return out
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join()
        shutdown()


def _fmt(x: float | None, limit: float) -> str:
    return f">{limit:.0f}" if x is None else f"{x:.3f}"


def _ratio(base: float | None, ours: float | None, limit: float) -> str:
    if ours is None:
        return "n/a"
    if base is None:
        return f">{limit / ours:.1f}x"
    return f"{base / ours:.1f}x"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="8,64,256")
    p.add_argument("--procs", type=int, default=4, help="processes the simulated nodes run in")
    p.add_argument("--detect-nodes", type=int, default=4, help="node processes in the SIGKILL part")
    p.add_argument(
        "--limit", type=float, default=180.0, help="give a case up after this many seconds"
    )
    p.add_argument(
        "--parts", default="formation,detection", help="which parts to run (comma-separated)"
    )
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    unknown = parts - {"formation", "detection"}
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}")
    if "formation" in parts:
        _formation(sizes, args)
    if "detection" in parts:
        _detection(args)
    return 0


def _formation(sizes: list[int], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(f"world formation (min = max = N, {args.procs} processes), seconds", flush=True)
        print(f"{'N':>5} {'etcd-v3':>9} {'c10d':>9} {'c10d/etcd-v3':>13}", flush=True)
        for n in sizes:
            ours = run_case("etcd-v3", n, args.procs, False, args.limit, tmp)["form_s"]
            base = run_case("c10d", n, args.procs, False, args.limit, tmp)["form_s"]
            print(f"{n:>5} {_fmt(ours, args.limit):>9} {_fmt(base, args.limit):>9} "
                  f"{_ratio(base, ours, args.limit):>13}", flush=True)  # fmt: skip
        print(flush=True)


def _detection(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        k = args.detect_nodes
        print(f"SIGKILL of 1 of {k} nodes -> every survivor knows, seconds (defaults)", flush=True)
        ours = run_case("etcd-v3", k, k, True, args.limit, tmp).get("detect_s")
        base = run_case("c10d", k, k, True, args.limit, tmp).get("detect_s")
        print(f"{'etcd-v3 (ttl 3 s)':>24} {_fmt(ours, args.limit):>9}")
        print(f"{'c10d (5 s x 3 beats)':>24} {_fmt(base, args.limit):>9}")
        print(f"{'c10d/etcd-v3':>24} {_ratio(base, ours, args.limit):>9}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
