"""What reading a data file did: rows read, skipped (and why), truncated; the one line a recipe prints.

    data: train.jsonl: 1,000 rows read, 12 skipped (7 malformed JSON, 5 too long for max_length=1024),
    30 truncated (cut to max_length=1024)
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .readers import DataError

MAX_ERRORS = 20  # skipped rows whose message is kept (the first ones)


@dataclass
class DataStats:
    rows: int = 0
    """Rows read, bad ones included."""
    kept: int = 0
    """Examples built (a KTO pair row gives two)."""
    bad_rows: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_empty: int = 0
    errors: list[str] = field(default_factory=list)
    """The first MAX_ERRORS skipped rows' messages."""
    reasons: Counter = field(default_factory=Counter)
    """Bad rows by reason: 'malformed JSON', 'invalid UTF-8', "missing 'response'", ..."""
    source: str = ""
    max_length: int = 0
    truncation: str = ""

    def skip(self, error: DataError) -> None:
        """Count a bad row that was read (and counted in ``rows``) but is skipped."""
        self.bad_rows += 1
        self.reasons[reason(error)] += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(str(error))

    def on_bad_row(self, skip_bad_rows: bool) -> Callable[[DataError], None] | None:
        """The ``read_records`` callback for rows the reader rejects: None (raise) unless skipping."""
        if not skip_bad_rows:
            return None

        def skip_read(error: DataError) -> None:
            self.rows += 1
            self.skip(error)

        return skip_read

    @property
    def skipped(self) -> int:
        return self.bad_rows + self.dropped_too_long + self.dropped_empty

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        return {
            f"{prefix}rows": self.rows,
            f"{prefix}kept": self.kept,
            f"{prefix}bad_rows": self.bad_rows,
            f"{prefix}truncated": self.truncated,
            f"{prefix}dropped_too_long": self.dropped_too_long,
            f"{prefix}dropped_empty": self.dropped_empty,
        }

    def describe(self, source: str | None = None) -> str:
        return describe(self, source)


def reason(error: DataError) -> str:
    """A short label for why a row was skipped: the error's kind, else the field at fault."""
    if error.kind:
        return error.kind
    if error.field is None:
        return "bad row"
    top = error.field.split("[")[0].split(".")[0]
    return f"missing '{top}'" if error.problem.startswith("missing") else f"bad '{top}'"


def _n(x: int) -> str:
    return f"{x:,}"


def _rows(x: int) -> str:
    return f"{x:,} row" if x == 1 else f"{x:,} rows"


def _skip_reasons(stats: DataStats) -> list[str]:
    parts = [f"{_n(n)} {why}" for why, n in stats.reasons.most_common()]
    if stats.dropped_too_long:
        limit = f" for max_length={stats.max_length}" if stats.max_length else ""
        parts.append(f"{_n(stats.dropped_too_long)} too long{limit}")
    if stats.dropped_empty:
        parts.append(f"{_n(stats.dropped_empty)} with no tokens to train on")
    return parts


def describe(stats: DataStats, source: str | None = None) -> str:
    """One line: rows read, skipped (with the reasons), truncated; then, when rows were
    skipped as bad, a second line with the first one's error so the user can find it."""
    src = source or stats.source or "data"
    reasons = _skip_reasons(stats)
    line = f"data: {src}: {_rows(stats.rows)} read, {_n(stats.skipped)} skipped"
    if reasons:
        line += f" ({', '.join(reasons)})"
    line += f", {_n(stats.truncated)} truncated"
    if stats.truncated:
        line += f" (cut to max_length={stats.max_length})" if stats.max_length else ""
    if stats.kept != stats.rows - stats.skipped:  # KTO: a pair row gives two examples
        line += f", {_n(stats.kept)} examples"
    if stats.errors:
        line += f"\n  first skipped row: {stats.errors[0]}"
    return line


def announce(stats: DataStats) -> None:
    """Print ``describe(stats)`` to stderr once (the main rank), at the start of a run: rows that
    were skipped or truncated must not be found only later in metrics.jsonl."""
    from relign import distributed  # torch: relign.data stays light for the CLI (DataError)

    if distributed.is_main():
        print(describe(stats), file=sys.stderr, flush=True)


def require_examples(stats: DataStats) -> None:
    """Stop when nothing is left to train on, saying why (an empty file is caught by the reader)."""
    if stats.kept:
        return
    reasons = ", ".join(_skip_reasons(stats)) or "none usable"
    hint = ""
    if stats.dropped_too_long:
        hint = "; raise data.max_length" + (" or set data.truncation=truncate" if stats.truncation == "drop" else "")
    first = f"; first: {stats.errors[0]}" if stats.errors else ""
    what = "the only row was skipped" if stats.rows == 1 else f"all {_rows(stats.rows)} skipped"
    raise DataError(stats.source, None, None, f"no usable rows: {what} ({reasons}){hint}{first}")
