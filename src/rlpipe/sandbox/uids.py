"""Leases of unprivileged uids, one per live sandbox, safe across processes.

Why a uid per sandbox rather than one shared `nobody`: RLIMIT_NPROC counts every process of a uid, so a
fork bomb in one run would starve all the others; and two runs under one uid could read each other's
files. The lease is an flock on a file named after the uid: the kernel drops it if the holder dies, so a
crashed worker never leaks uids, and two worker processes on one host never hand out the same one.
"""

import fcntl
import os
import random
from pathlib import Path


class UidExhaustedError(RuntimeError):
    """Every uid in the range is leased: more sandboxes are live than the range has room for."""


class UidLease:
    """An exclusive claim on one uid; release() only once no process of that uid can still exist."""

    def __init__(self, uid: int, lock_fd: int) -> None:
        self.uid = uid
        self._lock_fd: int | None = lock_fd

    @classmethod
    def acquire(cls, lease_dir: Path, start: int, size: int) -> "UidLease":
        """Lease a free uid from [start, start + size); probing from a random offset keeps it O(1) when busy."""
        offset = random.randrange(size)
        for i in range(size):
            uid = start + (offset + i) % size
            fd = os.open(lease_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise UidExhaustedError(f"all {size} uids from {start} are leased; raise SandboxConfig.uid_range_size "
                                f"or lower pool_size / max_concurrent_runs")

    def release(self) -> None:
        """Give the uid back (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last fd drops the flock
            self._lock_fd = None
