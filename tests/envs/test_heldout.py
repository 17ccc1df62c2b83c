"""Train and eval never share a problem, for every procedural task (issue 36's leak).

Each test builds the training set and the held-out set on its own, through the task's own
generator, and intersects their question texts; the expected values come from that
recomputation, never from the split code itself.
"""

from __future__ import annotations

import random

import pytest

from relign.envs import arith
from relign.envs.base import Task, eval_seed, load_function
from relign.envs.tasks import TASKS
from relign.errors import ConfigError


def _questions(records: list[dict]) -> list[str]:
    """Problem identities, read here independently: the key a generator names (a game: its env id
    and seed, since its first observation is the same text for many seeds), else the question
    text: a raw prompt or the user turns of a chat."""
    out = []
    for r in records:
        if "problem_key" in r.get("extra_info", {}):
            out.append(r["extra_info"]["problem_key"])
        elif "messages" in r:
            out.append("\n".join(m["content"] for m in r["messages"] if m["role"] == "user"))
        else:
            out.append(r["prompt"])
    return out


def _procedural() -> list[str]:
    """Every registered task that generates its problems (the registry, read at collection time)."""
    names = []
    for name, row in TASKS.items():
        if row.from_file:
            continue
        try:
            task = row.factory()
        except ConfigError:  # an optional package (reasoning-gym, gem) that is not installed: still listed
            names.append(name)
            continue
        if task.generate_spec is not None:
            names.append(name)
    return names


def _task(name: str) -> Task:
    try:
        return TASKS[name].factory()
    except ConfigError as e:
        pytest.skip(f"{name}: {e}")


def test_the_registry_has_procedural_tasks():
    assert "calculator" in _procedural()


@pytest.mark.parametrize("name", _procedural())
@pytest.mark.parametrize("seed", [0, 7])
def test_train_and_heldout_share_no_question(name, seed):
    task = _task(name)
    n_train, n_eval = 48, 16
    train = task.load(max_rows=n_train, seed=seed)
    heldout, dropped = task.load_heldout(max_rows=n_eval, seed=seed, train_rows=n_train)
    # the training set as the generator alone makes it, independently of load()
    direct = load_function(task.generate_spec)(n_train, seed, chat=task.chat, **task.generate_kwargs)
    assert _questions(train) == _questions(direct)
    assert len(heldout) + dropped == n_eval and len(heldout) > 0
    assert set(_questions(heldout)).isdisjoint(_questions(train))
    # the held-out problems are not the first n_eval training problems (the old leak: eval drew with seed 0)
    assert _questions(heldout) != _questions(direct)[:n_eval]
    assert eval_seed(seed) != seed


@pytest.mark.parametrize("name", _procedural())
def test_heldout_is_deterministic_and_moves_with_the_seed(name):
    task = _task(name)
    a, _ = task.load_heldout(max_rows=12, seed=3, train_rows=12)
    b, _ = task.load_heldout(max_rows=12, seed=3, train_rows=12)
    c, _ = task.load_heldout(max_rows=12, seed=4, train_rows=12)
    assert _questions(a) == _questions(b)
    assert _questions(a) != _questions(c)


def nine_questions(n: int, seed: int, chat: bool = False) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"What is {rng.randrange(9)} + 1?", "extra_info": {}} for _ in range(n)]


def test_overlapping_questions_are_dropped_and_counted():
    """A generator over a tiny problem space (9 questions): the held-out draw repeats training
    questions, and exactly those are dropped."""
    gen = nine_questions
    task = Task(name="tiny", parse_row=lambda *a: ({}, {}), template="", reward_spec="x:y",
                generate_spec="tests.envs.test_heldout:nine_questions")
    train_q = {r["prompt"] for r in gen(5, 11, False)}
    raw = [r["prompt"] for r in gen(20, eval_seed(11), False)]
    expected = [q for q in raw if q not in train_q]
    assert len(expected) < len(raw)  # the fixture does overlap (else the test proves nothing)
    kept, dropped = task.load_heldout(max_rows=20, seed=11, train_rows=5)
    assert [r["prompt"] for r in kept] == expected
    assert dropped == len(raw) - len(expected)


def test_a_file_task_is_read_as_it_is(tmp_path):
    """A task with data on disk (its test file) is not generated and drops nothing."""
    paths = arith.write_splits(tmp_path, 20, 10, seed=0)
    records, dropped = arith.task().load_heldout(str(paths["test"]))
    assert dropped == 0 and len(records) == 10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arith_demo_splits_are_disjoint(seed):
    """The demo's arithmetic task draws train and test from one stream of distinct expressions."""
    train, test = arith.make_splits(300, 100, seed=seed)
    assert len(train) == 300 and len(test) == 100
    assert {p["expression"] for p in train}.isdisjoint(p["expression"] for p in test)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", ["calibration", "calculator"])
def test_the_system_prompt_reaches_every_generated_record_once(name, chat):
    """task.system_prompt on a task whose records a generator writes (calibration's and the
    calculator's ignored it): each training and held-out record starts with it, once, as a row
    read from a file would (a system turn in chat, the text and a blank line before plain text)."""
    from relign.envs.tasks import get_task

    plain = get_task(name, chat=chat)
    t = get_task(name, chat=chat, system_prompt="Answer briefly.")
    want = t.generate(4, 0)
    for bare, got in zip(plain.generate(4, 0), want):
        if chat:
            assert got["messages"] == [{"role": "system", "content": "Answer briefly."}, *bare["messages"]]
        else:
            assert got["prompt"] == "Answer briefly.\n\n" + bare["prompt"]
    heldout, _ = t.load_heldout(max_rows=4, train_rows=8)
    assert all((r["messages"][0]["content"] if chat else r["prompt"].split("\n\n")[0]) == "Answer briefly." for r in heldout)
    assert all(str(r).count("Answer briefly.") == 1 for r in [*want, *heldout])


@pytest.mark.parametrize("name", _procedural())
def test_a_generated_task_refuses_a_file_before_opening_it(name, tmp_path):
    """task.path on a task that generates its problems: one ConfigError naming the task and the file,
    from ``Task.load`` itself (no file is opened: this one does not exist), for train and held-out alike."""
    task, missing = _task(name), tmp_path / "rows.jsonl"
    for load in (task.load, task.load_heldout):
        with pytest.raises(ConfigError, match=rf"task.name={task.name} generates its problems from the seed: leave "
                                              rf"task.path empty \(it is {missing}\)"):
            load(str(missing))


def test_task_options_are_checked_against_the_task_row():
    """build_task reads each task's accepted options from its row in TASKS, whatever its name."""
    from relign.envs.tasks import TaskRow, build_task

    takers = {k: sorted(n for n, r in TASKS.items() if k in r.options) for k in ("answer_format", "features")}
    assert takers == {"answer_format": ["math", "math500"], "features": ["calibration"]}
    assert all(isinstance(r, TaskRow) for r in TASKS.values()) and [n for n, r in TASKS.items() if r.from_file] == ["custom"]
    with pytest.raises(ConfigError, match="task.features applies to task.name=calibration, not task.name=countdown"):
        build_task("countdown", features={"room": 0.5})
    with pytest.raises(ConfigError, match="task.answer_format=any applies to task.name=math or math500, not task.name=lc"):
        build_task("lc", answer_format="any")
    assert build_task("math500", answer_format="any").name.startswith("math")
