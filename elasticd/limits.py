"""Process limits elasticd's entry points raise for themselves and their workers."""

from __future__ import annotations

import contextlib
import resource

OPEN_FILES_CAP = 1 << 20
"""The most open files an entry point asks for: the hard limit of a container may be 2^30,
and a table of that size costs memory and slows anything that walks it."""


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most
    :data:`OPEN_FILES_CAP`), as any process may, and return the soft limit now. The
    common default soft limit, 1024, is below the files of a checkpoint saved by 1024
    ranks, which ``ckpt inspect`` and ``export`` hold open at once; workers an agent
    starts inherit the raised limit. Where the limit cannot be read or set, it is left."""
    with contextlib.suppress(OSError, ValueError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CAP)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return -1
