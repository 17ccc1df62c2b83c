"""Preference records -> token ids: chosen/rejected pairs (RM, DPO family) and unpaired rows (KTO).

Normalized shapes (DESIGN.md, "Records"):

* pairs     ``{"prompt": str | messages, "chosen": str, "rejected": str}``, optionally with
            ``"prefix"`` (step-wise DPO: the reasoning steps both continuations share) and
            ``"margin"`` (a reward-model margin, Llama 2 style);
* unpaired  ``{"prompt": str | messages, "completion": str, "label": bool}``.

Accepted raw rows, besides those shapes:

* TRL's conversational pairs: ``chosen`` / ``rejected`` as whole conversations that share
  every message but the last (an assistant turn), with or without a separate ``prompt``;
* a ``system`` field (Orca-style data), which becomes the system message of chat rows;
* for KTO, paired rows: each gives a desirable (chosen) and an undesirable (rejected) example.

Encoding goes through ``data.sft.encode_sft``, so a prompt renders to the same ids as in SFT
and RL: the prompt and each response are tokenized apart (never a response re-tokenized
together with its prompt), and the two responses of a pair share the prompt's ids exactly,
which lets the trainer run the prompt once for both (``shared_prefix_token_logps``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .readers import DataError, is_tabular, read_records
from .records import _maybe_json, _text, check_messages, require_columns
from .sft import _encode, encode_sft
from .stats import DataStats, require_examples

TRUNCATION = ("truncate", "drop")


@dataclass
class PairExample:
    """Two rows ``[prompt | response]`` sharing their first ``prompt_len`` ids."""

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    prompt_len: int
    margin: float = 0.0

    def __len__(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids)


@dataclass
class UnpairedExample:
    input_ids: list[int]
    loss_mask: list[int]
    prompt_len: int
    label: bool

    def __len__(self) -> int:
        return len(self.input_ids)


# --------------------------------------------------------------------------- normalize


def pair_columns(chosen_key: str, rejected_key: str, prompt_key: str) -> tuple[set[str], str]:
    """Columns a table of pairs must have, and how to say so."""
    return {chosen_key, rejected_key}, (f"'{prompt_key}', '{chosen_key}' and '{rejected_key}' ('{prompt_key}' may be "
                                        f"left out when '{chosen_key}'/'{rejected_key}' are whole conversations)")


def unpaired_columns_ok(columns, completion_key: str, label_key: str, chosen_key: str, rejected_key: str) -> bool:
    cols = set(columns)
    return {completion_key, label_key} <= cols or {chosen_key, rejected_key} <= cols


def _prompt(raw: dict, key: str, source: str, row: int) -> str | list[dict[str, str]]:
    value = _maybe_json(raw.get(key))
    if isinstance(value, list):
        # a conversation that ends with the user (no assistant turn yet); check_messages wants
        # an assistant message, so validate it with a placeholder reply
        msgs = check_messages([*value, {"role": "assistant", "content": ""}], source, row, key)
        return msgs[:-1]
    return _text(raw, key, source, row, allow_empty=True)


def _reply(value: Any, key: str, source: str, row: int) -> tuple[list[dict[str, str]] | None, str]:
    """A response given as text, or as messages ending with the assistant's reply.

    Returns (the messages before the reply or None, the reply text)."""
    value = _maybe_json(value)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and value[0].get("role") == "assistant":
        content = value[0].get("content")
        if not isinstance(content, str) or not content.strip():
            raise DataError(source, row, f"{key}[0].content", "expected a non-empty string")
        return [], content  # TRL's explicit-prompt form: the reply alone
    if isinstance(value, list):
        msgs = check_messages(value, source, row, key)
        if msgs[-1]["role"] != "assistant":
            raise DataError(source, row, f"{key}[{len(msgs) - 1}].role", "the last message must be the assistant's reply")
        return msgs[:-1], msgs[-1]["content"]
    if not isinstance(value, str):
        raise DataError(source, row, key, f"expected a string or a list of messages, got {type(value).__name__}")
    if not value.strip():
        raise DataError(source, row, key, "empty")
    return None, value


def _with_system(prompt: str | list[dict[str, str]], system: str | None) -> str | list[dict[str, str]]:
    if system and isinstance(prompt, list) and not (prompt and prompt[0]["role"] == "system"):
        return [{"role": "system", "content": system}, *prompt]
    return prompt


def normalize_pair(
    raw: Any, source: str, row: int, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
    rejected_key: str = "rejected", prefix_key: str = "prefix",
) -> dict[str, Any]:
    """One raw row -> ``{"prompt", "chosen", "rejected"[, "prefix", "margin", "system"]}``."""
    if not isinstance(raw, dict):
        raise DataError(source, row, None, f"expected an object, got {type(raw).__name__}")
    for key in (chosen_key, rejected_key):
        if raw.get(key) is None:
            raise DataError(source, row, key, f"missing: a preference row needs '{chosen_key}' and '{rejected_key}'")
    c_ctx, chosen = _reply(raw[chosen_key], chosen_key, source, row)
    r_ctx, rejected = _reply(raw[rejected_key], rejected_key, source, row)
    if raw.get(prompt_key) is not None:
        prompt = _prompt(raw, prompt_key, source, row)
        for ctx, key in ((c_ctx, chosen_key), (r_ctx, rejected_key)):
            if ctx and ctx != prompt:  # earlier turns repeated in the reply must be the prompt's
                raise DataError(source, row, key, f"holds earlier turns that differ from '{prompt_key}'")
    elif c_ctx is not None and r_ctx is not None:
        if c_ctx != r_ctx:
            raise DataError(source, row, rejected_key, f"the conversation before the reply differs from '{chosen_key}'")
        if not c_ctx:
            raise DataError(source, row, chosen_key, "the conversation has no prompt before the assistant's reply")
        prompt = c_ctx
    else:
        raise DataError(source, row, prompt_key, "missing (or give chosen/rejected as whole conversations)")
    out: dict[str, Any] = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    system = raw.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise DataError(source, row, "system", f"expected a string, got {type(system).__name__}")
        out["system"] = system
    prefix = raw.get(prefix_key, raw.get("initial_reason_steps") if prefix_key == "prefix" else None)
    if prefix is not None:
        if not isinstance(prefix, str):
            raise DataError(source, row, prefix_key, f"expected a string, got {type(prefix).__name__}")
        out["prefix"] = prefix
    if raw.get("margin") is not None:
        m = raw["margin"]
        if isinstance(m, bool) or not isinstance(m, numbers.Real):
            raise DataError(source, row, "margin", f"expected a number, got {type(m).__name__}")
        out["margin"] = float(m)
    return out


def normalize_unpaired(
    raw: Any, source: str, row: int, *, prompt_key: str = "prompt", completion_key: str = "completion",
    label_key: str = "label",
) -> dict[str, Any]:
    """One raw KTO row -> ``{"prompt", "completion", "label"[, "system"]}``."""
    if not isinstance(raw, dict):
        raise DataError(source, row, None, f"expected an object, got {type(raw).__name__}")
    if raw.get(completion_key) is None:
        raise DataError(source, row, completion_key, f"missing: an unpaired row needs '{completion_key}' and '{label_key}'")
    ctx, completion = _reply(raw[completion_key], completion_key, source, row)
    if raw.get(prompt_key) is not None:
        prompt = _prompt(raw, prompt_key, source, row)
    elif ctx:
        prompt = ctx
    else:
        raise DataError(source, row, prompt_key, "missing")
    label = raw.get(label_key)
    if not isinstance(label, bool):
        raise DataError(source, row, label_key, f"expected true or false, got {label!r:.40}")
    out: dict[str, Any] = {"prompt": prompt, "completion": completion, "label": label}
    if isinstance(raw.get("system"), str):
        out["system"] = raw["system"]
    return out


# --------------------------------------------------------------------------- encode


def encode_prompt_response(
    tokenizer, prompt: str | list[dict[str, str]], response: str, *, chat_template: bool, system: str = "",
    prefix: str = "", eos: bool = True,
) -> tuple[list[int], list[int], int]:
    """Ids, loss mask and prompt length of ``prompt (+ prefix) + response``.

    ``prefix`` (step-wise DPO: the shared reasoning steps) is context, not a target: it is
    tokenized on its own after the prompt and masked. With ``eos=False`` the response has no
    end-of-text / end-of-turn token (a reasoning step that the answer continues after)."""
    if isinstance(prompt, list) or chat_template:
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        msgs = _with_system(msgs, system)
        # only the final reply is a target: assistant turns of a multi-turn prompt are context
        record = {"messages": [*msgs, {"role": "assistant", "content": prefix + response}], "completion_start": len(msgs)}
        ids, mask = encode_sft(tokenizer, record, source="", row=0)
        plen = next(i for i, m in enumerate(mask) if m)  # assistant content starts here
        if prefix or not eos:
            # re-split the assistant turn as [prefix (context)][response (target)](end of turn)
            p = _encode(tokenizer, prefix)
            r = _encode(tokenizer, response)
            tail = ids[plen:]
            end = tail[len(_encode(tokenizer, prefix + response)):] if eos else []
            ids = ids[:plen] + p + r + end
            plen += len(p)
            mask = [0] * plen + [1] * (len(r) + len(end))
        return ids, mask, plen
    text = f"{system}\n\n{prompt}" if system else prompt
    p = tokenizer(text, add_special_tokens=True)["input_ids"] if text else []
    p += _encode(tokenizer, prefix)
    r = _encode(tokenizer, response) + ([tokenizer.eos_token_id] if eos and tokenizer.eos_token_id is not None else [])
    return p + r, [0] * len(p) + [1] * len(r), len(p)


def _fit(ids: list[int], mask: list[int], plen: int, max_length: int, policy: str) -> tuple[list[int], list[int], str]:
    if len(ids) <= max_length:
        return ids, mask, "kept"
    if policy == "drop" or plen >= max_length - 1:
        return [], [], "dropped"
    return ids[:max_length], mask[:max_length], "truncated"


def _read(path: str, split: str, *, truncation: str, max_length: int, max_rows: int, skip_bad_rows: bool, key: str | None,
          check_columns: Callable[[dict], None]) -> tuple[DataStats, Iterator[tuple[int, Any]]]:
    """A preference file's read: its stats, and its rows (each counted); a table's first row is
    checked for the columns the reader needs (``check_columns``), before any row is used."""
    if truncation not in TRUNCATION:
        raise DataError(path, None, None, f"unknown truncation policy {truncation!r} (use {' or '.join(TRUNCATION)})")
    stats = DataStats(source=path, max_length=max_length, truncation=truncation)

    def rows() -> Iterator[tuple[int, Any]]:
        tabular = is_tabular(path)
        for row, raw in read_records(path, split, max_rows=max_rows, on_bad_row=stats.on_bad_row(skip_bad_rows), key=key):
            if tabular and isinstance(raw, dict):
                check_columns(raw)
                tabular = False
            stats.rows += 1
            yield row, raw

    return stats, rows()


def build_pair_examples(
    path: str, tokenizer, *, split: str = "train", max_length: int = 1024, truncation: str = "truncate",
    skip_bad_rows: bool = False, prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected",
    prefix_key: str = "prefix", chat_template: bool = True, system_prompt: str = "", max_rows: int = 0,
    step_eos: bool = False, key: str | None = None,
) -> tuple[list[PairExample], DataStats]:
    """Read, validate and tokenize a preference file into pairs.

    Rows with a ``prefix`` (step-wise DPO) end their chosen/rejected step without an end
    token unless ``step_eos``. Too-long pairs are cut to ``max_length`` (keeping the prompt)
    or dropped. A table with the wrong columns, or a file with no usable pair, raises
    DataError even with ``skip_bad_rows``. ``key`` (``data.path``) is named in errors about
    the path itself."""
    def check_columns(raw: dict) -> None:
        needed, expected = pair_columns(chosen_key, rejected_key, prompt_key)
        require_columns(raw, path, needed <= set(raw), expected)

    stats, rows = _read(path, split, truncation=truncation, max_length=max_length, max_rows=max_rows,
                        skip_bad_rows=skip_bad_rows, key=key, check_columns=check_columns)
    out: list[PairExample] = []
    for row, raw in rows:
        try:
            rec = normalize_pair(raw, path, row, prompt_key=prompt_key, chosen_key=chosen_key,
                                 rejected_key=rejected_key, prefix_key=prefix_key)
            prefix = rec.get("prefix", "")
            common = dict(chat_template=chat_template, system=rec.get("system", system_prompt), prefix=prefix,
                          eos=step_eos or not prefix)
            c_ids, c_mask, plen = encode_prompt_response(tokenizer, rec["prompt"], rec["chosen"], **common)
            r_ids, r_mask, plen_r = encode_prompt_response(tokenizer, rec["prompt"], rec["rejected"], **common)
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.skip(e)
            continue
        if plen != plen_r or c_ids[:plen] != r_ids[:plen]:  # pragma: no cover - both come from one prompt
            raise DataError(path, row, prompt_key, "chosen and rejected do not share the prompt's tokens")
        c_ids, c_mask, oc = _fit(c_ids, c_mask, plen, max_length, truncation)
        r_ids, r_mask, orj = _fit(r_ids, r_mask, plen, max_length, truncation)
        if "dropped" in (oc, orj):
            stats.dropped_too_long += 1
            continue
        stats.truncated += "truncated" in (oc, orj)
        out.append(PairExample(c_ids, c_mask, r_ids, r_mask, plen, rec.get("margin", 0.0)))
    stats.kept = len(out)
    require_examples(stats)
    return out, stats


def build_unpaired_examples(
    path: str, tokenizer, *, split: str = "train", max_length: int = 1024, truncation: str = "truncate",
    skip_bad_rows: bool = False, prompt_key: str = "prompt", completion_key: str = "completion", label_key: str = "label",
    chosen_key: str = "chosen", rejected_key: str = "rejected", chat_template: bool = True, system_prompt: str = "",
    max_rows: int = 0, key: str | None = None,
) -> tuple[list[UnpairedExample], DataStats]:
    """Read a KTO file: unpaired rows, or pairs split into a desirable and an undesirable row."""
    def check_columns(raw: dict) -> None:
        ok = unpaired_columns_ok(raw, completion_key, label_key, chosen_key, rejected_key)
        require_columns(raw, path, ok, f"'{prompt_key}', '{completion_key}' and '{label_key}' (or paired "
                                       f"'{prompt_key}', '{chosen_key}' and '{rejected_key}')")

    stats, rows = _read(path, split, truncation=truncation, max_length=max_length, max_rows=max_rows,
                        skip_bad_rows=skip_bad_rows, key=key, check_columns=check_columns)
    out: list[UnpairedExample] = []
    for row, raw in rows:
        try:
            if isinstance(raw, dict) and completion_key not in raw and chosen_key in raw:
                pair = normalize_pair(raw, path, row, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key)
                recs = [{"prompt": pair["prompt"], "completion": pair[k], "label": k == "chosen", "system": pair.get("system")}
                        for k in ("chosen", "rejected")]
            else:
                recs = [normalize_unpaired(raw, path, row, prompt_key=prompt_key, completion_key=completion_key, label_key=label_key)]
            encoded = [
                (encode_prompt_response(tokenizer, r["prompt"], r["completion"], chat_template=chat_template,
                                        system=r.get("system") or system_prompt), r["label"])
                for r in recs
            ]
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.skip(e)
            continue
        for (ids, mask, plen), label in encoded:
            ids, mask, outcome = _fit(ids, mask, plen, max_length, truncation)
            if outcome == "dropped":
                stats.dropped_too_long += 1
                continue
            stats.truncated += outcome == "truncated"
            out.append(UnpairedExample(ids, mask, plen, label))
    stats.kept = len(out)
    require_examples(stats)
    return out, stats
