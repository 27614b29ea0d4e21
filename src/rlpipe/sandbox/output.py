"""Capture one output stream of a sandbox with a byte cap, and decode it without ever raising.

The code under test controls its output, so memory use must not: chunks are read incrementally and at
most `limit` bytes are ever kept, however much the program writes.
"""

import asyncio
import codecs
from collections.abc import Callable

CHUNK_BYTES = 64 * 1024


class BoundedCapture:
    """Keeps the first `limit` bytes of a stream; calls on_overflow once when the program writes more."""

    def __init__(self, limit: int, on_overflow: Callable[[], None]) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False
        self._on_overflow = on_overflow

    async def drain(self, stream: asyncio.StreamReader) -> None:
        """Read to EOF; bytes past the cap are read and dropped so the writer is never left blocked."""
        while chunk := await stream.read(CHUNK_BYTES):
            room = self.limit - len(self.data)
            if len(chunk) <= room:
                self.data += chunk
                continue
            self.data += chunk[:room]
            if not self.truncated:
                self.truncated = True
                self._on_overflow()


def decode_output(data: bytes, truncated: bool) -> tuple[str, bool]:
    """UTF-8 text and whether invalid bytes were replaced (U+FFFD).

    A cut at the byte cap may split a multi-byte character; that partial tail is dropped rather than
    counted as invalid output.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        return decoder.decode(data, final=not truncated), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True
