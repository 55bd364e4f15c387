"""etcd v3 rendezvous: how the nodes agree on a world.

Two ways in:

- ``etcd-v3`` — the native event-driven rendezvous (leases, watches, one transaction per
  world). :class:`EtcdRendezvous` is its torch-free core and the elasticd agent's API;
  :class:`EtcdRendezvousHandler` wraps it as torch's ``RendezvousHandler``::

      from elasticd.etcd import connect, EtcdConfig
      from elasticd.rendezvous import EtcdRendezvous, RendezvousSettings

      client = connect(EtcdConfig(endpoints=("10.0.0.1:2379",)))
      handler = EtcdRendezvous(
          client=client,
          settings=RendezvousSettings(run_id="tiny", min_nodes=1, max_nodes=4,
                                      ttl=3, settle=1, join_timeout=300),
          node_id="node-a", addr="10.0.0.5",
          on_change=lambda change: wake_agent(change))   # optional callback; check
                                     # change.round: it may be about the world before
      world = handler.next_world()   # World: round, members (rank order), nodes,
                                     # rank_of(node), size, master_addr, master_port
      handler.changed.wait()         # threading.Event, set when the world is stale:
                                     # Change("lost"|"waiting"|"lease-lost"|"closed", nodes, round)
      world = handler.next_world()   # re-form (round + 1); survivors keep their order
      handler.leave()                # graceful (lease revoke): peers know at once
      handler.close()                # leave + stop threads; handler.set_closed() ends the run

  ``settings_from_job(job, run_id=..., min_nodes=..., max_nodes=...)`` takes ttl, settle
  and join_timeout from job.yaml's ``rendezvous:``; torchrun passes them as
  ``--rdzv-conf ttl=3,settle=1,join_timeout=300``. Timeouts raise
  :class:`RendezvousTimeout`, a closed run :class:`RendezvousClosed`, an unreachable etcd
  :class:`RendezvousConnection` (all ``ElasticdError``; through the torch handler they are
  also torch's own error types).

- ``etcd-v3-dynamic`` — torch's DynamicRendezvousHandler on :func:`create_backend`, a
  backend fenced by the state key's etcd mod_revision.
"""

from typing import Any

from elasticd.rendezvous.core import EtcdRendezvous
from elasticd.rendezvous.decisions import Change, Member, RendezvousSettings, World
from elasticd.rendezvous.errors import (
    RendezvousClosed,
    RendezvousConnection,
    RendezvousState,
    RendezvousTimeout,
)
from elasticd.rendezvous.params import settings_from_job

# These need torch; they load on first use so the agent and CLI start without it.
_LAZY = {
    "EtcdRendezvousBackend": "elasticd.rendezvous.backend",
    "EtcdStore": "elasticd.rendezvous.backend",
    "create_backend": "elasticd.rendezvous.backend",
    "EtcdRendezvousHandler": "elasticd.rendezvous.torch_handler",
    "create_handler": "elasticd.rendezvous.plugin",
    "create_dynamic_handler": "elasticd.rendezvous.plugin",
    "settings_from_params": "elasticd.rendezvous.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elasticd.rendezvous' has no attribute {name!r}")


__all__ = [
    "Change",
    "EtcdRendezvous",
    "EtcdRendezvousBackend",
    "EtcdRendezvousHandler",
    "EtcdStore",
    "Member",
    "RendezvousClosed",
    "RendezvousConnection",
    "RendezvousSettings",
    "RendezvousState",
    "RendezvousTimeout",
    "World",
    "create_backend",
    "create_dynamic_handler",
    "create_handler",
    "settings_from_job",
    "settings_from_params",
]
