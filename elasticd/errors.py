"""The error hierarchy of the `elasticd` package.

One root, `ElasticdError`, with a subclass per failure domain. The CLI turns any
`ElasticdError` into a one-line message and exit code 2; anything else is a bug and keeps
its traceback. Other packages (`checkpoint`, `trainer`) have roots of their own; the CLI
subcommand that calls them converts their errors at the boundary (`raise ... from exc`).
"""

from __future__ import annotations


class ElasticdError(Exception):
    """Root of every error elasticd raises on purpose."""


class UsageError(ElasticdError):
    """A command line that cannot be run as given."""


class JobSpecError(ElasticdError):
    """A job.yaml that is malformed, mistyped or impossible.

    The message is already one line naming the field path, e.g.
    ``job.yaml: parallel.tp: 3 does not divide model.heads (4)``.
    """


class LayoutError(ElasticdError):
    """Parallel sizes that cannot be laid out on the given world."""


class EtcdError(ElasticdError):
    """etcd could not be reached, or refused what we asked."""


class RendezvousError(ElasticdError):
    """The nodes could not agree on a world."""


class AgentError(ElasticdError):
    """The per-node daemon could not run or supervise a job."""
