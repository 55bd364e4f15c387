"""Rendezvous errors. These are torch-free (the agent need not import torch); the torch
adapter (``torch_handler``) re-raises them as subclasses that are also torch's own
``RendezvousError`` types, which torch's elastic agent catches by type."""

from __future__ import annotations

from elasticd.errors import RendezvousError


class RendezvousClosed(RendezvousError):
    """The run was closed (finished or cancelled); no further rounds will form."""


class RendezvousTimeout(RendezvousError):
    """No world formed within ``join_timeout``."""


class RendezvousConnection(RendezvousError):
    """etcd could not be reached within its configured timeout."""


class RendezvousState(RendezvousError):
    """What is stored in etcd is not a valid rendezvous state."""
