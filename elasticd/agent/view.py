"""The agent's local picture of the cluster: jobs and node records, kept by watches.

One read of ``/elasticd/jobs/`` and ``/elasticd/nodes/`` at start, then one watch on each
from the revision after that read, so no change is missed and none is read twice. The
coordinator also follows ``/elasticd/usage/`` (every agent's free slots and jobs held, the
part of a node that changes) the same way, and only while it is the coordinator: with N
agents, a take or a release is one event to one watcher, not N. Every
question the agent asks about jobs and nodes (is the job cancelled? who can host it?) is
answered from this mirror, so an idle agent makes no periodic etcd reads: its only
periodic traffic is its lease keep-alives. During an etcd outage the watches reconnect on
their own and resume from the revision after the last event they delivered; the mirror
answers from what it last knew meanwhile. If etcd compacted that history away, the view
reads everything again (``resync``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from elasticd.errors import ElasticdError
from elasticd.jobs import (
    NODES_PREFIX,
    USAGE_PREFIX,
    JobRecord,
    JobState,
    record_from_parts,
    split_key,
)
from elasticd.jobs import PREFIX as JOBS_PREFIX
from elasticd.log import kv

log = logging.getLogger("elasticd.agent")


class ClusterView:
    """A watch-fed mirror of the job registry and the node records."""

    def __init__(self, client: Any, *, on_change: Callable[[], None] = lambda: None) -> None:
        self._client = client
        self._on_change = on_change
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, bytes]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._usage: dict[str, dict[str, Any]] = {}
        self._watches: list[Any] = []
        self._usage_watch: Any = None
        self._follow_usage = False
        self._usage_guard = threading.RLock()  # the agent's loop and a resync start/stop it
        self._closed = False
        self.synced = threading.Event()

    # -- feeding --------------------------------------------------------------------------------

    def start(self) -> None:
        """Read both prefixes and start watching them (raises EtcdError if etcd is away)."""
        from elasticd.etcd import Watch

        jobs, rev_jobs = self._client.get_prefix(JOBS_PREFIX)
        nodes, rev_nodes = self._client.get_prefix(NODES_PREFIX)
        with self._lock:
            self._jobs.clear()
            self._nodes.clear()
            for item in jobs:
                self._put_job(item.key, item.value)
            for item in nodes:
                self._put_node(item.key, item.value)
        self._watches = [
            Watch(self._client, JOBS_PREFIX, start_revision=rev_jobs + 1,
                  on_events=self._job_events, on_error=self._resync),
            Watch(self._client, NODES_PREFIX, start_revision=rev_nodes + 1,
                  on_events=self._node_events, on_error=self._resync),
        ]  # fmt: skip
        if self._follow_usage:
            try:
                self._start_usage()
            except ElasticdError as exc:  # the agent's next follow_usage(True) tries again
                log.warning("usage records unreadable", **kv(error=str(exc)))
        self.synced.set()
        self._on_change()

    def follow_usage(self, on: bool) -> None:
        """Follow every agent's usage record (the coordinator does), or stop following.
        Starting reads the prefix once (raises EtcdError if etcd is away; call again)."""
        with self._usage_guard:
            if on == self._follow_usage and (not on or self._usage_watch is not None):
                return
            self._follow_usage = on
            if on:
                self._start_usage()
            else:
                self._stop_usage()

    def _start_usage(self) -> None:
        from elasticd.etcd import Watch

        with self._usage_guard:
            self._stop_usage()
            items, rev = self._client.get_prefix(USAGE_PREFIX)
            with self._lock:
                for item in items:
                    self._put_usage(item.key, item.value)
            self._usage_watch = Watch(self._client, USAGE_PREFIX, start_revision=rev + 1,
                                      on_events=self._usage_events, on_error=self._resync)  # fmt: skip

    def _stop_usage(self) -> None:
        with self._usage_guard:
            watch, self._usage_watch = self._usage_watch, None
            if watch is not None:
                watch.cancel()
            with self._lock:
                self._usage.clear()

    def _resync(self, exc: Exception) -> None:
        log.warning("watch history compacted; reading the registry again", **kv(error=str(exc)))
        threading.Thread(target=self._restart, name="view-resync", daemon=True).start()

    def _restart(self) -> None:
        self.close(final=False)
        while not self._closed:
            try:
                self.start()
                return
            except ElasticdError as exc:
                log.warning("registry unreadable; retrying", **kv(error=str(exc)))
                threading.Event().wait(1.0)

    def close(self, *, final: bool = True) -> None:
        if final:
            self._closed = True
        watches, self._watches = self._watches, []
        for w in watches:
            w.cancel()
        self._stop_usage()

    def _put_job(self, key: str, value: bytes) -> None:
        parsed = split_key(key)
        if parsed is not None:
            self._jobs.setdefault(parsed[0], {})[parsed[1]] = value

    def _put_node(self, key: str, value: bytes) -> None:
        try:
            self._nodes[key[len(NODES_PREFIX) :]] = json.loads(value)
        except ValueError:
            log.warning("node record is not JSON; ignored", **kv(key=key))

    def _put_usage(self, key: str, value: bytes) -> None:
        try:
            self._usage[key[len(USAGE_PREFIX) :]] = json.loads(value)
        except ValueError:
            log.warning("usage record is not JSON; ignored", **kv(key=key))

    def _usage_events(self, events: list[Any]) -> None:
        with self._lock:
            for ev in events:
                if ev.kind == "put":
                    self._put_usage(ev.kv.key, ev.kv.value)
                else:
                    self._usage.pop(ev.kv.key[len(USAGE_PREFIX) :], None)
        self._on_change()

    def _job_events(self, events: list[Any]) -> None:
        relevant = False
        with self._lock:
            for ev in events:
                parsed = split_key(ev.kv.key)
                if parsed is None:
                    continue
                name, part = parsed
                if ev.kind == "put":
                    self._jobs.setdefault(name, {})[part] = ev.kv.value
                else:
                    parts = self._jobs.get(name, {})
                    parts.pop(part, None)
                    if not parts:
                        self._jobs.pop(name, None)
                # Status writes (progress) change nothing the agent decides on.
                relevant = relevant or part != "status"
        if relevant:
            self._on_change()

    def _node_events(self, events: list[Any]) -> None:
        with self._lock:
            for ev in events:
                if ev.kind == "put":
                    self._put_node(ev.kv.key, ev.kv.value)
                else:
                    self._nodes.pop(ev.kv.key[len(NODES_PREFIX) :], None)
        self._on_change()

    # -- answers --------------------------------------------------------------------------------

    def job(self, name: str) -> JobRecord | None:
        """The job as last seen (None if absent or unreadable)."""
        with self._lock:
            parts = dict(self._jobs.get(name, {}))
        try:
            return record_from_parts(name, parts)
        except ElasticdError as exc:
            log.warning("stored job is unreadable", **kv(job=name, error=str(exc)))
            return None

    def state_of(self, name: str) -> tuple[JobState, str] | None:
        """``(state, run_id)`` of a job, parsing only its small state key (cheap enough to
        ask every supervision tick); None if absent or unreadable."""
        with self._lock:
            parts = self._jobs.get(name, {})
            raw, has_spec = parts.get("state"), "spec" in parts
        if raw is None or not has_spec:
            return None
        try:
            doc = json.loads(raw)
            return JobState(doc.get("state", "pending")), str(doc.get("run_id", name))
        except (ValueError, AttributeError):
            return None

    def jobs(self) -> list[JobRecord]:
        """Every readable job, oldest submission first."""
        with self._lock:
            names = list(self._jobs)
        records = [r for r in (self.job(n) for n in names) if r is not None]
        return sorted(records, key=lambda r: (r.submitted, r.name))

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Node id → its registration record (agents whose lease is alive), with its
        ``free`` slots and ``jobs`` held added from its usage record while this view
        follows usage (the coordinator's)."""
        with self._lock:
            return {k: {**v, **self._usage.get(k, {})} for k, v in self._nodes.items()}
