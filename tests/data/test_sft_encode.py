"""Chat templates, assistant-only loss masks and the truncation policy."""

from __future__ import annotations

import json

import pytest

from relign.data.sft import build_sft_examples, encode_chat, encode_sft, truncate

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3+4?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "And 10*2?"},
    {"role": "assistant", "content": "It is 20."},
]


def _masked_text(tok, ids, mask, value):
    return tok.decode([i for i, m in zip(ids, mask) if m == value])


def test_chat_mask_covers_every_assistant_turn_and_nothing_else(tokenizer):
    ids, mask = encode_chat(tokenizer, CHAT)
    # The full conversation is exactly the chat template's rendering.
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    # Trained text: both assistant contents, each with its end-of-turn marker (ChatML).
    assert _masked_text(tokenizer, ids, mask, 1) == "7<|im_end|>\nIt is 20.<|im_end|>\n"
    untrained = _masked_text(tokenizer, ids, mask, 0)
    assert "Be brief." in untrained and "What is 3+4?" in untrained and "And 10*2?" in untrained
    assert "It is 20." not in untrained and "<|im_start|>assistant\n" in untrained


def test_prompt_response_and_text_records(tokenizer):
    ids, mask = encode_sft(tokenizer, {"prompt": "Q: 1+1? A:", "response": " 2"})
    eos = tokenizer.eos_token_id
    assert ids[-1] == eos and mask[-1] == 1
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == " 2<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == "Q: 1+1? A:"
    ids, mask = encode_sft(tokenizer, {"text": "hello world"})
    assert all(mask) and ids[-1] == eos
    # prompt/response through the chat template when asked
    ids, mask = encode_sft(tokenizer, {"prompt": "hi", "response": "yo"}, chat_template=True, system_prompt="S")
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nS<|im_end|>")
    assert _masked_text(tokenizer, ids, mask, 1) == "yo<|im_end|>\n"


def test_truncate_policy_by_hand():
    ids = [1, 2, 3, 4, 5, 6]
    mask = [0, 0, 1, 1, 1, 1]
    assert truncate(ids, mask, 10, "truncate") == (ids, mask, "kept")
    assert truncate(ids, mask, 4, "truncate") == ([1, 2, 3, 4], [0, 0, 1, 1], "truncated")
    assert truncate(ids, mask, 4, "drop") == ([], [], "dropped")
    # the prompt alone fills max_length: nothing left to train on
    assert truncate(ids, mask, 2, "truncate") == ([], [], "dropped")


def test_truncation_counted_in_stats(tmp_path, tokenizer):
    rows = [
        {"prompt": "short", "response": "ok"},
        {"prompt": "short", "response": " ".join(["word"] * 200)},
        {"prompt": " ".join(["word"] * 200), "response": "ok"},
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex, stats = build_sft_examples(str(p), tokenizer, max_length=32, truncation="truncate")
    assert (stats.kept, stats.truncated, stats.dropped_too_long) == (2, 1, 1)
    assert all(len(e) <= 32 for e in ex)
    ex, stats = build_sft_examples(str(p), tokenizer, max_length=32, truncation="drop")
    assert (stats.kept, stats.truncated, stats.dropped_too_long) == (1, 0, 2)


def test_first_token_never_trained(tokenizer, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "abc def"}) + "\n")
    ex, _ = build_sft_examples(str(p), tokenizer)
    assert ex[0].loss_mask[0] == 0 and all(ex[0].loss_mask[1:])


def test_non_incremental_template_is_reported(tokenizer, tmp_path):
    class Shuffling:
        """A template that renders turns in reverse: earlier text changes as turns are added."""

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *a, **k):
            return tokenizer(*a, **k)

        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
            return "".join(m["content"] for m in reversed(msgs)) + ("GEN" if add_generation_prompt else "")

    from relign.data.readers import DataError

    with pytest.raises(DataError, match="not incremental"):
        encode_chat(Shuffling(), CHAT[1:], "f.jsonl", 7)
