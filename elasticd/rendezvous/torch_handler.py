"""torch's ``RendezvousHandler`` (torchrun ``--rdzv-backend etcd-v3``) over the native
:class:`~elasticd.rendezvous.core.EtcdRendezvous`.

Errors leave as classes that are both ours and torch's, since torch's agent catches its
own ``RendezvousError`` types. They are also a ``SystemExit`` whose code is a one-line
message: torchrun lets a rendezvous error through to the interpreter, which prints a
SystemExit's message as one line on stderr and exits 1, where any other exception prints
the launcher's whole stack (56 lines for a closed run id). torch's launcher still shuts
the handler down on the way out (its ``finally``), and its ``@record`` re-raises a
non-zero SystemExit untouched.

Node rank 0 hosts the round's TCPStore on the port it reserved when it joined; agents use
it for torch's rank assignment and exit barrier, and workers reach it through
``TORCHELASTIC_USE_AGENT_STORE``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from elasticd.errors import ElasticdError, EtcdError, UsageError
from elasticd.log import kv
from elasticd.rendezvous import errors
from elasticd.rendezvous.core import EtcdRendezvous

log = logging.getLogger("elasticd.rendezvous")
T = TypeVar("T")


def one_line(message: str) -> str:
    """``elasticd: <message>`` on one line (gRPC details may carry newlines)."""
    text = " ".join(str(message).split())
    return text if text.startswith("elasticd: ") else f"elasticd: {text}"


class OneLineExit(SystemExit):
    """A SystemExit whose code (what the interpreter prints) is ``one_line(message)``.

    It comes first among the bases of the dual errors so that its ``code`` is the message
    (with Exception first, ``code`` is None and the interpreter exits 0 without a word).
    """

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(str(message)))


class TorchRendezvousClosed(OneLineExit, errors.RendezvousClosed, torch_api.RendezvousClosedError):
    """Closed run, as both error types."""


class TorchRendezvousTimeout(
    OneLineExit, errors.RendezvousTimeout, torch_api.RendezvousTimeoutError
):
    """Join timeout, as both error types."""


class TorchRendezvousConnection(
    OneLineExit, errors.RendezvousConnection, torch_api.RendezvousConnectionError
):
    """etcd unreachable, as both error types."""


class TorchRendezvousState(OneLineExit, errors.RendezvousState, torch_api.RendezvousStateError):
    """Corrupt stored state, as both error types."""


class TorchRendezvousUsage(OneLineExit, UsageError, ValueError):
    """A bad ``--rdzv-endpoint`` or ``--rdzv-conf`` (torch's own backends raise ValueError)."""


_AS_TORCH: tuple[tuple[type[ElasticdError], type[OneLineExit]], ...] = (
    (errors.RendezvousClosed, TorchRendezvousClosed),
    (errors.RendezvousTimeout, TorchRendezvousTimeout),
    (errors.RendezvousConnection, TorchRendezvousConnection),
    (errors.RendezvousState, TorchRendezvousState),
    (UsageError, TorchRendezvousUsage),
    (EtcdError, TorchRendezvousConnection),  # e.g. an unreadable TLS file, refused auth
)


def as_torch(exc: ElasticdError, message: str | None = None) -> BaseException:
    """The dual ours-and-torch's (and SystemExit) error for ``exc``."""
    for ours, dual in _AS_TORCH:
        if isinstance(exc, ours):
            return dual(message or str(exc))
    return exc


def as_torch_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Re-raise our errors as their dual ours-and-torch's classes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except ElasticdError as exc:
            dual = as_torch(exc)
            if dual is exc:
                raise
            raise dual from exc

    return wrapper


class EtcdRendezvousHandler(RendezvousHandler):
    """The ``etcd-v3`` torchrun handler; ``.rendezvous`` is the native object."""

    def __init__(self, rendezvous: EtcdRendezvous) -> None:
        self.rendezvous = rendezvous
        self._tcp_store: dist.TCPStore | None = None
        self._formed = False

    def _closed_message(self) -> str:
        run = self.rendezvous.run_id
        if self._formed:
            return (
                f"rendezvous id {run!r} was closed while this node waited to re-join "
                f"(another node finished or cancelled the run)"
            )
        # The common case: the id of a run that finished (torchrun closes it on the way
        # out), so no world can ever form under it again.
        return (
            f"rendezvous id {run!r} is closed: a run with this id already finished or was "
            f"cancelled; pick a new --rdzv-id"
        )

    def get_backend(self) -> str:
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        return True

    @as_torch_errors
    def next_rendezvous(self) -> RendezvousInfo:
        r = self.rendezvous
        try:
            world = r.next_world()
        except errors.RendezvousClosed as exc:
            raise as_torch(exc, self._closed_message()) from exc
        self._formed = True
        rank = world.rank_of(r.node_id)
        assert rank is not None
        timeout = timedelta(seconds=r.settings.join_timeout)
        if rank == 0:
            # Kept referenced until the next round: peers may still pass torch's exit
            # barrier through it after this node is done.
            self._tcp_store = dist.TCPStore(
                world.master_addr,
                world.master_port,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
            )
            base = self._tcp_store
        else:
            base = dist.TCPStore(
                world.master_addr, world.master_port, is_master=False, timeout=timeout
            )
        store = dist.PrefixStore(f"torchelastic/{r.run_id}/{world.round}", base)
        log.info(
            "rendezvous info",
            **kv(rank=rank, world=world.size, master=f"{world.master_addr}:{world.master_port}"),
        )
        info = RendezvousStoreInfo(master_addr=world.master_addr, master_port=world.master_port)
        return RendezvousInfo(store, rank, world.size, info)

    @as_torch_errors
    def is_closed(self) -> bool:
        return self.rendezvous.is_closed()

    @as_torch_errors
    def set_closed(self) -> None:
        self.rendezvous.set_closed()

    @as_torch_errors
    def num_nodes_waiting(self) -> int:
        return self.rendezvous.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.rendezvous.run_id

    def shutdown(self) -> bool:
        """torch's semantics: close the run for everyone, then leave and release resources."""
        try:
            self.rendezvous.set_closed()
            ok = True
        except errors.RendezvousConnection as exc:
            log.warning("could not close the run", **kv(error=str(exc)))
            ok = False
        self.rendezvous.close()
        return ok
