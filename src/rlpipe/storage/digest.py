"""Content addresses: the sha256 of a file, read in chunks (checkpoints can be larger than memory)."""

from __future__ import annotations

import hashlib
from pathlib import Path

READ_CHUNK = 16 * 1024 * 1024  # 16 MiB reads: few system calls, flat memory


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at `path`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
