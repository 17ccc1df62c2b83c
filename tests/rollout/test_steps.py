"""Steps in token ids (relign.rollout.steps): where each step ends, the states before each
step, and the steps' ids; on the fake vocabulary (exact, hand-checked) and on the tiny model's
locally trained BPE tokenizer (whatever its merges are)."""

from __future__ import annotations

import pytest

from relign.rollout.steps import split_steps, step_ends, step_prefixes

from ..strategies.fake_tree_engine import ANS0, EOS, HASH, NL, PROMPT0, STEP0, STRADDLE, FakeTokenizer

TOK = FakeTokenizer()
S0, S1, S2 = STEP0, STEP0 + 1, STEP0 + 2
A0 = ANS0


# --------------------------------------------------------------------------- fake tokenizer


def test_steps_end_after_each_newline():
    # "s0.\n" "s1.\n" "s2.#### A0<eos>"
    ids = [S0, NL, S1, NL, S2, HASH, A0, EOS]
    ends = step_ends(ids, TOK)
    assert ends == [2, 4, 8]
    assert split_steps(ids, ends) == [[S0, NL], [S1, NL], [S2, HASH, A0, EOS]]


def test_straddling_token_closes_its_step():
    # ".\n\n" holds the delimiter: the step ends right after it, the next token starts the next step
    ids = [S0, STRADDLE, S1, NL, S2]
    assert step_ends(ids, TOK) == [2, 4, 5]
    assert split_steps(ids, [2, 4, 5]) == [[S0, STRADDLE], [S1, NL], [S2]]
    # the straddling token holds two "\n": it closes one step, not two; its "." is text, so a
    # response that opens with it has a first step of its own
    assert step_ends([STRADDLE, S1], TOK) == [1, 2]
    assert step_ends([S0, STRADDLE], TOK) == [2]
    assert step_ends([S0, STRADDLE, STRADDLE, S1], TOK) == [2, 3, 4]


def test_leading_newlines_merge_into_the_first_step():
    ids = [NL, NL, S0, NL, S1]
    assert step_ends(ids, TOK) == [4, 5]
    assert split_steps(ids, [4, 5]) == [[NL, NL, S0, NL], [S1]]


def test_trailing_newlines_and_eos_merge_into_the_last_step():
    assert step_ends([S0, NL, S1, NL, NL, EOS], TOK) == [2, 6]
    assert step_ends([S0, NL, S1, NL], TOK) == [2, 4]
    assert step_ends([S0, NL, EOS], TOK) == [3]
    assert step_ends([S0, NL, S1, EOS], TOK) == [2, 4]
    # a blank line between two steps joins the step after it
    assert step_ends([S0, NL, NL, S1, NL], TOK) == [2, 5]


def test_empty_and_whitespace_only_responses():
    assert step_ends([], TOK) == []
    assert step_ends([NL, NL], TOK) == [2]
    assert step_ends([EOS], TOK) == [1]
    with pytest.raises(ValueError, match="delimiter"):
        step_ends([S0], TOK, "")


def test_two_token_delimiter_ends_after_its_second_token():
    # delimiter "\n\n" made of two "\n" tokens: the step ends after the second one
    ids = [S0, NL, NL, S1, NL, S2]
    assert step_ends(ids, TOK, "\n\n") == [3, 6]
    # a single "\n" is not the delimiter
    assert step_ends([S0, NL, S1], TOK, "\n\n") == [3]
    # the straddling token holds "\n\n" on its own
    assert step_ends([S0, STRADDLE, S1], TOK, "\n\n") == [2, 3]


@pytest.mark.parametrize("ids", [
    [S0], [S0, NL], [NL, S0, NL, S1, NL, NL], [S0, STRADDLE, STRADDLE, S1, HASH, A0, EOS],
    [S1, NL, S2, NL, S0, NL, S1, NL, S0, NL, S2, HASH, A0, EOS],
])
def test_last_end_is_the_response_length_and_ends_increase(ids):
    ends = step_ends(ids, TOK)
    assert ends[-1] == len(ids)
    assert all(a < b for a, b in zip([0, *ends], ends))
    steps = split_steps(ids, ends)
    assert [t for s in steps for t in s] == ids
    # every step but the last holds the delimiter and something else
    for s in steps[:-1]:
        text = TOK.decode(s)
        assert "\n" in text and text.strip()


# --------------------------------------------------------------------------- step_prefixes


def test_step_prefixes_hand_example():
    prompt = [PROMPT0 + 7]
    resp = [S0, NL, S1, NL, S2, HASH, A0, EOS]
    ends = [2, 4, 8]
    # s_0 = prompt, s_1 = prompt + step 1, s_2 = prompt + steps 1..2 (no state after the last step)
    assert step_prefixes(prompt, resp, ends) == [prompt, prompt + [S0, NL], prompt + [S0, NL, S1, NL]]
    assert step_prefixes(prompt, resp, ends, max_steps=0) == [prompt]
    assert step_prefixes(prompt, resp, ends, max_steps=1) == [prompt, prompt + [S0, NL]]
    assert step_prefixes(prompt, resp, ends, max_steps=2) == step_prefixes(prompt, resp, ends)
    assert step_prefixes(prompt, resp, ends, max_steps=10) == step_prefixes(prompt, resp, ends)
    # one step: only s_0
    assert step_prefixes(prompt, [S0, EOS], [2]) == [prompt]
    # no steps (empty response): still s_0, the prompt
    assert step_prefixes(prompt, [], []) == [prompt]
    with pytest.raises(ValueError, match="max_steps"):
        step_prefixes(prompt, resp, ends, max_steps=-1)
    # the prompt is copied, not aliased
    out = step_prefixes(prompt, resp, ends)
    out[0].append(99)
    assert prompt == [PROMPT0 + 7]


# --------------------------------------------------------------------------- a real BPE tokenizer


REAL_TEXTS = [
    "Step one.\n\nStep two.\nAnswer #### 5",
    "\n\nx = 3.\ny = 4.\n\n",
    "(3 + 4) = 7;\nthen 7 * 2 = 14.\n#### 14",
    "First, 12 apples.\nThen кошка eats 3 \u2014 fine.\n\n\nSo 9 left.\n",
    "no newline at all",
]


@pytest.mark.parametrize("text", REAL_TEXTS)
@pytest.mark.parametrize("delimiter", ["\n", "\n\n"])
def test_real_tokenizer_steps_decode_to_the_text(tokenizer, text, delimiter):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ends = step_ends(ids, tokenizer, delimiter)
    assert ends[-1] == len(ids)
    assert all(a < b for a, b in zip([0, *ends], ends))
    steps = [tokenizer.decode(s) for s in split_steps(ids, ends)]
    assert "".join(steps) == tokenizer.decode(ids)
    for s in steps[:-1]:
        # a non-last step ends on the delimiter (maybe followed by more newlines) and holds text
        assert s.endswith("\n"), repr(s)
        assert s.strip()
        assert delimiter in s
    # the steps are the text's non-blank lines (paragraphs for "\n\n"), leading and trailing blank
    # lines merged into their neighbours
    expected = [p for p in text.split(delimiter) if p.strip()]
    assert [s.strip() for s in steps] == [p.strip() for p in expected]


def test_real_tokenizer_expected_steps(tokenizer):
    text = "Step one.\n\nStep two.\nAnswer #### 5"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    steps = [tokenizer.decode(s) for s in split_steps(ids, step_ends(ids, tokenizer))]
    assert steps == ["Step one.\n\n", "Step two.\n", "Answer #### 5"]
    # a trailing EOS merges into the last step, which then holds the special token's id
    eos = tokenizer.eos_token_id
    ends = step_ends([*ids, eos], tokenizer)
    assert ends[-1] == len(ids) + 1 and len(ends) == 3
