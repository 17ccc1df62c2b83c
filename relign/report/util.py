"""Small pure helpers of the report: number text, escaping, JSON safe inside ``<script>``, assets.

Everything here is shared by the page's sections (load, charts, traces, eval, search, compare)
and depends on nothing else of relign.
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

REPORT_FILE = "report.html"
MAX_TEXT_CHARS = 8000  # prompts and response texts longer than this are cut

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f")


# --------------------------------------------------------------------------- values


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> float | None:
    return float(v) if _is_num(v) and math.isfinite(v) else None


def _num_or(v: Any, default: float = 0.0) -> float:
    return float(v) if _is_num(v) else default


def _as_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if _is_num(v) and math.isfinite(v):
        return v > 0
    return None


def _first(d: dict[str, Any], keys: Iterable[str]) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return _clean(d[k])
    return None


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"metrics": {"accuracy": 1}} -> {"metrics/accuracy": 1}; lists stay whole."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


# --------------------------------------------------------------------------- JSON


def _clean(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become None (JSON.parse rejects NaN and Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return str(x)


def _json(x: Any) -> str:
    return json.dumps(_clean(x), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _script_json(x: Any) -> str:
    """JSON safe inside <script>: no '<' (so no '</script>' or '<!--'), no '>' or '&' either."""
    return (_json(x).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


# --------------------------------------------------------------------------- text


def fmt(value: Any) -> str:
    """Short number text: 4 significant digits, integers as integers, tiny/huge in e-notation."""
    if value is None:
        return "—"
    if not _is_num(value):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer() and abs(value) < 1e15):
        return str(int(value))
    if not math.isfinite(value):
        return str(value)
    a = abs(value)
    if a >= 1e6 or a < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{seconds:.1f}s"


def _cut(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n… [{len(text) - limit} more characters]"


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return fmt(v)
    return v if isinstance(v, str) else json.dumps(_clean(v), ensure_ascii=False)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "metric"


def _cell(v: Any) -> str:
    return html.escape(fmt(v) if _is_num(v) else _cut(_text(v), 500))


def _kv_table(d: dict[str, Any], table_id: str = "") -> str:
    ident = f' id="{table_id}"' if table_id else ""
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_cell(v)}</td></tr>" for k, v in d.items())
    return f'<table class="kv"{ident}>{rows}</table>'


# --------------------------------------------------------------------------- page assets


@functools.lru_cache(maxsize=None)
def asset(name: str) -> str:
    """relign/report_assets/NAME, to be inlined into the page's <style> or <script>.

    Read with importlib.resources so it works from a wheel as from a checkout.
    """
    text = resources.files("relign").joinpath("report_assets").joinpath(name).read_text(encoding="utf-8")
    if re.search(r"</(script|style)", text, re.I):  # would end the inline block it goes into
        raise ValueError(f"report_assets/{name} must not contain '</script' or '</style'")
    return text


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL file (at most ``limit``); a cut or bad line is skipped, not fatal."""
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    with open(path, errors="replace") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
