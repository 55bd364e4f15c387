"""torch's ``RendezvousHandler`` (torchrun ``--rdzv-backend etcd-v3``) over the native
:class:`~elasticd.rendezvous.core.EtcdRendezvous`.

Errors leave as classes that are both ours and torch's, since torch's agent catches its
own ``RendezvousError`` types. Node rank 0 hosts the round's TCPStore on the port it
reserved when it joined; agents use it for torch's rank assignment and exit barrier, and
workers reach it through ``TORCHELASTIC_USE_AGENT_STORE``.
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

from elasticd.log import kv
from elasticd.rendezvous import errors
from elasticd.rendezvous.core import EtcdRendezvous

log = logging.getLogger("elasticd.rendezvous")
T = TypeVar("T")


class TorchRendezvousClosed(errors.RendezvousClosed, torch_api.RendezvousClosedError):
    """Closed run, as both error types."""


class TorchRendezvousTimeout(errors.RendezvousTimeout, torch_api.RendezvousTimeoutError):
    """Join timeout, as both error types."""


class TorchRendezvousConnection(errors.RendezvousConnection, torch_api.RendezvousConnectionError):
    """etcd unreachable, as both error types."""


class TorchRendezvousState(errors.RendezvousState, torch_api.RendezvousStateError):
    """Corrupt stored state, as both error types."""


_AS_TORCH = {
    errors.RendezvousClosed: TorchRendezvousClosed,
    errors.RendezvousTimeout: TorchRendezvousTimeout,
    errors.RendezvousConnection: TorchRendezvousConnection,
    errors.RendezvousState: TorchRendezvousState,
}


def as_torch_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Re-raise our rendezvous errors as their dual ours-and-torch's classes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tuple(_AS_TORCH) as exc:
            if isinstance(exc, torch_api.RendezvousError):
                raise
            raise _AS_TORCH[type(exc)](str(exc)) from exc

    return wrapper


class EtcdRendezvousHandler(RendezvousHandler):
    """The ``etcd-v3`` torchrun handler; ``.rendezvous`` is the native object."""

    def __init__(self, rendezvous: EtcdRendezvous) -> None:
        self.rendezvous = rendezvous
        self._tcp_store: dist.TCPStore | None = None

    def get_backend(self) -> str:
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        return True

    @as_torch_errors
    def next_rendezvous(self) -> RendezvousInfo:
        r = self.rendezvous
        world = r.next_world()
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
