"""Reading a W&B run's transaction log (`run-<id>.wandb`), the file W&B writes beside every run,
offline or online, and `wandb sync` uploads from.

The file is a LevelDB-style log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB
blocks of records, each `crc32 (4) | length (2) | type (1) | data`, where a record that does not
fit a block is split into FIRST, MIDDLE..., LAST pieces and a block's last < 7 bytes are zero
padding. Each whole record is a `wandb.proto.wandb_internal_pb2.Record`. A file being written, or
left by a killed process, may end in a torn record: reading stops there.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """The whole records of the log, in order, up to the first torn or corrupt one."""
    data = path.read_bytes()
    if len(data) < HEADER.size:
        return  # W&B has not flushed the header yet
    ident, magic, version = HEADER.unpack_from(data)
    if (ident, magic, version) != (IDENT, MAGIC, VERSION):
        raise ValueError(f"{path} is not a W&B transaction log of version {VERSION} "
                         f"(header {ident!r} {magic:#x} {version})")
    pos, pieces = HEADER.size, b""
    while True:
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER.size:
            pos += left_in_block  # the block's zero padding
        if pos + RECORD_HEADER.size > len(data):
            return
        checksum, length, kind = RECORD_HEADER.unpack_from(data, pos)
        body = data[pos + RECORD_HEADER.size:pos + RECORD_HEADER.size + length]
        if len(body) < length or checksum != zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF:
            return  # torn tail: the writer had not finished this record
        pos += RECORD_HEADER.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pieces = body
        elif kind == MIDDLE:
            pieces += body
        elif kind == LAST:
            yield pieces + body


def history(path: Path) -> Iterator[dict[str, object]]:
    """Each history row (one `run.log` call) of the log, values decoded from their JSON. A rich value
    (a histogram) is stored as nested keys (`[tag, "_type"]`, `[tag, "bins"]`, ...): it comes back as
    one dict under its tag."""
    from wandb.proto.wandb_internal_pb2 import Record  # type: ignore[attr-defined] # re-exported per protobuf version

    for raw in records(path):
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, object] = {}
        for item in record.history.item:
            value = json.loads(item.value_json)
            if item.key:
                row[item.key] = value
            else:
                *outer, last = item.nested_key
                node = row
                for key in outer:
                    node = node.setdefault(key, {})  # type: ignore[assignment]
                node[last] = value
        yield row


def run_logs(root: Path, run_id: str) -> list[Path]:
    """The transaction logs of W&B run `run_id` under `root` (the `dir` given to `wandb.init`): one per
    time the run was opened (W&B starts a new `<mode>-run-<time>-<id>` directory each time)."""
    return sorted((root / "wandb").glob(f"*run-*-{run_id}/run-{run_id}.wandb"))
