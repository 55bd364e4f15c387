"""The agent's liveness: whether its main loop still turns.

An agent whose main loop is wedged (a deadlock, a call that never returns) still keeps its
node lease (another thread refreshes it) and still serves ``/metrics``, so the cluster sees
a live node that never takes, reaps or re-forms anything. :class:`Health` is beaten by the
main loop (at least once a second when well; an etcd outage slows it to its request
timeouts, never to minutes) and answers two supervisors:

- ``GET /healthz`` on the metrics port (a Kubernetes ``livenessProbe``): ``200 ok`` while
  the last beat is under ``stale_after`` seconds old (or the agent is still starting),
  else ``503`` and one line saying how long the loop has been stuck;
- systemd's watchdog (``Type=notify``, ``WatchdogSec=``): ``READY=1`` once the agent is
  registered, ``WATCHDOG=1`` every half watchdog interval while healthy (a wedged loop stops
  the pings and systemd restarts the service), ``STOPPING=1`` on a preemption.

Restarting an agent kills its workers, so the threshold is generous: an etcd outage is
not a wedged agent (the loop goes on, failing its requests in seconds).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

STALE_AFTER = 120.0
"""Seconds without a beat after which the agent reports itself unhealthy."""


class Health:
    def __init__(
        self, stale_after: float = STALE_AFTER, clock: Callable[[], float] = time.monotonic
    ):
        self.stale_after = stale_after
        self._clock = clock
        self._last: float | None = None

    def beat(self) -> None:
        self._last = self._clock()

    def state(self) -> tuple[bool, str]:
        """``(healthy, one line)``."""
        if self._last is None:
            return True, "starting"
        age = self._clock() - self._last
        if age > self.stale_after:
            return (
                False,
                f"the agent's main loop has not turned for {age:.0f} s (limit {self.stale_after:.0f} s)",
            )
        return True, "ok"

    def wsgi(self, metrics_app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        """A WSGI app answering ``/healthz`` itself and everything else with ``metrics_app``."""

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") != "/healthz":
                return metrics_app(environ, start_response)
            ok, line = self.state()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])  # fmt: skip
            return [(line + "\n").encode()]

        return app


def sd_notify(message: str, env: dict[str, str] | None = None) -> bool:
    """Send one state line to systemd's notification socket; False where there is none
    (not started by systemd with ``Type=notify``) or it cannot be reached."""
    env = os.environ if env is None else env
    where = env.get("NOTIFY_SOCKET", "")
    if not where or where[0] not in "/@":
        return False
    address = "\0" + where[1:] if where[0] == "@" else where
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval(env: dict[str, str] | None = None) -> float | None:
    """Seconds between systemd watchdog pings (half of ``WATCHDOG_USEC``), or None where
    systemd asks for none, or asks another process (``WATCHDOG_PID``)."""
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


STOPPING_FED = 600.0
"""Seconds the watchdog is fed without a beat once the agent stops: its workers' grace
period and its etcd requests (systemd's ``TimeoutStopSec`` bounds a SIGTERM'd stop; a stop
of the agent's own, its node lease lost for good, has no such bound)."""


def start_watchdog(
    health: Health,
    stopping: threading.Event,
    done: threading.Event,
    clock: Callable[[], float] = time.monotonic,
) -> threading.Thread | None:
    """Ping systemd's watchdog while ``health`` is well, and for :data:`STOPPING_FED`
    seconds once ``stopping`` whatever it says (the agent waits out its workers' grace
    period, beating nothing), until ``done``; None where systemd wants no pings."""
    interval = watchdog_interval()
    if interval is None:
        return None

    def body() -> None:
        since: float | None = None
        while not done.wait(interval):
            if stopping.is_set() and since is None:
                since = clock()
            fed = since is not None and clock() - since < STOPPING_FED
            if fed or health.state()[0]:
                sd_notify("WATCHDOG=1")

    t = threading.Thread(target=body, name="elasticd-sd-watchdog", daemon=True)
    t.start()
    return t
