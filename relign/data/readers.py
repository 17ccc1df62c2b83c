"""Read records from JSON, JSONL, CSV, Parquet, Arrow, a ``datasets`` save_to_disk folder or a hub id.

Every reader yields ``(row_number, record)`` with 1-based row numbers as a person counts
them in the file (for JSONL: the line number; for CSV: the data row, header not counted), so
errors can point at the exact row.

Bad text is a row error, never a crash further on: invalid UTF-8 bytes, a lone surrogate
(``"\\ud800"`` is valid JSON but not text, and the tokenizer raises on it) and NUL characters
(a sign of a binary or corrupted file; relign does not guess what was meant, the row is
rejected). A row error stops the read with a ``DataError`` naming the file, the row and the
field, or, given ``on_bad_row``, is handed to it and the read goes on (``data.skip_bad_rows``).
"""

from __future__ import annotations

import codecs
import csv
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A malformed row or an unreadable source. The message names the file, the row and the field.

    ``kind`` is a short label for counting skipped rows (``malformed JSON``, ``invalid UTF-8``...);
    None for a problem with a field, which is counted by the field's name."""

    def __init__(self, source: str, row: int | None, field: str | None, problem: str, *, kind: str | None = None):
        self.source, self.row, self.field, self.problem, self.kind = source, row, field, problem, kind
        where = [str(source)]
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {problem}")


class _Bad:
    """A row error yielded by a reader, so the read can go on past it when skipping."""

    def __init__(self, error: DataError):
        self.error = error


# One source of rows: (file the row is in, row number, record or _Bad).
Rows = Iterator[tuple[str, int, Any]]

# --------------------------------------------------------------------------- text checks

_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")


def _find_bad_char(value: Any, field: str = "") -> tuple[str, int, str] | None:
    """The first NUL or surrogate in any string of a record: (field path, position, char)."""
    if isinstance(value, str):
        m = _BAD_CHAR.search(value)
        return (field, m.start(), m.group()) if m else None
    if isinstance(value, dict):
        items = ((f"{field}.{k}" if field else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{field}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for path, v in items:
        found = _find_bad_char(v, path)
        if found:
            return found
    return None


def check_text(record: Any, source: str, row: int, *, undecoded_bytes: bool = False) -> DataError | None:
    """A DataError for the first character in ``record`` that is not text, else None.

    ``undecoded_bytes``: the file was decoded with ``surrogateescape``, so U+DC80..U+DCFF
    stand for bytes that are not UTF-8 (and are reported as such)."""
    found = _find_bad_char(record)
    if found is None:
        return None
    field, pos, ch = found
    code = ord(ch)
    field = field or None
    if ch == "\x00":
        return DataError(source, row, field, f"NUL character at position {pos} (a binary or corrupted file?)",
                         kind="with NUL characters")
    if undecoded_bytes and 0xDC80 <= code <= 0xDCFF:
        return DataError(source, row, field, f"invalid UTF-8: byte 0x{code - 0xDC00:02x} at position {pos} "
                         "(save the file as UTF-8)", kind="invalid UTF-8")
    return DataError(source, row, field, f"lone surrogate \\u{code:04x} at position {pos} is not valid Unicode text "
                     "(a broken escape in the file?)", kind="with lone surrogates")


# --------------------------------------------------------------------------- file readers


def _decode_line(raw: bytes, source: str, lineno: int) -> str | _Bad:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _Bad(DataError(source, lineno, None, f"invalid UTF-8: byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                              "of the line (save the file as UTF-8)", kind="invalid UTF-8"))


def _json_problem(line: str, e: json.JSONDecodeError) -> str:
    if "\x00" in line:  # raw NUL bytes are not JSON; say so rather than "invalid control character"
        return f"NUL byte at column {line.index(chr(0)) + 1} (a binary or corrupted file?)"
    return f"invalid JSON ({e.msg} at column {e.colno})"


def _read_jsonl(path: Path) -> Rows:
    source = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # Windows editors write one; it is not part of the data
            line = _decode_line(raw, source, lineno)
            if isinstance(line, _Bad):
                yield source, lineno, line
                continue
            if not line.strip():
                continue
            try:
                yield source, lineno, json.loads(line)
            except json.JSONDecodeError as e:
                kind = "with NUL characters" if "\x00" in line else "malformed JSON"
                yield source, lineno, _Bad(DataError(source, lineno, None, _json_problem(line, e), kind=kind))


def _read_json(path: Path) -> Rows:
    source = str(path)
    raw = path.read_bytes()
    try:
        text, undecoded = raw.decode("utf-8-sig"), False
    except UnicodeDecodeError:
        # Decode what can be decoded; the bad bytes become U+DC80..U+DCFF and are reported per record.
        text, undecoded = raw.decode("utf-8-sig", errors="surrogateescape"), True
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # Many ".json" files are really JSON lines.
        if e.msg == "Extra data":
            yield from _read_jsonl(path)
            return
        where = f"line {e.lineno}, column {e.colno}"
        raise DataError(source, None, None, f"invalid JSON ({e.msg} at {where})", kind="malformed JSON") from None
    if isinstance(data, dict):
        # {"data": [...]} / {"train": [...]} style files, or a single record
        lists = [v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
        data = lists[0] if len(lists) == 1 else [data]
    if not isinstance(data, list):
        raise DataError(source, None, None, f"expected a list of records, got {type(data).__name__}")
    for i, rec in enumerate(data, 1):
        bad = check_text(rec, source, i, undecoded_bytes=True) if undecoded else None
        yield source, i, _Bad(bad) if bad else rec


def _read_csv(path: Path) -> Rows:
    source = str(path)
    # surrogateescape: a bad byte costs its row, not the file. CSV has no escapes, so any
    # U+DC80..U+DCFF in a cell was such a byte.
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        i = 0
        try:
            for i, row in enumerate(reader, 1):
                if None in row:  # more cells than the header has columns
                    n = len(reader.fieldnames or [])
                    yield source, i, _Bad(DataError(source, i, None, f"{n + len(row[None])} values for {n} columns",
                                                    kind="malformed CSV"))
                    continue
                bad = check_text(row, source, i, undecoded_bytes=True)
                yield source, i, _Bad(bad) if bad else dict(row)
        except csv.Error as e:
            raise DataError(source, i + 1, None, f"malformed CSV ({e})", kind="malformed CSV") from None


def _read_table(table, source: str) -> Rows:
    for i, row in enumerate(table.to_pylist(), 1):
        yield source, i, row


def _read_parquet(path: Path) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowException as e:
        raise DataError(str(path), None, None, f"not a readable parquet file ({e})") from None
    yield from _read_table(table, str(path))


def _read_arrow(path: Path) -> Rows:
    import pyarrow as pa

    # datasets writes the streaming format; plain Arrow IPC files use the file format.
    try:
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_stream(src).read_all()
    except pa.ArrowInvalid:
        try:
            with pa.memory_map(str(path)) as src:
                table = pa.ipc.open_file(src).read_all()
        except pa.ArrowException as e:
            raise DataError(str(path), None, None, f"not a readable Arrow file ({e})") from None
    yield from _read_table(table, str(path))


def _read_dataset(ds, source: str) -> Rows:
    for i, row in enumerate(ds, 1):
        yield source, i, row


READERS: dict[str, Callable[[Path], Rows]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
    ".arrow": _read_arrow,
}
# Formats where every row has the same columns: a missing column is the file's problem, not a row's.
TABULAR = (".csv", ".parquet", ".arrow")


def is_tabular(path: str) -> bool:
    return Path(path).suffix.lower() in TABULAR


# --------------------------------------------------------------------------- entry point


def read_records(
    path: str,
    split: str = "train",
    *,
    max_rows: int = 0,
    on_bad_row: Callable[[DataError], None] | None = None,
    key: str | None = None,
) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, record)`` from a file, a save_to_disk folder or a hub dataset id.

    A bad row (invalid JSON or UTF-8, a NUL or a lone surrogate in a string) raises DataError,
    or goes to ``on_bad_row`` and the read goes on. ``max_rows`` counts bad rows too (rows
    read). ``key`` is the config key the path came from (``data.path``): errors about the
    path itself name it. A source with no rows at all is an error."""
    label = f"{key}={path}" if key else path
    n = 0
    for source, row, record in _rows(path, split, label):
        if max_rows and n >= max_rows:
            break
        n += 1
        error = record.error if isinstance(record, _Bad) else check_text(record, source, row)
        if error is None:
            yield row, record
        elif on_bad_row is None:
            raise error
        else:
            on_bad_row(error)
    if n == 0:
        raise DataError(label, None, None, "0 rows read: the file is empty" if Path(path).expanduser().is_file()
                        else "0 rows read: no records in it")


def _rows(path: str, split: str, label: str) -> Rows:
    """Rows of whatever ``path`` names; OS errors (permissions, a vanished file) become DataErrors."""
    p = Path(path).expanduser()
    try:
        if p.is_file():
            suffix = p.suffix.lower()
            if suffix not in READERS:
                raise DataError(label, None, None, f"unknown file type '{suffix}'; use one of {', '.join(READERS)}")
            yield from READERS[suffix](p)
        elif p.is_dir():
            yield from _read_dir(p, split, label)
        elif not _looks_like_hub_id(path):
            raise DataError(label, None, None, _not_found(p))
        else:
            yield from _read_hub(path, split, label)
    except OSError as e:
        raise DataError(label, None, None, f"cannot read {e.filename or path}: {e.strerror or e}") from None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


# Suffixes that say "a file": such a path is never taken for a hub id.
_FILE_SUFFIXES = (*READERS, ".txt", ".tsv", ".gz", ".zip", ".yaml", ".yml", ".xlsx")


def _looks_like_hub_id(path: str) -> bool:
    """``name``, ``org/name`` or ``org/name:config``, with no file suffix and no local first folder
    (``data/train`` next to a ``data/`` folder is a local path with a typo, not a dataset)."""
    if not _HUB_ID.match(path) or Path(path.split(":")[0]).suffix.lower() in _FILE_SUFFIXES:
        return False
    return "/" not in path or not Path(path.split("/")[0]).is_dir()


def _not_found(p: Path) -> str:
    if p.is_absolute():
        return "file not found"
    return f"file not found (looked in {Path.cwd()})"


def _read_dir(p: Path, split: str, label: str) -> Rows:
    if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        from datasets import DatasetDict, load_from_disk

        try:
            ds = load_from_disk(str(p))
        except (OSError, ValueError) as e:
            raise DataError(label, None, None, f"cannot load this datasets folder ({str(e).splitlines()[0]})") from None
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise DataError(label, None, None, f"no split '{split}' (has {', '.join(ds)})")
            ds = ds[split]
        yield from _read_dataset(ds, str(p))
        return
    # a folder of data files: take the ones whose name contains the split, else all of them
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in READERS)
    chosen = [f for f in files if split in f.stem] or files
    if not chosen:
        raise DataError(label, None, None, f"is a folder with no data files in it (expected a {', '.join(READERS)} file, "
                        "or a folder written by datasets' save_to_disk)")
    for f in chosen:
        yield from READERS[f.suffix.lower()](f)


# --------------------------------------------------------------------------- the hub

HUB_PROBE_TIMEOUT = 3.0
"""Seconds to wait for a TCP connection to the hub before saying it cannot be reached.
Without this check ``datasets`` retries for about 25-55 s before it gives up."""


def _hub_offline() -> bool:
    flags = (os.environ.get(v, "").strip().lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def _probe_hub(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """None when a TCP connection to the hub (or the HTTPS proxy) opens within ``timeout``,
    else why not. One try; it runs in a thread so a slow DNS lookup is bounded too."""
    import socket
    import urllib.parse
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    target = urllib.request.getproxies().get("https") or endpoint
    url = urllib.parse.urlsplit(target if "://" in target else f"http://{target}")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port}: {e.strerror or e}")

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return result[0] if result else f"{host}:{port}: no answer in {timeout:g} s"


def _read_hub(name: str, split: str, label: str) -> Rows:
    """A dataset id on the Hugging Face hub, optionally ``id:config``.

    With ``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``) only the local cache is tried.
    Otherwise one quick TCP probe first: when the hub cannot be reached the error comes at
    once instead of after ``datasets``' retries."""
    offline = _hub_offline()
    if not offline:
        why = _probe_hub()
        if why:
            raise DataError(label, None, None, f"not a local file or folder, and the Hugging Face hub cannot be reached "
                            f"({why}); give a local path, or set HF_HUB_OFFLINE=1 to use a cached copy")
    from datasets import load_dataset

    repo, config = (name.split(":", 1) + [None])[:2]
    try:
        ds = load_dataset(repo, config, split=split)
    except (OSError, ValueError) as e:  # DatasetNotFoundError, ConnectionError, unknown split ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if offline:
            problem = f"not a local file or folder, and no cached copy on this machine with HF_HUB_OFFLINE=1 ({first})"
        else:
            problem = f"not a local file or folder, and the hub could not load it ({first})"
        raise DataError(label, None, None, problem) from None
    yield from _read_dataset(ds, name)
