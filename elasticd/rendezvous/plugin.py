"""torchrun registration: ``etcd-v3`` (native) and ``etcd-v3-dynamic`` (torch's
DynamicRendezvousHandler on our fenced backend).

torch loads each entry point of the ``torchrun.handlers`` group, calls it with no
arguments, and registers what it returns as the handler creator for that name. It does
so *while importing* ``torch.distributed.elastic.rendezvous``, so this module imports
nothing from torch at module level: the creators import lazily.

A creator's user errors (a bad ``--rdzv-conf``, an unreachable etcd) leave as the dual
errors of ``torch_handler``, which are also a one-line ``SystemExit``: torchrun creates
the handler outside any ``try``, so anything else would print the launcher's stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from elasticd.rendezvous.torch_handler import EtcdRendezvousHandler


def create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """The native handler for torch's ``RendezvousParameters``."""
    from elasticd.rendezvous.torch_handler import as_torch_errors

    return as_torch_errors(_create_handler)(params)


def _create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    from elasticd.etcd.client import EtcdClient
    from elasticd.rendezvous.core import EtcdRendezvous
    from elasticd.rendezvous.params import (
        etcd_config_from_params,
        local_address,
        node_id_from_params,
        settings_from_params,
    )
    from elasticd.rendezvous.torch_handler import EtcdRendezvousHandler

    settings = settings_from_params(params)
    config = etcd_config_from_params(params)
    addr = local_address(params, config.endpoints)
    client = EtcdClient(config)
    rendezvous = EtcdRendezvous(
        client=client,
        settings=settings,
        node_id=node_id_from_params(params, addr),
        addr=addr,
        owns_client=True,
    )
    try:
        rendezvous.start()
    except BaseException:
        client.close()
        raise
    return EtcdRendezvousHandler(rendezvous)


def create_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler on our etcd v3 backend."""
    from elasticd.rendezvous.torch_handler import as_torch_errors

    return as_torch_errors(_create_dynamic_handler)(params)


def _create_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dyn

    from elasticd.rendezvous.backend import create_backend

    backend, store = create_backend(params)
    return dyn(store, backend, params)


def etcd_v3() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``etcd-v3``."""
    return create_handler


def etcd_v3_dynamic() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``etcd-v3-dynamic``."""
    return create_dynamic_handler
