"""Validate and normalize raw records into the shapes in DESIGN.md (SFT for now).

An SFT record is one of:

* ``{"messages": [{"role", "content"}, ...]}`` — chat, loss on every assistant turn;
* ``{"prompt": str, "response": str}`` — raw text, loss on the response;
* ``{"text": str}`` — plain language modelling, loss on everything.

Each check raises ``DataError`` naming the file, the row and the field.
"""

from __future__ import annotations

import json
from typing import Any

from .readers import DataError

ROLES = ("system", "user", "assistant", "tool")
# Which role may follow which (None = the start of the conversation).
_NEXT = {
    None: {"system", "user"},
    "system": {"user"},
    "user": {"assistant"},
    "assistant": {"user", "tool"},
    "tool": {"tool", "assistant"},
}


def _maybe_json(value: Any) -> Any:
    # CSV and some parquet exports store the message list as a JSON string.
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def check_messages(messages: Any, source: str, row: int, key: str = "messages") -> list[dict[str, str]]:
    messages = _maybe_json(messages)
    if not isinstance(messages, list):
        raise DataError(source, row, key, f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise DataError(source, row, key, "empty list of messages")
    out = []
    prev = None
    for i, msg in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(msg, dict):
            raise DataError(source, row, where, f"expected an object with role and content, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise DataError(source, row, f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise DataError(source, row, f"{where}.content", f"expected a string, got {type(content).__name__}")
        if role not in _NEXT[prev]:
            after = f"after '{prev}'" if prev else "as the first message"
            allowed = " or ".join(sorted(_NEXT[prev]))
            raise DataError(source, row, f"{where}.role", f"role '{role}' out of order {after} (expected {allowed})")
        out.append({"role": role, "content": content})
        prev = role
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(source, row, key, "no assistant message to train on")
    return out


def _text(record: dict, key: str, source: str, row: int, *, allow_empty: bool = False) -> str:
    if key not in record or record[key] is None:
        raise DataError(source, row, key, "missing")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(source, row, key, f"expected a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(source, row, key, "empty")
    return value


def normalize_sft(
    record: Any,
    source: str,
    row: int,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
) -> dict[str, Any]:
    """Return ``{"messages": [...]}``, ``{"prompt", "response"}`` or ``{"text"}``."""
    if not isinstance(record, dict):
        raise DataError(source, row, None, f"expected an object, got {type(record).__name__}")
    if messages_key in record and record[messages_key] is not None:
        return {"messages": check_messages(record[messages_key], source, row, messages_key)}
    if prompt_key in record or response_key in record:
        return {
            "prompt": _text(record, prompt_key, source, row, allow_empty=True),
            "response": _text(record, response_key, source, row),
        }
    if "text" in record:
        return {"text": _text(record, "text", source, row)}
    fields = ", ".join(map(str, record)) or "none"
    raise DataError(
        source, row, messages_key,
        f"missing: an SFT row needs '{messages_key}', or '{prompt_key}' and '{response_key}', or 'text' (found: {fields})",
    )
