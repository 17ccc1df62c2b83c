"""Validate and normalize raw records into the shapes in DESIGN.md (SFT for now).

An SFT record is one of:

* ``{"messages": [{"role", "content"}, ...]}`` — chat, loss on every assistant turn;
* ``{"messages": [...], "completion_start": k}`` — TRL's conversational prompt/completion
  (``prompt`` and ``completion`` as message lists): loss on the assistant turns from message
  ``k`` on, never on turns of the prompt;
* ``{"prompt": str, "response": str}`` — raw text, loss on the response;
* ``{"text": str}`` — plain language modelling, loss on everything.

Raw rows may name the response ``completion`` (TRL) instead of ``response``. Each check raises
``DataError`` naming the file, the row and the field.
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


def _is_message_list(value: Any) -> bool:
    """A list, or a JSON string of one whose items all have a role (CSV / parquet exports).
    A text prompt such as ``"[1, 2, 3]"`` stays text."""
    if isinstance(value, list):
        return True
    parsed = _maybe_json(value)
    return isinstance(parsed, list) and bool(parsed) and all(isinstance(m, dict) and "role" in m for m in parsed)


def check_messages(messages: Any, source: str, row: int, key: str = "messages") -> list[dict[str, str]]:
    out = check_turns(messages, source, row, key)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(source, row, key, "no assistant message to train on")
    return out


def check_turns(messages: Any, source: str, row: int, key: str, prev: str | None = None) -> list[dict[str, str]]:
    """Validate a list of messages that follows a message of role ``prev`` (None: the start)."""
    messages = _maybe_json(messages)
    if not isinstance(messages, list):
        raise DataError(source, row, key, f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise DataError(source, row, key, "empty list of messages")
    out = []
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


TRL_RESPONSE_KEY = "completion"  # TRL's name for the response; read when data.response_key is left at "response"


def reply_key(record: dict, response_key: str) -> str:
    """The field that holds the response: ``response_key``, or TRL's ``completion`` when the
    key is the default ``response`` and the row has no such field."""
    if response_key == "response" and response_key not in record and TRL_RESPONSE_KEY in record:
        return TRL_RESPONSE_KEY
    return response_key


def show_fields(names: Any) -> str:
    """Field names for a message (undecodable bytes shown escaped, not crashing the print)."""
    return ", ".join(str(n).encode("utf-8", "backslashreplace").decode() for n in names) or "none"


def sft_expected(prompt_key: str = "prompt", response_key: str = "response", messages_key: str = "messages") -> str:
    alt = " (or 'completion')" if response_key == "response" else ""
    return f"'{messages_key}', or '{prompt_key}' and '{response_key}'{alt}, or 'text'"


def sft_columns_ok(columns: Any, prompt_key: str = "prompt", response_key: str = "response",
                   messages_key: str = "messages") -> bool:
    cols = set(columns)
    reply = reply_key({c: None for c in cols}, response_key)
    return messages_key in cols or {prompt_key, reply} <= cols or "text" in cols


def _conversation(record: dict, source: str, row: int, prompt_key: str, key: str) -> dict[str, Any]:
    """TRL's conversational prompt/completion. A text side becomes one user (prompt) or
    assistant (completion) message; the loss covers the completion's assistant turns only."""
    prompt, reply = record.get(prompt_key), record.get(key)
    if prompt is None:
        raise DataError(source, row, prompt_key, "missing")
    if reply is None:
        raise DataError(source, row, key, "missing")
    if _is_message_list(prompt):
        before = check_turns(prompt, source, row, prompt_key)
    else:
        before = [{"role": "user", "content": _text(record, prompt_key, source, row)}]
    if _is_message_list(reply):
        after = check_turns(reply, source, row, key, prev=before[-1]["role"])
    else:
        after = [{"role": "assistant", "content": _text(record, key, source, row)}]
        check_turns(after, source, row, key, prev=before[-1]["role"])
    if not any(m["role"] == "assistant" for m in after):
        raise DataError(source, row, key, "no assistant message to train on")
    return {"messages": before + after, "completion_start": len(before)}


def normalize_sft(
    record: Any,
    source: str,
    row: int,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
) -> dict[str, Any]:
    """Return ``{"messages": [...][, "completion_start": k]}``, ``{"prompt", "response"}`` or ``{"text"}``."""
    if not isinstance(record, dict):
        raise DataError(source, row, None, f"expected an object, got {type(record).__name__}")
    if messages_key in record and record[messages_key] is not None:
        return {"messages": check_messages(record[messages_key], source, row, messages_key)}
    key = reply_key(record, response_key)
    if prompt_key in record or key in record:
        if _is_message_list(record.get(prompt_key)) or _is_message_list(record.get(key)):
            return _conversation(record, source, row, prompt_key, key)
        return {
            "prompt": _text(record, prompt_key, source, row, allow_empty=True),
            "response": _text(record, key, source, row),
        }
    if "text" in record:
        return {"text": _text(record, "text", source, row)}
    raise DataError(
        source, row, messages_key,
        f"missing: an SFT row needs {sft_expected(prompt_key, response_key, messages_key)} (found: {show_fields(record)})",
    )


def require_columns(record: Any, source: str, ok: bool, expected: str) -> None:
    """A table (CSV, parquet, Arrow) with the wrong columns is the file's problem, not each
    row's: stop at its first row, even when skipping bad rows, and list what it has."""
    if not ok:
        raise DataError(source, None, None, f"wrong columns: the file has {show_fields(record)}; expected {expected}")
