"""Turn SFT records into token ids and a loss mask.

``loss_mask[t] = 1`` means token ``t`` is a training target (it lines up with
``models.logprobs.token_logps``, which scores each token at its own position). Chat rows go
through the tokenizer's chat template and only assistant turns are trained: the conversation
is rendered one message at a time and each newly rendered piece of text is tokenized on its
own, so the ids of a prefix never change when a turn is appended (the same property the RL
rollouts rely on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .readers import DataError, is_tabular, read_records
from .records import normalize_sft, require_columns, sft_columns_ok, sft_expected
from .stats import DataStats, require_examples  # noqa: F401  (DataStats: imported from here by older code)

TRUNCATION = ("truncate", "drop")


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_chat(
    tokenizer, messages: list[dict[str, str]], source: str = "", row: int = 0, *, train_from: int = 0
) -> tuple[list[int], list[int]]:
    """Ids and mask of a chat, trainable on every assistant turn (content + end-of-turn) from
    message ``train_from`` on (earlier ones are a prompt: TRL's conversational prompt/completion)."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""

    def add(text: str, trainable: int) -> None:
        nonlocal rendered
        if not text.startswith(rendered):
            raise DataError(
                source, row, "messages",
                "the tokenizer's chat template is not incremental (rendering a longer conversation "
                "changed the text of an earlier turn), so assistant turns cannot be masked",
            )
        piece = _encode(tokenizer, text[len(rendered):])
        ids.extend(piece)
        mask.extend([trainable] * len(piece))
        rendered = text

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    for i, msg in enumerate(messages):
        if msg["role"] == "assistant" and i >= train_from:
            add(render(messages[:i], True), 0)
            add(render(messages[: i + 1], False), 1)
        else:
            add(render(messages[: i + 1], False), 0)
    return ids, mask


def encode_sft(
    tokenizer,
    record: dict[str, Any],
    *,
    chat_template: bool = False,
    system_prompt: str = "",
    source: str = "",
    row: int = 0,
) -> tuple[list[int], list[int]]:
    """Ids and loss mask of one normalized SFT record (see records.normalize_sft)."""
    if "prompt" in record and chat_template:
        msgs = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
        record = {"messages": msgs}
    if "messages" in record:
        msgs, start = record["messages"], record.get("completion_start", 0)
        if system_prompt and msgs[0]["role"] != "system":
            msgs, start = [{"role": "system", "content": system_prompt}] + msgs, start + (start > 0)
        return encode_chat(tokenizer, msgs, source, row, train_from=start)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "prompt" in record:
        p = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"] if record["prompt"] else []
        r = _encode(tokenizer, record["response"]) + eos
        return p + r, [0] * len(p) + [1] * len(r)
    t = tokenizer(record["text"], add_special_tokens=True)["input_ids"] + eos
    return t, [1] * len(t)


def truncate(ids: list[int], mask: list[int], max_length: int, policy: str) -> tuple[list[int], list[int], str]:
    """Apply the truncation policy. Returns (ids, mask, outcome) with outcome in
    ``kept``, ``truncated``, ``dropped`` (too long, or the prompt alone fills max_length)."""
    if len(ids) <= max_length:
        return ids, mask, "kept"
    if policy == "drop":
        return [], [], "dropped"
    first_target = next((i for i, m in enumerate(mask) if m), len(mask))
    if first_target >= max_length:
        return [], [], "dropped"
    return ids[:max_length], mask[:max_length], "truncated"


def build_sft_examples(
    path: str,
    tokenizer,
    *,
    split: str = "train",
    max_length: int = 1024,
    truncation: str = "truncate",
    skip_bad_rows: bool = False,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    chat_template: bool = False,
    system_prompt: str = "",
    max_rows: int = 0,
    key: str | None = None,
) -> tuple[list[SFTExample], DataStats]:
    """Read, validate and tokenize a whole SFT file. Bad rows raise DataError unless
    ``skip_bad_rows``, in which case they are skipped and counted in the stats. A file with
    the wrong columns, or with no usable row, raises DataError either way. ``key`` is the
    config key of ``path`` (``data.path``), named in errors about the path itself."""
    if truncation not in TRUNCATION:
        raise DataError(path, None, None, f"unknown truncation policy {truncation!r} (use {' or '.join(TRUNCATION)})")
    stats = DataStats(source=path, max_length=max_length, truncation=truncation)
    examples: list[SFTExample] = []
    keys = dict(prompt_key=prompt_key, response_key=response_key, messages_key=messages_key)
    check_columns = is_tabular(path)
    for row, raw in read_records(path, split, max_rows=max_rows, on_bad_row=stats.on_bad_row(skip_bad_rows), key=key):
        if check_columns and isinstance(raw, dict):
            require_columns(raw, path, sft_columns_ok(raw, **keys), sft_expected(**keys))
            check_columns = False
        stats.rows += 1
        try:
            rec = normalize_sft(raw, path, row, **keys)
            ids, mask = encode_sft(tokenizer, rec, chat_template=chat_template, system_prompt=system_prompt, source=path, row=row)
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.skip(e)
            continue
        if mask:
            mask[0] = 0  # nothing predicts the first token (and, packed, it would see the previous example)
        ids, mask, outcome = truncate(ids, mask, max_length, truncation)
        if outcome == "dropped":
            stats.dropped_too_long += 1
            continue
        if not any(mask):
            stats.dropped_empty += 1
            continue
        stats.truncated += outcome == "truncated"
        examples.append(SFTExample(ids, mask))
    stats.kept = len(examples)
    require_examples(stats)
    return examples, stats
