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

Part 3 (scale) — a job submitted to N idle elasticd agents until their world forms
(N = 256 and 1,024 by default; etcd-v3 only, c10d did not form 256 within minutes), with
the agents' own registry traffic included. Each simulated agent does what
``elasticd.agent`` does: a node record ``/elasticd/nodes/<id>`` created if absent (a txn
comparing version == 0) on its own lease (TTL 5 s), refreshed every ttl/3; one watch on
``/elasticd/jobs/`` and one on ``/elasticd/nodes/``. The parent submits the job as
``elasticd submit`` writes it (spec, state, status in one txn); each agent sees it through
its jobs watch, writes what taking the job changed (``--agents``, below), and joins the
job's rendezvous with a real ``EtcdRendezvous`` (retrying after 1 s if etcd does not
answer, as the agent's ``JobRunner`` does). What an agent writes on taking the job:

- ``usage`` (the agent today): its usage record ``/elasticd/usage/<id>`` (free slots,
  jobs held; created with the node record, on its lease), a txn fenced on its lease.
  Only the coordinator (the lowest id) watches ``/elasticd/usage/``: N events in all.
- ``republish`` (the agent before): its whole node record again, which every agent's
  ``nodes/`` watch sees: N x N events.
- ``idle``: nothing (no usage record either); the floor.
 Formed = every ``next_world``
returned, timed from the submission. Printed with it: the etcd requests made meanwhile
(every gRPC message etcd received: calls, watch creates, lease keep-alives; from its
``/metrics``, ``grpc_server_msg_received_total`` after minus before), the watch events it
sent (``etcd_debugging_mvcc_events_total``), leases that expired, and the CPU seconds the
simulated nodes and etcd used meanwhile.

How 1,024 agents fit on a small machine: they are threads in ``--scale-procs`` processes
(8), 32 agents per etcd connection (a real agent has its own), sharing the connection's
keep-alive stream as the agent's own client does. Three things are the simulator's, not
the agents', and are changed so that the cores go to the rendezvous being measured:

- the agents are registered and their views filled before the clock starts, from one
  read of ``nodes/`` per process instead of one per agent (untimed either way);
- the registry watches of the agents on one connection share one gRPC Watch stream (etcd
  still holds one watcher per agent and prefix and sends each the same events; etcd's
  Go client multiplexes watches the same way);
- gRPC Python wakes each thread blocked on a stream every 0.1 s; the scale part's
  processes make that every 5 s (waits still end at once when data arrives).

The rendezvous itself is the real code, a stream per watch. Even so every node's client
work lands on the same cores: on two cores 256 nodes used about 3 CPU seconds of
simulated-node time to form, so 1,024 cannot form there in 3 s however fast the protocol
is; their leases starve and expire instead (the ``leases lost`` column). Run the scale
part on a machine with more cores for that figure.

    python bench/rendezvous.py [--sizes 8,64,256] [--procs 4] [--detect-nodes 4]
                               [--nodes 256,1024] [--scale-procs 8]
                               [--agents usage,republish,idle] [--limit S]
                               [--parts formation,detection,scale]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

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


# -- the scale part: agents' registry traffic plus the rendezvous ------------------------------

NODES_PREFIX = "/elasticd/nodes/"
USAGE_PREFIX = "/elasticd/usage/"
JOBS_PREFIX = "/elasticd/jobs/"
NODE_TTL = 5.0  # elasticd agent's node_ttl; its lease is kept alive every ttl/3
AGENTS_PER_CONNECTION = 32


class _SharedWatchStream:
    """The registry watches of the agents on one connection, over one gRPC Watch stream.

    etcd keeps one watcher per agent and prefix and sends each the same events as with a
    stream per watch (etcd's own Go client multiplexes a client's watches this way). What
    it saves is the simulator's: gRPC Python spends two threads on each stream, each
    waking every 0.1 s, and 2 x 1,024 idle streams on two cores starve the lease
    keep-alives of the very agents being simulated.
    """

    def __init__(self, client) -> None:
        from etcd3 import etcdrpc

        self._rpc = etcdrpc
        self._lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._handlers: list = []  # in the order of their create requests
        self._by_id: dict[int, object] = {}
        self.all_created = threading.Event()
        member = client.member()
        self._stream = member.watch.Watch(
            iter(self._requests.get, None), metadata=(*client.metadata(), ("hasleader", "true"))
        )
        threading.Thread(target=self._read, name="registry-watches", daemon=True).start()

    def add(self, prefix: str, start_revision: int, on_events) -> None:
        from elasticd.etcd.ops import prefix_end

        create = self._rpc.WatchCreateRequest(
            key=prefix.encode(), range_end=prefix_end(prefix), start_revision=start_revision
        )
        with self._lock:  # etcd answers creates in order: keep ours in the same order
            self.all_created.clear()
            self._handlers.append(on_events)
            self._requests.put(self._rpc.WatchRequest(create_request=create))

    def _read(self) -> None:
        import grpc

        try:
            for resp in self._stream:
                if resp.created:
                    with self._lock:
                        self._by_id[resp.watch_id] = self._handlers[len(self._by_id)]
                        if len(self._by_id) == len(self._handlers):
                            self.all_created.set()
                if resp.events:
                    self._by_id[resp.watch_id](resp.events)  # type: ignore[operator]
        except grpc.RpcError:
            return  # the case is over and etcd stopped


class _SimAgent:
    """One elasticd agent's etcd traffic, as ``elasticd.agent`` makes it: a node record
    created if absent on the agent's lease, refreshed every ttl/3 by the client's shared
    keep-alive stream; one read and then one watch each of ``/elasticd/jobs/`` and
    ``/elasticd/nodes/`` (values parsed as JSON, as the agent's view does); with ``usage``
    a usage record beside the node record, and the coordinator (``coordinator``) also
    watches ``/elasticd/usage/``. When the jobs watch shows the job, the agent takes it:
    it writes its usage record (``usage``) or its whole node record again
    (``republish``), a txn fenced on its lease, as the agent does when its free slots or
    jobs change; and it joins the job's rendezvous (a real ``EtcdRendezvous``) as
    ``JobRunner`` does."""

    def __init__(self, client, name, run_id, n, mode, on_formed, on_lost, on_retry) -> None:
        self.client, self.name, self.run_id, self.n = client, name, run_id, n
        self.mode, self.on_formed = mode, on_formed
        self.on_lost, self.on_retry = on_lost, on_retry
        self.lease = 0
        self.nodes: dict[str, dict] = {}
        self.seen_all = threading.Event()
        self.taken = False
        self.usage_seen: dict[str, bytes] = {}  # the coordinator's mirror of usage/
        self.lock = threading.Lock()

    def record(self, jobs: list[str]) -> str:
        usage = {} if self.mode == "usage" else {"free": None, "jobs": jobs}
        return json.dumps({"node": self.name, "hostname": "bench", "addr": "127.0.0.1",
                           "nproc": 1, "slots": None, "allow_commands": "none", "devices": 0,
                           "version": "bench", "pid": os.getpid(), "started": time.time(),
                           **usage})  # fmt: skip

    def usage(self, jobs: list[str]) -> str:
        return json.dumps({"free": None, "jobs": jobs})

    def create(self) -> None:
        """The node record: create-if-absent on a fresh lease, kept alive every ttl/3."""
        from elasticd.etcd import compare, put_op

        key = NODES_PREFIX + self.name
        lease = self.client.lease_grant(NODE_TTL)
        puts = [put_op(key, self.record([]), lease)]
        if self.mode == "usage":
            puts.append(put_op(USAGE_PREFIX + self.name, self.usage([]), lease))
        result = self.client.txn([compare(key, "version", "==", 0)], puts)
        assert result.succeeded, f"{key} exists"
        self.lease = lease
        self.client.keeper().add(lease, NODE_TTL / 3, lambda lease: self.on_lost(self.name))

    def watch(self, stream, nodes: dict[str, dict], rev_jobs: int, rev_nodes: int) -> None:
        """Watch jobs/ and nodes/ from the revision after the start-up read (``nodes``);
        the coordinator of ``usage`` agents watches usage/ too (from the same revision:
        no usage record changes before the job is submitted)."""
        with self.lock:
            self.nodes = dict(nodes)
            if len(self.nodes) >= self.n:
                self.seen_all.set()
        stream.add(JOBS_PREFIX, rev_jobs + 1, self._on_jobs)
        stream.add(NODES_PREFIX, rev_nodes + 1, self._node_events)
        if self.mode == "usage" and self.name == "node0000":
            stream.add(USAGE_PREFIX, rev_nodes + 1, self._usage_events)

    def _usage_events(self, events) -> None:
        with self.lock:
            for ev in events:
                self.usage_seen[ev.kv.key.decode()] = ev.kv.value

    def _node_events(self, events) -> None:
        with self.lock:
            for ev in events:
                name = ev.kv.key.decode()[len(NODES_PREFIX) :]
                if ev.type == 0:  # put
                    self.nodes[name] = json.loads(ev.kv.value)
                else:
                    self.nodes.pop(name, None)
            if len(self.nodes) >= self.n:
                self.seen_all.set()

    def _on_jobs(self, events) -> None:
        if self.taken or not any(ev.kv.key.endswith(b"/state") for ev in events):
            return
        self.taken = True
        threading.Thread(target=self._run_job, daemon=True).start()

    def _run_job(self) -> None:
        from elasticd.etcd import compare, put_op
        from elasticd.rendezvous import EtcdRendezvous, RendezvousConnection, RendezvousSettings

        key = NODES_PREFIX + self.name
        if self.mode == "republish":
            self.client.txn([compare(key, "lease", "==", self.lease)],
                            [put_op(key, self.record([self.run_id]), self.lease)])  # fmt: skip
        elif self.mode == "usage":
            self.client.txn([compare(key, "lease", "==", self.lease)],
                            [put_op(USAGE_PREFIX + self.name, self.usage([self.run_id]),
                                    self.lease)])  # fmt: skip
        settings = RendezvousSettings(
            run_id=self.run_id, min_nodes=self.n, max_nodes=self.n, join_timeout=600
        )

        def on_change(change) -> None:
            if change.kind == "lease-lost":
                self.on_lost(self.name)

        r = EtcdRendezvous(
            client=self.client, settings=settings, node_id=self.name, on_change=on_change
        )
        while True:  # as elasticd's JobRunner: an unreachable etcd is retried after 1 s
            try:
                r.next_world()
                break
            except RendezvousConnection:
                self.on_retry(self.name)
                time.sleep(1.0)
        self.on_formed(self.name)


def _scale_worker(endpoint, run_id, names, n, mode, watch, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("elasticd").setLevel(logging.ERROR)  # lost leases are counted instead
    # gRPC Python wakes every thread blocked on a stream every 0.1 s (so that signal
    # handlers run; grpc._common.wait). A real node has 3 to 4 streams; this process has
    # hundreds, on two cores shared by 1,024 nodes, and the wake-ups alone starve the
    # keep-alives. Waking every 5 s changes nothing but the simulator's load: every wait
    # still ends at once when its stream delivers.
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = 5.0
    from elasticd.etcd import EtcdConfig, connect

    config = EtcdConfig(endpoints=(endpoint,), timeout=60, request_timeout=30)
    # One connection per AGENTS_PER_CONNECTION agents: each agent holds 3 to 4 streams
    # (2 registry watches, 1 or 2 rendezvous watches), and etcd 3.5.1 serves at most
    # about 250 concurrent streams on one connection; past that, new watches wait forever.
    clients = [connect(config) for _ in range(0, len(names), AGENTS_PER_CONNECTION)]
    agents = [
        _SimAgent(clients[i // AGENTS_PER_CONNECTION], name, run_id, n, mode,
                  on_formed=lambda name: results.put(("formed", name, time.time())),
                  on_lost=lambda name: results.put(("lost", name, time.time())),
                  on_retry=lambda name: results.put(("retry", name, time.time())))
        for i, name in enumerate(names)
    ]  # fmt: skip
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda a: a.create(), agents))
        results.put(("registered", os.getpid(), len(agents)))
        # Every record exists before any agent reads nodes/, and the agents of one
        # process share that start-up read: an idle cluster, reached without pushing N x N
        # registration events and N reads of N records through this simulator (a real
        # agent reads and sees N records once, when it starts; here N agents share two
        # cores, and none of this is measured).
        watch.wait()
        _, rev_jobs = clients[0].get_prefix(JOBS_PREFIX)
        kvs, rev_nodes = clients[0].get_prefix(NODES_PREFIX)
        nodes = {kv.key[len(NODES_PREFIX) :]: json.loads(kv.value) for kv in kvs}
        streams = [_SharedWatchStream(c) for c in clients]
        list(pool.map(lambda i: agents[i].watch(streams[i // AGENTS_PER_CONNECTION], nodes,
                                                rev_jobs, rev_nodes), range(len(agents))))  # fmt: skip
    for stream in streams:  # every watch is live
        stream.all_created.wait()
    for a in agents:  # and every agent's view has every node
        a.seen_all.wait()
    results.put(("ready", os.getpid(), len(agents)))
    threading.Event().wait()


def _cpu_seconds(pids: list[int]) -> float | None:
    """CPU time (user + system) the processes used so far; None off Linux."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def _etcd_counters(endpoint: str) -> dict[str, float]:
    """Requests etcd received (every gRPC message: unary calls, watch creates, lease
    keep-alives), by method, and the watch events it sent."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[method] = out.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_debugging_mvcc_events_total "):
            out["<watch events sent>"] = float(line.rsplit(" ", 1)[1])
    return out


def run_scale_case(n: int, procs: int, limit: float, tmp: str, mode: str) -> dict:
    from elasticd.etcd import EmbeddedEtcd, EtcdConfig, connect, put_op

    ctx = mp.get_context("spawn")
    server = EmbeddedEtcd(data_dir=os.path.join(tmp, f"etcd-{uuid.uuid4().hex[:6]}")).start()
    endpoint = server.endpoint
    job = f"bench-{uuid.uuid4().hex[:6]}"
    run_id = f"{job}-{uuid.uuid4().hex[:8]}"
    names = [f"node{i:04d}" for i in range(n)]
    per = [names[i::procs] for i in range(procs) if names[i::procs]]
    results, watch = ctx.Queue(), ctx.Event()
    workers = [
        ctx.Process(target=_scale_worker, args=(endpoint, run_id, chunk, n, mode, watch, results))
        for chunk in per
    ]
    out: dict = {"n": n}
    t_start = time.time()
    for w in workers:
        w.start()
    try:
        seen = {"registered": 0, "ready": 0}
        while seen["ready"] < len(workers):
            try:
                ev = results.get(timeout=max(1.0, t_start + limit - time.time()))
            except queue.Empty:
                out["error"] = f"agents not registered within {limit:g} s"
                return out
            if ev[0] == "lost":
                out["error"] = "a node lease expired while the agents registered"
                return out
            seen[ev[0]] += 1
            if seen[ev[0]] == len(workers):
                out[f"{ev[0]}_s"] = time.time() - t_start
                watch.set()
        time.sleep(1.0)  # let the last keep-alives and watch deliveries settle
        before = _etcd_counters(endpoint)
        etcd_pid = server.proc.pid if server.proc is not None else -1
        cpu_before = (_cpu_seconds([w.pid for w in workers]), _cpu_seconds([etcd_pid]))
        with connect(EtcdConfig(endpoints=(endpoint,), timeout=30)) as client:
            # A submission as elasticd submit writes it: spec, state, status in one txn.
            t_go = time.time()
            client.txn([], [
                put_op(f"{JOBS_PREFIX}{job}/spec", json.dumps({"name": job})),
                put_op(f"{JOBS_PREFIX}{job}/state", json.dumps(
                    {"state": "pending", "run_id": run_id, "submitted": t_go})),
                put_op(f"{JOBS_PREFIX}{job}/status", json.dumps({"restarts": 0})),
            ])  # fmt: skip
        formed: list[float] = []
        out["lost"] = out["retry"] = 0
        while len(formed) < n and time.time() < t_go + limit:
            try:
                ev = results.get(timeout=max(0.01, t_go + limit - time.time()))
            except queue.Empty:
                break
            if ev[0] == "formed":
                formed.append(ev[2])
            elif ev[0] in ("lost", "retry"):
                out[ev[0]] += 1
        out["form_s"] = max(formed) - t_go if len(formed) == n else None
        cpu_after = (_cpu_seconds([w.pid for w in workers]), _cpu_seconds([etcd_pid]))
        out["cpu"] = tuple(
            None if a is None or b is None else a - b
            for a, b in zip(cpu_after, cpu_before, strict=True)
        )
        after = _etcd_counters(endpoint)
        out["requests"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        return out
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join()
        server.stop()


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
        "--parts",
        default="formation,detection,scale",
        help="which parts to run (comma-separated: formation, detection, scale)",
    )
    p.add_argument(
        "--nodes",
        default="256,1024",
        help="world sizes of the scale part (agents' registry traffic included)",
    )
    p.add_argument(
        "--scale-procs", type=int, default=8, help="processes the scale part's agents run in"
    )
    p.add_argument(
        "--agents",
        default="usage",
        help="scale part: what agents write on taking the job, comma-separated cases run "
        "one after the other: usage (their usage record, watched by the coordinator only, "
        "as elasticd's agent does), republish (their whole node record, watched by every "
        "agent, as the agent did before), idle (nothing)",
    )
    args = p.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        nodes = [int(s) for s in args.nodes.split(",") if s]
    except ValueError:
        p.error("--sizes and --nodes take comma-separated integers")
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    unknown = parts - {"formation", "detection", "scale"}
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}")
    args.agents = [x.strip() for x in args.agents.split(",") if x.strip()]
    if not args.agents or set(args.agents) - {"usage", "republish", "idle"}:
        p.error("--agents: comma-separated cases of usage, republish, idle")
    if "formation" in parts:
        _formation(sizes, args)
    if "detection" in parts:
        _detection(args)
    if "scale" in parts:
        _scale(nodes, args)
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


def _scale(nodes: list[int], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f"job submitted to N registered agents -> world formed (etcd-v3, min = max = N, "
            f"{args.scale_procs} processes), agents' registry traffic included",
            flush=True,
        )
        print(f"{'N':>5} {'agents':>10} {'setup s':>10} {'formed s':>9} "
              f"{'etcd requests':>14} {'watch events':>13} {'leases lost':>12} {'retries':>8}",
              flush=True)  # fmt: skip
        for n in nodes:
            for mode in args.agents:
                r = run_scale_case(n, args.scale_procs, args.limit, tmp, mode)
                label = mode if mode == "idle" else f"+{mode}"
                if "error" in r:
                    print(f"{n:>5} {label:>10}  {r['error']}", flush=True)
                    continue
                req = dict(r["requests"])
                events = req.pop("<watch events sent>", 0)
                print(f"{n:>5} {label:>10} {_fmt(r['ready_s'], args.limit):>10} "
                      f"{_fmt(r['form_s'], args.limit):>9} {sum(req.values()):>14.0f} "
                      f"{events:>13.0f} {r['lost']:>12} {r['retry']:>8}", flush=True)  # fmt: skip
                top = sorted(((v, k) for k, v in req.items() if v), reverse=True)
                print("      requests: " + ", ".join(f"{k} {v:.0f}" for v, k in top), flush=True)
                nodes_cpu, etcd_cpu = r["cpu"]
                if nodes_cpu is not None and etcd_cpu is not None:
                    print(f"      CPU seconds while forming: simulated nodes {nodes_cpu:.1f}, "
                          f"etcd {etcd_cpu:.1f}", flush=True)  # fmt: skip
        print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
