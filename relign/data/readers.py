"""Read records from JSON, JSONL, CSV, Parquet, Arrow, a ``datasets`` save_to_disk folder or a hub id.

Every reader yields ``(row_number, record)`` with 1-based row numbers as a person counts
them in the file (for JSONL: the line number), so errors can point at the exact row.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A malformed row. The message names the file, the row and the field."""

    def __init__(self, source: str, row: int | None, field: str | None, problem: str):
        self.source, self.row, self.field, self.problem = source, row, field, problem
        where = [str(source)]
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {problem}")


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(str(path), lineno, None, f"invalid JSON ({e.msg} at column {e.colno})") from None


def _read_json(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # Many ".json" files are really JSON lines.
        if e.msg == "Extra data":
            yield from _read_jsonl(path)
            return
        raise DataError(str(path), None, None, f"invalid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):
        # {"data": [...]} / {"train": [...]} style files, or a single record
        lists = [v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
        data = lists[0] if len(lists) == 1 else [data]
    if not isinstance(data, list):
        raise DataError(str(path), None, None, "expected a list of records")
    yield from enumerate(data, 1)


def _read_csv(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8", newline="") as f:
        for i, row in enumerate(csv.DictReader(f), 1):
            yield i, dict(row)


def _read_table(table) -> Iterator[tuple[int, Any]]:
    for i, row in enumerate(table.to_pylist(), 1):
        yield i, row


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    yield from _read_table(pq.read_table(path))


def _read_arrow(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa

    # datasets writes the streaming format; plain Arrow IPC files use the file format.
    try:
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_stream(src).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
    yield from _read_table(table)


def _read_dataset(ds) -> Iterator[tuple[int, Any]]:
    for i, row in enumerate(ds, 1):
        yield i, row


READERS = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
    ".arrow": _read_arrow,
}


def read_records(path: str, split: str = "train", *, max_rows: int = 0) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, record)`` from a file, a save_to_disk folder or a hub dataset id."""
    p = Path(path)
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix not in READERS:
            raise DataError(path, None, None, f"unknown file type '{suffix}'; use one of {', '.join(READERS)}")
        rows = READERS[suffix](p)
    elif p.is_dir():
        rows = _read_dir(p, split)
    elif path.startswith((".", "/", "~")) or p.suffix.lower() in READERS:
        raise DataError(path, None, None, "file not found")
    else:
        rows = _read_hub(path, split)
    for n, (row, record) in enumerate(rows):
        if max_rows and n >= max_rows:
            break
        yield row, record


def _read_dir(p: Path, split: str) -> Iterator[tuple[int, Any]]:
    if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(p))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise DataError(str(p), None, None, f"no split '{split}' (has {', '.join(ds)})")
            ds = ds[split]
        yield from _read_dataset(ds)
        return
    # a folder of data files: take the ones whose name contains the split, else all of them
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in READERS)
    chosen = [f for f in files if split in f.stem] or files
    if not chosen:
        raise DataError(str(p), None, None, "folder holds no dataset (no save_to_disk files, no data files)")
    for f in chosen:
        for row, rec in READERS[f.suffix.lower()](f):
            yield row, rec


def _read_hub(name: str, split: str) -> Iterator[tuple[int, Any]]:
    """A dataset id on the Hugging Face hub, optionally ``id:config``. Needs a network."""
    from datasets import load_dataset

    config = None
    if ":" in name:
        name, config = name.split(":", 1)
    ds = load_dataset(name, config, split=split)
    yield from _read_dataset(ds)
