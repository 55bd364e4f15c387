"""Rendezvous errors that are both ours (``ElasticdError``) and torch's.

torch's elastic agent catches its own ``RendezvousError`` subclasses by type, and our CLI
catches ``ElasticdError``; each error here is both, so either side handles it right.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import api as torch_api

from elasticd.errors import RendezvousError


class RendezvousClosed(RendezvousError, torch_api.RendezvousClosedError):
    """The run was closed (finished or cancelled); no further rounds will form."""


class RendezvousTimeout(RendezvousError, torch_api.RendezvousTimeoutError):
    """No world formed within ``join_timeout``."""


class RendezvousConnection(RendezvousError, torch_api.RendezvousConnectionError):
    """etcd could not be reached within its configured timeout."""


class RendezvousState(RendezvousError, torch_api.RendezvousStateError):
    """What is stored in etcd is not a valid rendezvous state."""
