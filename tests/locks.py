"""Machine-wide claims of numbered resources (Redis DBs, subnets) by concurrent test
sessions, held by ``flock`` (no import side effects: benches import it too)."""

from __future__ import annotations

import fcntl
import os
import tempfile


def claim_numbered(stem: str, numbers: range) -> tuple[int, int] | None:
    """The first of ``numbers`` no other process on this machine holds, and the descriptor
    whose ``flock`` on ``<tmp>/<stem>-<n>.lock`` holds it until it is closed."""
    for n in numbers:
        fd = os.open(os.path.join(tempfile.gettempdir(), f"{stem}-{n}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return n, fd
    return None
