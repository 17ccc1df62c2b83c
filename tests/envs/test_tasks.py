"""The one task builder and prompt renderer (relign.envs.tasks) that rl, eval and the demo share."""

from __future__ import annotations

import pytest

from relign.config import ConfigError
from relign.envs.tasks import Problem, build_task, encode_problems, get_task, problem_text, render_prompt
from relign.rollout.collect import RolloutCollector
from relign.rollout.engine import SamplingParams

from ..conftest import write_jsonl

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}],
        "extra_info": {"answer": "3"}}
RAW = {"prompt": "Question: what is 2+5?\nAnswer:", "extra_info": {"answer": "7"}}
BOS = 0


class BosTokenizer:
    """The tiny tokenizer as a BOS-adding one (as Llama's is): ``BOS`` first when
    ``add_special_tokens`` is on (the Hugging Face default). The tiny Qwen2 tokenizer adds
    nothing, which would hide a chat prompt getting a second BOS."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, *args, **kwargs):
        return self.tok.apply_chat_template(*args, **kwargs)

    def __call__(self, text, add_special_tokens=True):
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ([BOS] if add_special_tokens else []) + ids}


# --------------------------------------------------------------------------- render_prompt


def test_render_prompt_chat_and_raw(tokenizer):
    text, ids = render_prompt(tokenizer, CHAT)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == text
    text, ids = render_prompt(tokenizer, RAW)
    assert text == RAW["prompt"] and tokenizer.decode(ids) == text


def test_render_prompt_special_tokens(tokenizer):
    bos_tok = BosTokenizer(tokenizer)
    # a chat's template holds its own special tokens: nothing is added in front
    text, ids = render_prompt(bos_tok, CHAT)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] and ids[0] != BOS
    # a raw prompt gets the tokenizer's special tokens (its BOS)
    text, ids = render_prompt(bos_tok, RAW)
    assert ids == [BOS] + tokenizer(RAW["prompt"], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("bos", [False, True])
def test_rl_and_eval_see_the_same_prompt_ids(tokenizer, bos):
    tok = BosTokenizer(tokenizer) if bos else tokenizer
    records = [CHAT, RAW]
    collector = RolloutCollector(tok, None, records, sampling=SamplingParams(n=1), max_prompt_length=10_000)
    problems, skipped = encode_problems(tok, records)
    assert skipped == 0
    for rec, (text, ids, info), p in zip(records, collector.records, problems):
        assert (text, ids) == render_prompt(tok, rec) == (p.prompt_text, p.prompt_ids)
        assert info == p.extra_info == rec["extra_info"]
    assert collector.problems == [p.question for p in problems] == ["What is 1+2?", RAW["prompt"]]


def test_render_prompt_needs_a_prompt(tokenizer):
    with pytest.raises(ValueError, match="'prompt' or 'messages'"):
        render_prompt(tokenizer, {"question": "hi"})


# --------------------------------------------------------------------------- problem_text, encode_problems


def test_problem_text():
    assert problem_text(CHAT) == "What is 1+2?"
    two_turns = {"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": "second"}]}
    assert problem_text(two_turns) == "second"  # the last user message
    assert problem_text({"messages": [{"role": "system", "content": "s"}]}) == ""
    assert problem_text(RAW) == RAW["prompt"]


def test_encode_problems_skips_long_prompts_and_keeps_ids(tokenizer):
    records = [{"prompt": "a " * n, "extra_info": {"i": i}} for i, n in enumerate([2, 30, 5, 40, 1])]
    lengths = [len(render_prompt(tokenizer, r)[1]) for r in records]
    limit = max(lengths[0], lengths[2], lengths[4])
    assert limit < min(lengths[1], lengths[3])  # the 30- and 40-word prompts are the long ones
    problems, skipped = encode_problems(tokenizer, records, max_prompt_length=limit)
    assert skipped == 2
    assert all(isinstance(p, Problem) for p in problems)
    assert [p.id for p in problems] == [0, 2, 4]  # the record's index, not the position among the kept ones
    for p in problems:
        rec = records[p.id]
        assert (p.prompt_text, p.prompt_ids) == render_prompt(tokenizer, rec)
        assert p.question == rec["prompt"] and p.extra_info == {"i": p.id}
    # a prompt exactly at the limit is kept; 0 means no limit
    problems, skipped = encode_problems(tokenizer, records, max_prompt_length=lengths[3])
    assert (len(problems), skipped) == (5, 0)
    problems, skipped = encode_problems(tokenizer, records)
    assert [p.id for p in problems] == [0, 1, 2, 3, 4] and skipped == 0
    assert encode_problems(tokenizer, [{"prompt": "x"}])[0][0].extra_info == {}


def test_encode_problems_of_a_task(tokenizer, tmp_path):
    task = get_task("gsm8k", chat=True)
    records = task.load(str(write_jsonl(tmp_path / "g.jsonl", [{"question": "Q18?", "answer": "blah\n#### 18"}])))
    (p,), skipped = encode_problems(tokenizer, records)
    assert skipped == 0 and p.id == 0 and p.extra_info == {"answer": "18"}
    assert p.question.startswith("Q18?") and "<|im_start|>" not in p.question
    assert p.prompt_text.startswith("<|im_start|>") and p.prompt_text.endswith("<|im_start|>assistant\n")


def test_encode_problems_names_a_bad_record(tokenizer):
    with pytest.raises(ValueError, match="record 1: needs 'prompt' or 'messages'"):
        encode_problems(tokenizer, [RAW, {"question": "no prompt"}])


# --------------------------------------------------------------------------- build_task


def test_custom_task_has_no_extractor_unless_given(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "a"}])
    reward = tmp_path / "r.py"
    reward.write_text("def reward(p, r, e):\n    return 0.0\n\n"
                      "def first_word(r, e):\n    return r.split()[0] if r.split() else None\n")
    t = build_task("custom", path=str(data), reward_fn=str(reward))
    assert t.reward_spec.endswith("r.py:reward")  # 'file.py' means its function named reward
    assert t.extract_spec is None and t.extract_answer("x y", {}) is None
    assert t.answers_equal("a", "a") and not t.answers_equal("a", "b")
    t2 = build_task("custom", path=str(data), reward_fn=f"{reward}:reward", extract_fn=f"{reward}:first_word")
    assert t2.extract_answer("yes indeed", {}) == "yes"


def test_build_task_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="reward_fn"):
        build_task("custom", path=str(tmp_path / "p.jsonl"))
    with pytest.raises(ConfigError, match="multi-turn"):
        build_task("calculator")
    with pytest.raises(ConfigError, match="unknown task"):
        build_task("gsm9k")
    with pytest.raises(ConfigError, match="file not found"):
        build_task("gsm8k", extract_fn=str(tmp_path / "missing.py:f"))


def test_build_task_for_rl_and_a_replaced_reward(tmp_path):
    assert build_task("calculator", single_turn=False).env  # relign rl runs multi-turn tasks; eval refuses them
    reward = tmp_path / "r.py"
    reward.write_text("def reward(p, r, e):\n    return 1.0\n")
    t = build_task("gsm8k", reward_fn=str(reward), format_weight=0.5)
    assert t.reward_spec == f"{reward}:reward" and t.reward_kwargs == {} and t.term_weights == {}
    assert t.extract_spec == "relign.envs.gsm8k:final_answer"  # the task's own extractor stays
