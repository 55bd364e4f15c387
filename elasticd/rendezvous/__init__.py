"""etcd v3 rendezvous: how the nodes agree on a world.

Two ways in:

- ``etcd-v3`` — :class:`EtcdRendezvousHandler`, the native event-driven handler (leases,
  watches, one transaction per world). It implements torch's ``RendezvousHandler`` and
  gives the elasticd agent a direct API::

      from elasticd.etcd import connect, EtcdConfig
      from elasticd.rendezvous import EtcdRendezvousHandler, RendezvousSettings

      client = connect(EtcdConfig(endpoints=("10.0.0.1:2379",)))
      handler = EtcdRendezvousHandler(
          client=client,
          settings=RendezvousSettings(run_id="tiny", min_nodes=1, max_nodes=4,
                                      ttl=3, settle=1, join_timeout=300),
          node_id="node-a", addr="10.0.0.5",
          on_change=lambda change: wake_agent(change))   # optional callback
      world = handler.next_world()   # World: round, members (rank order), nodes,
                                     # rank_of(node), size, master_addr, master_port
      handler.changed.wait()         # threading.Event, set when the world is stale:
                                     # Change("lost"|"waiting"|"lease-lost"|"closed", nodes)
      world = handler.next_world()   # re-form (round + 1); survivors keep their order
      handler.leave()                # graceful (lease revoke): peers know at once
      handler.close()                # leave + stop threads; handler.set_closed() ends the run

  ``settings_from_job(job, run_id=..., min_nodes=..., max_nodes=...)`` takes ttl, settle
  and join_timeout from job.yaml's ``rendezvous:``; torchrun passes them as
  ``--rdzv-conf ttl=3,settle=1,join_timeout=300``. Timeouts raise
  :class:`RendezvousTimeout`, a closed run :class:`RendezvousClosed`, an unreachable etcd
  :class:`RendezvousConnection` — each both an ``ElasticdError`` and torch's error type.

- ``etcd-v3-dynamic`` — torch's DynamicRendezvousHandler on :func:`create_backend`, a
  backend fenced by the state key's etcd mod_revision.
"""

from elasticd.rendezvous.backend import EtcdRendezvousBackend, EtcdStore, create_backend
from elasticd.rendezvous.decisions import Member, RendezvousSettings, World
from elasticd.rendezvous.errors import (
    RendezvousClosed,
    RendezvousConnection,
    RendezvousState,
    RendezvousTimeout,
)
from elasticd.rendezvous.handler import Change, EtcdRendezvousHandler
from elasticd.rendezvous.params import settings_from_job, settings_from_params
from elasticd.rendezvous.plugin import create_dynamic_handler, create_handler

__all__ = [
    "Change",
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
