"""Is a member's agent still running? A refused connection says no, at once.

A re-forming round waits up to ``reform_grace`` for the previous world's members that
have not re-joined: an agent whose worker died re-joins within milliseconds, and the
grace keeps it in the world. A node that died whole never re-joins, and its lease
outlives the grace, so every kill of a node paid the whole grace.

Each node's rendezvous therefore listens on a port of its own (``Member.probe``) for as
long as it lives, and the round's closer connects to the port of each member it waits
for:

- **refused** (the host's kernel answers that nothing listens there): the member's
  rendezvous, and so its agent, is gone. Its workers die with their agent. It is excused
  at once; should it be alive after all (a firewall that rejects), it re-joins as a
  newcomer, and rounds are fenced, so it can cost one re-form, never the world's state;
- **accepted**: the process lives, or is frozen (the kernel completes the handshake of a
  stopped process): the grace and then the lease decide, as before;
- **no answer** (a host down, a partition): the same.

A refusal counts only from a member whose probe port a closer reached before: a join's
``probe`` goes into the world record only once the round's closer connected to it (while
the round filled), so a firewall that rejects the port (an ICMP or RST answer, which reads
as a refusal) leaves ``probe`` out of every record, and the grace decides as before,
instead of every re-form excusing live members.

The listener accepts and closes at once; it reads and writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

log = logging.getLogger("elasticd.rendezvous")


class ProbeListener:
    """A port that answers while this process lives (see the module's docstring)."""

    def __init__(self) -> None:
        # Every address (IPv6 and IPv4 where the machine has both): peers reach us by the
        # name or address we joined with, which may resolve for them to another address
        # than for us (a host name that /etc/hosts maps to 127.0.1.1 here); a listener on
        # one address would be refused on the others, and a live node excused.
        if socket.has_dualstack_ipv6():
            self._sock = socket.create_server(
                ("", 0), family=socket.AF_INET6, backlog=64, dualstack_ipv6=True
            )
        else:
            self._sock = socket.create_server(("", 0), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._serve, name="rdzv-probe", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()


def refused(addr: str, port: int, timeout: float) -> bool:
    """Whether every address ``addr`` resolves to refuses a connection to ``port`` within
    ``timeout`` seconds: nothing listens there. One accepted, timed out or failed another
    way (a name that does not resolve): False, not known to be gone."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(sockaddr)
            except ConnectionRefusedError:
                continue
            except OSError:
                return False
            return False
    return bool(infos)


def reachable(addr: str, port: int, timeout: float) -> bool:
    """Whether ``addr:port`` accepts a connection within ``timeout`` seconds (on some
    address it resolves to)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False
