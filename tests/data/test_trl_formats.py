"""TRL's dataset formats, each read from a small file in that format: SFT `text`, `prompt`/`completion`
(text and conversational), `messages`; preference `prompt`/`chosen`/`rejected` as text, as explicit
conversations and with the prompt implicit in them; KTO's unpaired `prompt`/`completion`/`label`."""

from __future__ import annotations

import csv
import json

import pytest

from relign.data.preference import build_pair_examples, build_unpaired_examples
from relign.data.readers import DataError
from relign.data.sft import build_sft_examples

from ..conftest import write_jsonl

U = {"role": "user", "content": "2+2?"}
A = {"role": "assistant", "content": "4"}
A_BAD = {"role": "assistant", "content": "5"}


def _tokens(tok, ids, mask):
    return list(zip(tok.convert_ids_to_tokens(ids), mask))


def _trained(tok, ex):
    return tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])


# --------------------------------------------------------------------------- SFT


def test_text_rows_train_on_every_token_but_the_first(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "lm.jsonl", [{"text": "2+2=4"}])
    (ex,), stats = build_sft_examples(str(path), tokenizer)
    # "2", "+", "2", "=", "4" then the EOS token (<|im_end|> for this tokenizer); nothing predicts the first
    assert _tokens(tokenizer, ex.input_ids, ex.loss_mask) == [
        ("2", 0), ("+", 1), ("2", 1), ("=", 1), ("4", 1), ("<|im_end|>", 1)]
    assert (stats.rows, stats.kept) == (1, 1)


def test_prompt_completion_text_is_prompt_response(tokenizer, tmp_path):
    trl = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    ours = write_jsonl(tmp_path / "ours.jsonl", [{"prompt": "2+2?", "response": "4"}])
    (a,), _ = build_sft_examples(str(trl), tokenizer)
    (b,), _ = build_sft_examples(str(ours), tokenizer)
    assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)
    # by hand: the prompt's 4 tokens untrained, the completion and EOS trained
    assert _tokens(tokenizer, a.input_ids, a.loss_mask) == [
        ("2", 0), ("+", 0), ("2", 0), ("?", 0), ("4", 1), ("<|im_end|>", 1)]


def test_an_explicit_response_key_does_not_fall_back_to_completion(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer, response_key="answer")
    assert str(e.value) == f"{path}, row 1, field 'answer': missing"
    # the response field wins over TRL's name when a row has both
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "q", "response": "yes", "completion": "no"}])
    (ex,), _ = build_sft_examples(str(both), tokenizer)
    assert _trained(tokenizer, ex) == "yes<|im_end|>"


def test_conversational_prompt_completion_masks_by_hand(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": [U], "completion": [A]}])
    (ex,), _ = build_sft_examples(str(path), tokenizer)
    # ChatML: the prompt turn and the assistant header are context; the reply and its end of turn are trained
    assert _tokens(tokenizer, ex.input_ids, ex.loss_mask) == [
        ("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("2", 0), ("+", 0), ("2", 0), ("?", 0), ("<|im_end|>", 0), ("Ċ", 0),
        ("<|im_start|>", 0), ("assistant", 0), ("Ċ", 0),
        ("4", 1), ("<|im_end|>", 1), ("Ċ", 1),
    ]


def test_conversational_prompt_turns_are_never_trained(tokenizer, tmp_path):
    few_shot = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"}, U]
    completion = [A, {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": few_shot, "completion": completion}])
    (ex,), _ = build_sft_examples(str(path), tokenizer)
    # the prompt's assistant turn ("2") is an example, not a target; the completion's two turns are
    assert _trained(tokenizer, ex) == "4<|im_end|>\n6<|im_end|>\n"
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(few_shot + completion, tokenize=False)
    # a system prompt added in front shifts the prompt, not what is trained
    (ex2,), _ = build_sft_examples(str(write_jsonl(tmp_path / "c2.jsonl", [{"prompt": [U], "completion": [A]}])),
                                   tokenizer, system_prompt="S")
    assert tokenizer.decode(ex2.input_ids).startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user")
    assert _trained(tokenizer, ex2) == "4<|im_end|>\n"


def test_mixed_text_and_conversational_sides(tokenizer, tmp_path):
    conv = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": [U], "completion": [A]}])
    text_prompt = write_jsonl(tmp_path / "tp.jsonl", [{"prompt": "2+2?", "completion": [A]}])
    text_reply = write_jsonl(tmp_path / "tr.jsonl", [{"prompt": [U], "completion": "4"}])
    (a,), _ = build_sft_examples(str(conv), tokenizer)
    for path in (text_prompt, text_reply):
        (b,), _ = build_sft_examples(str(path), tokenizer)
        assert (b.input_ids, b.loss_mask) == (a.input_ids, a.loss_mask), path.name


def test_conversational_rows_from_a_csv_and_text_that_only_looks_like_json(tokenizer, tmp_path):
    path = tmp_path / "conv.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "completion"])
        w.writeheader()
        w.writerow({"prompt": json.dumps([U]), "completion": json.dumps([A])})
        w.writerow({"prompt": "[1, 2, 3] sorted?", "completion": "[1, 2, 3]"})  # text, not messages
    (conv, text), _ = build_sft_examples(str(path), tokenizer)
    assert _trained(tokenizer, conv) == "4<|im_end|>\n"
    assert _trained(tokenizer, text) == "[1, 2, 3]<|im_end|>"


@pytest.mark.parametrize("row, field, problem", [
    ({"prompt": [U], "completion": [{"role": "user", "content": "x"}]}, "completion[0].role", "role 'user' out of order after 'user'"),
    ({"prompt": [U], "completion": []}, "completion", "empty list of messages"),
    ({"prompt": [U], "completion": None}, "completion", "missing"),
    ({"prompt": [{"role": "robot", "content": "x"}], "completion": [A]}, "prompt[0].role", "expected one of"),
    ({"prompt": [U], "completion": [A, {"role": "user", "content": "more?"}]}, None, None),  # ends with the user: fine
])
def test_conversational_errors_name_the_field(tokenizer, tmp_path, row, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [U], "completion": [A]}, row])
    if field is None:
        exs, _ = build_sft_examples(str(path), tokenizer)
        assert len(exs) == 2
        return
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer)
    assert (e.value.row, e.value.field) == (2, field) and problem in e.value.problem


def test_messages_rows(tokenizer, tmp_path):
    chat = [U, A, {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": chat}])
    (ex,), _ = build_sft_examples(str(path), tokenizer)
    assert _trained(tokenizer, ex) == "4<|im_end|>\n6<|im_end|>\n"


# --------------------------------------------------------------------------- preference


def _pair(tok, path, **kw):
    (ex,), stats = build_pair_examples(str(path), tok, **kw)
    assert stats.kept == 1
    return ex


def test_preference_text_explicit_and_implicit_conversations_agree(tokenizer, tmp_path):
    """With the chat template, a text prompt, TRL's explicit conversational form and its implicit-prompt
    form (the prompt inside chosen/rejected) give the same ids and masks."""
    files = {
        "text": [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}],
        "explicit": [{"prompt": [U], "chosen": [A], "rejected": [A_BAD]}],
        "implicit": [{"chosen": [U, A], "rejected": [U, A_BAD]}],
        "explicit-repeated": [{"prompt": [U], "chosen": [U, A], "rejected": [U, A_BAD]}],
    }
    exs = {name: _pair(tokenizer, write_jsonl(tmp_path / f"{name}.jsonl", rows)) for name, rows in files.items()}
    ref = exs["text"]
    for name, ex in exs.items():
        assert (ex.chosen_ids, ex.chosen_mask, ex.rejected_ids, ex.rejected_mask, ex.prompt_len) == (
            ref.chosen_ids, ref.chosen_mask, ref.rejected_ids, ref.rejected_mask, ref.prompt_len), name
    # by hand: 12 prompt tokens (user turn + assistant header), then "4" / "5" and the end of turn
    assert ref.prompt_len == 12
    assert tokenizer.convert_ids_to_tokens(ref.chosen_ids[12:]) == ["4", "<|im_end|>", "Ċ"]
    assert tokenizer.convert_ids_to_tokens(ref.rejected_ids[12:]) == ["5", "<|im_end|>", "Ċ"]
    assert ref.chosen_mask == [0] * 12 + [1, 1, 1]


def test_preference_text_without_chat_template(tokenizer, tmp_path):
    ex = _pair(tokenizer, write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}]),
               chat_template=False)
    assert _tokens(tokenizer, ex.chosen_ids, ex.chosen_mask) == [
        ("2", 0), ("+", 0), ("2", 0), ("?", 0), ("4", 1), ("<|im_end|>", 1)]


def test_implicit_prompt_with_a_multi_turn_shared_prefix(tokenizer, tmp_path):
    ctx = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, U]
    ex = _pair(tokenizer, write_jsonl(tmp_path / "p.jsonl", [{"chosen": [*ctx, A], "rejected": [*ctx, A_BAD]}]))
    assert tokenizer.decode(ex.chosen_ids[: ex.prompt_len]) == tokenizer.apply_chat_template(ctx, tokenize=False,
                                                                                            add_generation_prompt=True)
    assert tokenizer.decode([i for i, m in zip(ex.chosen_ids, ex.chosen_mask) if m]) == "4<|im_end|>\n"


def test_conversational_preference_parquet(tokenizer, tmp_path):
    """TRL datasets on the hub are parquet with list<struct<role, content>> columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([{"chosen": [U, A], "rejected": [U, A_BAD]}]), path)
    jsonl = write_jsonl(tmp_path / "prefs.jsonl", [{"chosen": [U, A], "rejected": [U, A_BAD]}])
    a, b = _pair(tokenizer, path), _pair(tokenizer, jsonl)
    assert (a.chosen_ids, a.rejected_ids, a.prompt_len) == (b.chosen_ids, b.rejected_ids, b.prompt_len)


# --------------------------------------------------------------------------- KTO


def test_kto_unpaired_text_and_conversational(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "kto.jsonl", [
        {"prompt": "2+2?", "completion": "4", "label": True},
        {"prompt": [U], "completion": [A_BAD], "label": False},
        {"completion": [U, A], "label": True},  # implicit prompt
    ])
    exs, stats = build_unpaired_examples(str(path), tokenizer)
    assert [e.label for e in exs] == [True, False, True] and (stats.rows, stats.kept) == (3, 3)
    # all three share the prompt's ids: the same user turn through the chat template
    assert exs[0].input_ids[: exs[0].prompt_len] == exs[1].input_ids[: exs[1].prompt_len] == exs[2].input_ids[: exs[2].prompt_len]
    trained = [tokenizer.decode([i for i, m in zip(e.input_ids, e.loss_mask) if m]) for e in exs]
    assert trained == ["4<|im_end|>\n", "5<|im_end|>\n", "4<|im_end|>\n"]
