"""task.name=gem: GEM games replayed statelessly, without touching the global generators."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

gem = pytest.importorskip("gem")

from relign.envs import gem_env  # noqa: E402
from relign.envs.gem_env import GemEnv  # noqa: E402
from relign.envs.tasks import get_task  # noqa: E402
from relign.errors import ConfigError  # noqa: E402
from relign.rollout.engine import SamplingParams  # noqa: E402
from relign.rollout.multiturn import run_episodes  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.rollout.test_multiturn import ScriptedEngine  # noqa: E402

EASY = "game:GuessTheNumber-v0-easy"  # 1..10, 4 turns


def _direct(env_id: str, seed: int, actions: list[str], **kwargs):
    """The game driven as GEM's own loop drives it: one object, reset(seed), step by step."""
    env = gem.make(env_id, **kwargs)
    obs0, _ = env.reset(seed=seed)
    return obs0, [env.step(a)[:4] for a in actions], env


def _steps(record: dict, actions: list[str], env: GemEnv | None = None):
    env = env or GemEnv()
    state, info, out = record["prompt"], dict(record["extra_info"]), []
    for a in actions:
        res = asyncio.run(env.step(state, a, info))
        out.append(res)
        state, info = res["next_state"], res["extra_info"]
        if res["done"]:
            break
    return out


@pytest.mark.parametrize("env_id, actions", [
    ("game:GuessTheNumber-v0-hard", [f"\\boxed{{{g}}}" for g in (25, 12, 37, 6, 31, 44, 3)]),
    # Minesweeper places its mines from the global `random` at the first reveal, inside step
    ("game:Minesweeper-v0-easy", ["\\boxed{reveal 2 2}", "\\boxed{flag 0 0}", "\\boxed{reveal 4 4}", "\\boxed{reveal 0 3}"]),
    ("game:Mastermind-v0-easy", ["\\boxed{1 2 3 4}", "\\boxed{4 3 2 1}", "\\boxed{1 1 2 2}"]),
])
def test_replay_gives_what_driving_the_game_directly_gives(env_id, actions):
    task = get_task("gem", chat=False, gem={"env_id": env_id})
    for record in task.load(max_rows=2, seed=3):
        seed = record["extra_info"]["gem"]["seed"]
        obs0, direct, _ = _direct(env_id, seed, actions)
        assert record["prompt"] == obs0
        got = _steps(record, actions)
        assert len(got) == next((k + 1 for k, d in enumerate(direct) if d[2] or d[3]), len(direct))
        state = record["prompt"]
        for (obs, r, term, trunc), res, a in zip(direct, got, actions):
            assert res["next_state"] == state + a + "\n" + obs + "\n"
            assert res["reward"] == pytest.approx(float(r)) and res["done"] == bool(term or trunc)
            state = res["next_state"]


def test_the_global_generators_are_untouched():
    random.seed(123)
    np.random.seed(456)
    py, npy = random.getstate(), np.random.get_state()
    task = get_task("gem", chat=False, gem={"env_id": "game:Minesweeper-v0-easy"})
    (record,) = task.load(max_rows=1, seed=0)
    _steps(record, ["\\boxed{reveal 1 1}", "\\boxed{reveal 3 3}"])
    assert random.getstate() == py
    after = np.random.get_state()
    assert after[0] == npy[0] and np.array_equal(after[1], npy[1]) and after[2:] == npy[2:]


def test_a_groups_episodes_share_the_game_but_not_their_action_lists():
    task = get_task("gem", chat=False, gem={"env_id": EASY})
    (record,) = task.load(max_rows=1, seed=1)
    target = _direct(EASY, record["extra_info"]["gem"]["seed"], [])[2].game_number
    env = GemEnv()
    # two episodes of one group: the driver gives each a shallow copy of the record's extra_info
    a_info, b_info = dict(record["extra_info"]), dict(record["extra_info"])
    low = 1 if target != 1 else 2
    a = asyncio.run(env.step(record["prompt"], f"\\boxed{{{low}}}", a_info))
    b = asyncio.run(env.step(record["prompt"], f"\\boxed{{{target}}}", b_info))
    assert a["extra_info"]["gem"]["actions"] == [f"\\boxed{{{low}}}"]
    assert b["extra_info"]["gem"]["actions"] == [f"\\boxed{{{target}}}"]
    assert record["extra_info"]["gem"]["actions"] == [] and a_info["gem"]["actions"] == []
    assert b["done"] and b["score"] == 1.0 and b["reward"] == 1.0  # the same hidden number for the whole group
    assert not a["done"] and a["score"] == 0.0


def test_format_error_turn_limit_and_success():
    task = get_task("gem", chat=False, gem={"env_id": EASY})
    (record,) = task.load(max_rows=1, seed=2)
    target = _direct(EASY, record["extra_info"]["gem"]["seed"], [])[2].game_number
    (bad,) = _steps(record, ["no box here"])
    assert bad["done"] and bad["reward"] == pytest.approx(-0.1) and bad["score"] == 0.0
    assert "finish_reason" not in bad["extra_info"]
    wrong = [g for g in range(1, 11) if g != target][:4]
    got = _steps(record, [f"\\boxed{{{g}}}" for g in wrong])
    assert [r["done"] for r in got] == [False, False, False, True]
    last = got[-1]
    assert last["extra_info"]["finish_reason"] == "max_turns"
    assert last["reward"] == pytest.approx(1 - abs(wrong[-1] - target) / 9)  # GEM's closeness reward at the limit
    assert last["score"] == 0.0


def test_the_games_turn_limit_reaches_the_driver_as_max_turns(tokenizer):
    task = get_task("gem", chat=False, gem={"env_id": EASY})
    (record,) = task.load(max_rows=1, seed=2)
    target = _direct(EASY, record["extra_info"]["gem"]["seed"], [])[2].game_number
    wrong = [g for g in range(1, 11) if g != target][:4]
    turns = [tokenizer(f"\\boxed{{{g}}}", add_special_tokens=False)["input_ids"] for g in wrong]
    win = [tokenizer(f"\\boxed{{{target}}}", add_special_tokens=False)["input_ids"]]
    prompt = tokenizer(record["prompt"])["input_ids"]
    engine = ScriptedEngine(tokenizer, [turns, win])
    (group_a,), (group_b,) = run_episodes(engine, tokenizer, GemEnv(tokenizer), [prompt, prompt],
                                          [record["extra_info"]] * 2, SamplingParams(n=1, max_new_tokens=16),
                                          max_turns=10, max_response_tokens=4000, prompt_texts=[record["prompt"]] * 2)
    assert group_a.turns == 4 and group_a.finish_reason == "max_turns" and group_a.score == 0.0
    assert group_b.turns == 1 and group_b.finish_reason == "stop" and group_b.score == 1.0 and group_b.reward == 1.0


def test_the_task_knows_the_games_own_turn_limit():
    """rollout.max_turns=0 reads Task.env_max_turns: the max_turns of the game as configured, and none
    for a -random variant, which draws its limit at every reset."""
    from relign.recipes.build import env_turn_limit

    for env_id, kwargs in ((EASY, {}), ("game:GuessTheNumber-v0-hard", {}), (EASY, {"max_turns": 3}),
                           ("game:Mastermind-v0-easy", {})):
        task = get_task("gem", gem={"env_id": env_id, "kwargs": kwargs})
        assert task.env_max_turns == gem.make(env_id, **kwargs).max_turns == env_turn_limit(task, task.env)
    assert [get_task("gem", gem={"env_id": e}).env_max_turns for e in (EASY, "game:GuessTheNumber-v0-hard")] == [4, 7]
    random_game = get_task("gem", gem={"env_id": "game:GuessTheNumber-v0-random"})
    assert random_game.env_max_turns is None
    with pytest.raises(ConfigError, match=r"rollout\.max_turns=0 .* has no fixed one: set rollout\.max_turns >= 1"):
        env_turn_limit(random_game, random_game.env)


def test_observations_extend_the_text_in_plain_and_chat_mode(tokenizer):
    plain = get_task("gem", chat=False, gem={"env_id": EASY}).load(max_rows=1, seed=4)[0]
    state = plain["prompt"]
    for res, a in zip(_steps(plain, ["\\boxed{1}", "\\boxed{2}"]), ["\\boxed{1}", "\\boxed{2}"]):
        assert res["next_state"].startswith(state + a)
        state = res["next_state"]

    chat = get_task("gem", chat=True, gem={"env_id": EASY}).load(max_rows=1, seed=4)[0]
    messages = chat["messages"]
    state = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    env, info = GemEnv(tokenizer), dict(chat["extra_info"])
    for guess, closed in ((1, True), (2, False)):  # the model closed its turn with EOS, or stopped without it
        action = f"\\boxed{{{guess}}}" + (tokenizer.eos_token if closed else "")
        res = asyncio.run(env.step(state, action, info))
        assert res["next_state"].startswith(state + action)
        obs = _direct(EASY, info["gem"]["seed"], [*info["gem"]["actions"], action])[1][-1][0]
        messages = [*messages, {"role": "assistant", "content": f"\\boxed{{{guess}}}"}, {"role": "user", "content": obs}]
        # the state is exactly the conversation as the chat template renders it
        assert res["next_state"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        state, info = res["next_state"], res["extra_info"]


class _RewritingTokenizer:
    """A chat template that puts the newest turn first: no observation can extend it."""

    name_or_path = "rewriter"
    eos_token = "</s>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "".join(f"[{m['role']}]{m['content']}" for m in reversed(messages))


def test_a_template_that_rewrites_history_is_one_line():
    with pytest.raises(ConfigError, match="chat template of rewriter re-renders earlier turns") as e:
        GemEnv(_RewritingTokenizer()).wrap("obs", "act", True)
    assert "\n" not in str(e.value)


def test_the_root_logger_is_untouched():
    """In a fresh process (gem configures logging once, on its first import)."""
    code = ("import logging; root = logging.getLogger(); before = (root.level, list(root.handlers)); "
            "from relign.envs.tasks import get_task; get_task('gem'); import gem; "
            "print(before == (root.level, list(root.handlers)), 'gem' in __import__('sys').modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_games_that_download_are_one_line_and_fast():
    t0 = time.perf_counter()
    for env_id in ("game:Wordle-v0-easy", "game:Hangman-v0-easy"):
        with pytest.raises(ConfigError) as e:
            get_task("gem", gem={"env_id": env_id})
        assert str(e.value) .startswith(f"task.gem.env_id={env_id} needs a download at construction; relign runs offline")
        assert "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 30


def test_bad_ids_and_options_are_one_line():
    with pytest.raises(ConfigError, match=r"unknown GEM environment 'game:GuessTheNumbr-v0-easy'; did you mean "
                                          r"game:GuessTheNumber-v0-easy"):
        get_task("gem", gem={"env_id": "game:GuessTheNumbr-v0-easy"})
    with pytest.raises(ConfigError, match="use task.name=reasoning_gym"):
        get_task("gem", gem={"env_id": "rg:chain_sum"})
    with pytest.raises(ConfigError, match=r"gem\.make.*failed") as e:
        get_task("gem", gem={"env_id": "game:Sudoku-v0-easy", "kwargs": {"clues": "many"}})
    assert "\n" not in str(e.value)


def test_records_are_json_and_deterministic():
    task = get_task("gem", chat=False, gem={"env_id": "game:GuessTheNumber-v0-random"})
    a, b = task.load(max_rows=6, seed=0), task.load(max_rows=6, seed=0)
    assert a == b and json.loads(json.dumps(a)) == a
    seeds = [r["extra_info"]["gem"]["seed"] for r in a]
    assert len(set(seeds)) == 6 and seeds != [r["extra_info"]["gem"]["seed"] for r in task.load(max_rows=6, seed=1)]
    assert gem_env.game_seed(0, 0) < 2**32
