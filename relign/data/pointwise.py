"""Pointwise rows for a sequence classifier trained with binary cross-entropy (``relign rm loss=bce``).

A row is ``{"prompt", "response", "label"}`` with ``label`` a probability in [0, 1]: the paper's
ForecastProbs rows (Band et al., arXiv 2404.00474: prompt = the forecaster template of question,
paragraph and candidate answer; response = ""; label = the target probability). Rows are rendered
as the reward model reads them (``encode_prompt_response``), so a checkpoint scores at inference
exactly the ids it was trained on. A bad row raises ``DataError`` naming the file, the row and the
field (or is skipped and counted with ``data.skip_bad_rows``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .preference import _prompt, _read, encode_prompt_response
from .readers import DataError
from .records import require_columns
from .stats import DataStats, require_examples


@dataclass
class PointExample:
    input_ids: list[int]
    label: float

    def __len__(self) -> int:
        return len(self.input_ids)


def label_of(raw: dict, key: str, source: str, row: int) -> float:
    """The row's label as a probability (never ``eval``: a number, or a numeric string)."""
    v = raw.get(key)
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise DataError(source, row, key, f"expected a number in [0, 1], got {v!r:.40}") from None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise DataError(source, row, key, f"expected a number in [0, 1], got {type(v).__name__}")
    if not 0.0 <= float(v) <= 1.0:
        raise DataError(source, row, key, f"{v} is outside [0, 1]")
    return float(v)


def build_point_examples(
    path: str, tokenizer, *, split: str = "train", max_length: int = 1024, truncation: str = "truncate",
    skip_bad_rows: bool = False, prompt_key: str = "prompt", response_key: str = "response", label_key: str = "label",
    chat_template: bool = True, system_prompt: str = "", max_rows: int = 0, key: str | None = None,
) -> tuple[list[PointExample], DataStats]:
    """Read, validate and tokenize pointwise rows (a missing response is the empty string)."""
    def check_columns(raw: dict) -> None:
        require_columns(raw, path, {prompt_key, label_key} <= set(raw), f"'{prompt_key}', '{response_key}' and '{label_key}'")

    stats, rows = _read(path, split, truncation=truncation, max_length=max_length, max_rows=max_rows,
                        skip_bad_rows=skip_bad_rows, key=key, check_columns=check_columns)
    out: list[PointExample] = []
    for row, raw in rows:
        try:
            if not isinstance(raw, dict):
                raise DataError(path, row, None, f"expected an object, got {type(raw).__name__}")
            prompt = _prompt(raw, prompt_key, path, row)
            response = raw.get(response_key, "")
            if not isinstance(response, str):
                raise DataError(path, row, response_key, f"expected a string, got {type(response).__name__}")
            label = label_of(raw, label_key, path, row)
            system = raw.get("system") if isinstance(raw.get("system"), str) else system_prompt
            ids, _, _ = encode_prompt_response(tokenizer, prompt, response, chat_template=chat_template, system=system)
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.skip(e)
            continue
        # the classifier reads the last token: a row too long keeps its end (as the scorer that
        # serves the checkpoint does, models.reward.RewardModelScorer), or is dropped
        if len(ids) > max_length:
            if truncation == "drop":
                stats.dropped_too_long += 1
                continue
            ids = ids[-max_length:]
            stats.truncated += 1
        out.append(PointExample(ids, label))
    stats.kept = len(out)
    require_examples(stats)
    return out, stats


__all__ = ["PointExample", "build_point_examples", "label_of"]
