"""Reading a user's data file as rows: JSON Lines, Parquet, or a directory saved by Hugging Face `datasets`.

Every row keeps where it came from ("data.jsonl line 7"), so whatever is wrong with it later (a
missing column, an empty prompt, a duplicate id) is reported at that line. Parquet needs pyarrow and
saved datasets need `datasets`; neither is one of rlpipe's dependencies, so a missing one is an error
that says what to install (JSON Lines needs nothing).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.schemas.dataset import DatasetFormat

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(ValueError):
    """Data that cannot be used; the message names the file, the line or row, and the field."""


class DataNotFound(DatasetError):
    """A data path that does not exist here (it may on the machine that reads it: see `resolved`)."""


@dataclass(frozen=True)
class Record:
    where: str  # "data.jsonl line 7", "data.parquet row 7"
    values: dict[str, Any]


def resolved(path: str) -> Path:
    """`path` on this machine, or DatasetError naming it as given and as resolved here."""
    found = Path(path).expanduser().resolve()
    if not found.exists():
        raise DataNotFound(f"{path}: no such file or directory ({found} on {socket.gethostname()}; a relative "
                           "path resolves against the working directory of the process reading it)")
    return found


def data_format(path: Path, given: DatasetFormat) -> DatasetFormat:
    if given != "auto":
        return given
    if path.is_dir():
        return "hf_disk"
    if path.suffix.lower() in JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    raise DatasetError(f"{path}: cannot tell its format from the name: name it *.jsonl or *.parquet, or set "
                       "env.dataset.format ('jsonl', 'parquet' or 'hf_disk')")


def read_records(path: str, given: DatasetFormat, split: str | None) -> list[Record]:
    """The rows of the file or saved dataset at `path`, in order; DatasetError if it cannot be read or is empty."""
    found = resolved(path)
    kind = data_format(found, given)
    if kind != "hf_disk" and split is not None:
        raise DatasetError(f"{path}: a split ({split!r}) is set, but only a saved DatasetDict has splits: remove it")
    if kind == "jsonl":
        records = read_jsonl(found, path)
    elif kind == "parquet":
        records = read_parquet(found, path)
    else:
        records = read_saved_dataset(found, path, split)
    if not records:
        raise DatasetError(f"{path}: has no rows")
    return records


def read_jsonl(found: Path, shown: str) -> list[Record]:
    """One JSON object per line; blank lines are skipped, line numbers count them."""
    if found.is_dir():
        raise DatasetError(f"{shown}: is a directory, not a JSON Lines file")
    records = []
    with found.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{shown} line {number}"
            try:
                values = json.loads(line.rstrip("\r\n"))  # else an error at its end reads as on the next line
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(values, dict):
                raise DatasetError(f"{where}: a row must be a JSON object, found {type(values).__name__}")
            records.append(Record(where, values))
    return records


def read_parquet(found: Path, shown: str) -> list[Record]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found, import-untyped, unused-ignore]  # optional, maybe untyped
    except ImportError:
        raise DatasetError(f"{shown}: reading Parquet needs pyarrow, which is not installed where this runs: "
                           "`pip install pyarrow` into the workers' environment, or convert the file to JSON "
                           "Lines") from None
    rows = pq.read_table(found).to_pylist()
    return [Record(f"{shown} row {index}", row) for index, row in enumerate(rows, start=1)]


def read_saved_dataset(found: Path, shown: str, split: str | None) -> list[Record]:
    """A `datasets` Dataset or DatasetDict saved with save_to_disk (a DatasetDict needs `split`)."""
    try:
        import datasets  # type: ignore[import-not-found, import-untyped, unused-ignore]  # optional, maybe untyped
    except ImportError:
        raise DatasetError(f"{shown}: reading a saved Hugging Face dataset needs `datasets`, which is not "
                           "installed where this runs: `pip install datasets` into the workers' environment, or "
                           "write the rows to JSON Lines (`dataset.to_json(path)`)") from None
    try:
        loaded = datasets.load_from_disk(str(found))
    except (FileNotFoundError, ValueError) as exc:
        raise DatasetError(f"{shown}: not a dataset saved with save_to_disk ({exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            given = "" if split is None else f", not {split!r}"
            raise DatasetError(f"{shown}: is a DatasetDict with splits {', '.join(loaded)}: set env.dataset.split "
                               f"(eval_split for eval_path) to one of them{given}")
        loaded, shown = loaded[split], f"{shown} (split {split})"
    elif split is not None:
        raise DatasetError(f"{shown}: is a single Dataset, without splits: remove the split {split!r}")
    return [Record(f"{shown} row {index}", dict(row)) for index, row in enumerate(loaded, start=1)]
