"""The per-node daemon (``elasticd agent``): supervise workers, re-form the world on change.

- :mod:`elasticd.agent.daemon`: node registration, the job watch, signals, embedded etcd.
- :mod:`elasticd.agent.runner`: one job on one node, round after round.
- :mod:`elasticd.agent.policy`: the pure decisions (outcomes, backoff, worker env).
- :mod:`elasticd.agent.workers`: local worker processes (spawn, signal, stop, heartbeats).
"""
