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

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
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
    """Whether ``addr:port`` refuses a connection within ``timeout`` seconds: nothing
    listens there. Accepted, timed out or any other error: False (not known to be gone)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
