"""Preference rows: every accepted shape normalizes to one record, errors name the row and the
field, the two responses share the prompt's ids, step-wise prefixes are context only."""

from __future__ import annotations

import pytest

from relign.data.preference import (
    build_pair_examples,
    build_unpaired_examples,
    encode_prompt_response,
    normalize_pair,
    normalize_unpaired,
)
from relign.data.readers import DataError

from ..conftest import write_jsonl

U = {"role": "user", "content": "2+2?"}
A4, A5 = {"role": "assistant", "content": "4"}, {"role": "assistant", "content": "5"}


def test_normalize_pair_shapes():
    text = normalize_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "f", 1)
    assert text == {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    # TRL's implicit-prompt conversational form: whole conversations sharing all but the reply
    conv = normalize_pair({"chosen": [U, A4], "rejected": [U, A5]}, "f", 1)
    assert conv == {"prompt": [U], "chosen": "4", "rejected": "5"}
    # explicit prompt messages + one-message replies; the system field of Orca-style rows
    explicit = normalize_pair({"prompt": [U], "chosen": [A4], "rejected": [A5], "system": "Be brief."}, "f", 1)
    assert explicit == {"prompt": [U], "chosen": "4", "rejected": "5", "system": "Be brief."}
    step = normalize_pair({"prompt": "q", "initial_reason_steps": "s1\n", "chosen": "s2", "rejected": "x2", "margin": 2}, "f", 1)
    assert step["prefix"] == "s1\n" and step["margin"] == 2.0


@pytest.mark.parametrize("row, field, problem", [
    ({"prompt": "q", "chosen": "a"}, "rejected", "missing"),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, "rejected", "expected a string or a list of messages"),
    ({"prompt": "q", "chosen": " ", "rejected": "b"}, "chosen", "empty"),
    ({"chosen": [U, A4], "rejected": [{"role": "user", "content": "3+3?"}, A5]}, "rejected", "differs"),
    ({"chosen": [U, A4], "rejected": [U, {"role": "user", "content": "x"}]}, "rejected[1].role", "out of order"),
    ({"chosen": "a", "rejected": "b"}, "prompt", "missing"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}, "margin", "expected a number"),
])
def test_normalize_pair_errors_name_row_and_field(row, field, problem):
    with pytest.raises(DataError) as e:
        normalize_pair(row, "pairs.jsonl", 7)
    assert e.value.row == 7 and e.value.field == field and problem in e.value.problem
    assert str(e.value).startswith(f"pairs.jsonl, row 7, field '{field}'")


def test_normalize_unpaired():
    assert normalize_unpaired({"prompt": "q", "completion": "a", "label": False}, "f", 1) == {"prompt": "q", "completion": "a", "label": False}
    with pytest.raises(DataError, match="field 'label': expected true or false"):
        normalize_unpaired({"prompt": "q", "completion": "a", "label": 1}, "f", 1)


@pytest.mark.parametrize("chat", [False, True])
def test_pair_shares_prompt_ids_and_masks_only_the_response(tokenizer, tmp_path, chat):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is two plus two?", "chosen": "four", "rejected": "five, I think"}])
    (ex,), stats = build_pair_examples(str(path), tokenizer, chat_template=chat)
    assert stats.kept == 1
    p = ex.prompt_len
    assert ex.chosen_ids[:p] == ex.rejected_ids[:p]
    assert ex.chosen_mask == [0] * p + [1] * (len(ex.chosen_ids) - p)
    assert ex.rejected_mask == [0] * p + [1] * (len(ex.rejected_ids) - p)
    # the response is tokenized on its own, never re-tokenized together with the prompt
    resp = tokenizer("four", add_special_tokens=False)["input_ids"]
    assert ex.chosen_ids[p : p + len(resp)] == resp
    end = tokenizer.convert_ids_to_tokens(ex.chosen_ids[p + len(resp)])
    assert end == ("<|im_end|>" if chat else tokenizer.eos_token)


def test_step_prefix_is_context_and_step_has_no_end_token(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "q", "prefix": "Step 1: 2*3 = 6.\n", "chosen": "Step 2: 6+1 = 7.",
                                               "rejected": "Step 2: 6+1 = 8."}])
    (ex,), _ = build_pair_examples(str(path), tokenizer, chat_template=True)
    step = tokenizer("Step 2: 6+1 = 7.", add_special_tokens=False)["input_ids"]
    prefix = tokenizer("Step 1: 2*3 = 6.\n", add_special_tokens=False)["input_ids"]
    assert ex.chosen_ids[ex.prompt_len - len(prefix) : ex.prompt_len] == prefix  # the prefix ends the shared context
    assert ex.chosen_ids[ex.prompt_len :] == step  # the target is the step alone: no end-of-turn
    assert sum(ex.chosen_mask) == len(step)
    (with_eos,), _ = build_pair_examples(str(path), tokenizer, chat_template=True, step_eos=True)
    assert with_eos.chosen_ids[with_eos.prompt_len + len(step)] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_truncation_keeps_the_prompt_or_drops(tokenizer, tmp_path):
    long = " ".join(["word"] * 200)
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "chosen": long, "rejected": "short"},
                                              {"prompt": long, "chosen": "a", "rejected": "b"}])
    exs, stats = build_pair_examples(str(path), tokenizer, max_length=32)
    assert len(exs) == 1 and stats.truncated == 1 and stats.dropped_too_long == 1
    assert len(exs[0].chosen_ids) == 32 and tokenizer.eos_token_id in exs[0].rejected_ids[exs[0].prompt_len :]  # rejected kept whole
    # nothing left: an error that names the file and says why, never an empty training set
    with pytest.raises(DataError) as e:
        build_pair_examples(str(path), tokenizer, max_length=32, truncation="drop")
    assert str(e.value) == (f"{path}: no usable rows: all 2 rows skipped (2 too long for max_length=32); "
                            "raise data.max_length or set data.truncation=truncate")


def test_kto_reads_unpaired_rows_and_splits_pairs(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [
        {"prompt": "q1", "completion": "good", "label": True},
        {"prompt": "q2", "chosen": "yes", "rejected": "no"},
    ])
    exs, stats = build_unpaired_examples(str(path), tokenizer)
    assert [e.label for e in exs] == [True, True, False] and stats.rows == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q1", "completion": "good", "label": "true"}, {"prompt": "q", "completion": "a", "label": True}])
    exs, stats = build_unpaired_examples(str(bad), tokenizer, skip_bad_rows=True)
    assert len(exs) == 1 and stats.bad_rows == 1 and "row 1, field 'label'" in stats.errors[0]


def test_system_field_becomes_the_system_message(tokenizer):
    ids, _, plen = encode_prompt_response(tokenizer, "hi", "hello", chat_template=True, system="Be brief.")
    text = tokenizer.decode(ids[:plen])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
