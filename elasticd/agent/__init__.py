"""The per-node daemon (``elasticd agent``): supervise workers, re-form the world on change.

- :mod:`elasticd.agent.daemon`: node registration, the job watch, signals, embedded etcd.
- :mod:`elasticd.agent.runner`: one job on one node, round after round.
- :mod:`elasticd.agent.policy`: the pure decisions (outcomes, backoff, worker env).
- :mod:`elasticd.agent.workers`: local worker processes (spawn, signal, stop, heartbeats).
"""

METRICS_PORT = 9431
"""The agent's default Prometheus port (``--metrics-port``). Not 9400: that is
dcgm-exporter's default, and it runs on most GPU nodes (on the host network on bare metal,
DGX and Slurm clusters), where an agent on 9400 would refuse to start. Prometheus' list of
exporter ports is full (9100-9999 are all allocated); 9431 belongs to no exporter expected
on a training node."""
