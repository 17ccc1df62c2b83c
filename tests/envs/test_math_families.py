"""The math grader's answer families, hand-written cases: several boxes that are one answer, the
reference given as a worked solution, the final-answer statement (``answer_format``), number
formatting. The public suites these families come from: test_math_equivalence_suites.py."""

from __future__ import annotations

import json

import pytest

from relign.config import TaskConfig
from relign.envs import math as math_task
from relign.envs.tasks import build_task, get_task
from relign.errors import ConfigError


def score(response: str, gold: str, answer_format: str = "boxed") -> float:
    return math_task.reward("", response, {"answer": gold}, answer_format=answer_format)["score"]


# --------------------------------------------------------------------------- several boxes, one answer

@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed{(1, 2)}, \boxed{(2, 1)}", "(1, 2), (2, 1)"),
        (r"$x = \boxed{-2}$ \quad\text{and}\quad $x = \boxed{3}$", "-2, 3"),
        (r"\[ \boxed{-2} \quad \text{and} \quad \boxed{1}. \]", "-2, 1"),
        (r"\boxed{1},\boxed{2},\boxed{3}", "1, 2, 3"),
        (r"\boxed{1} or \boxed{2}", "1, 2"),
        (r"$\boxed{(3, 3)}$ \text{ for part (a) and } $\boxed{(1, 1)}$", "(3, 3), (1, 1)"),
        (r"\boxed{5}\n\n**Final Answer**\n\boxed{5}", "5"),  # the same answer boxed twice is one answer
        # a correction, or a box far away in the reasoning, is not part of the answer: the last box wins
        (r"\boxed{1} no wait \boxed{2}", "2"),
        (r"\boxed{10} earlier, finally \boxed{11}", "11"),
        (r"\boxed{4}, but actually \boxed{6}", "6"),
        (r"\boxed{1} no no no no no \boxed{2}", "2"),
        (r"first $\boxed{3}$ " + "then some long reasoning about the problem, " * 3 + r"so $\boxed{7}$", "7"),
        (r"so the answer is \boxed{7}.", "7"),
        (r"\boxed{}", ""),
        ("no box", None),
    ],
)
def test_box_groups(text, expected):
    assert math_task.boxed_answer(text.replace(r"\n", "\n")) == expected


@pytest.mark.parametrize(
    "gold, response, correct",
    [
        (r"(1,2),(2,1),(-1,-20),(-20,-1)", r"\[\boxed{(1, 2)}, \boxed{(2, 1)}, \boxed{(-1, -20)}, \boxed{(-20, -1)}\]", True),
        (r"-2, 1", r"the roots are $\boxed{-2}$ and $\boxed{1}$.", True),
        (r"1, -2", r"\[ \boxed{-2} \quad \text{and} \quad \boxed{1}. \]", True),  # a set: order does not matter
        (r"k = 45, n = 2", r"$\boxed{k = 45} \quad \text{and} \quad \boxed{n = 2}$", True),
        ("3", r"\boxed{-2} and \boxed{3}", False),  # listing candidates is not the one answer
        ("-2, 3", r"\boxed{-2}, \boxed{3}, \boxed{5}", False),
        ("2", r"\boxed{1} no wait \boxed{2}", True),
        ("1", r"\boxed{1} no wait \boxed{2}", False),
    ],
)
def test_box_groups_graded_as_one_answer(gold, response, correct):
    assert score(response, gold) == float(correct)


def test_a_solution_with_several_boxes_gives_the_rows_answer(tmp_path):
    p = tmp_path / "m.jsonl"
    solution = r"Step one gives $\boxed{4}$ ways... so $x=\boxed{2}$ or $x=\boxed{-5}$."
    p.write_text(json.dumps({"problem": "p", "solution": solution}) + "\n")
    assert get_task("math").load(str(p))[0]["extra_info"] == {"answer": "2, -5"}


# --------------------------------------------------------------------------- the reference as a worked solution

SOLUTION = (r"We have $f(-2)+f(-1)+f(0)=\frac{-8}{-4}+\frac{-5}{-3}+\frac{-2}{-2}=2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$. "
            r"(Check: $\boxed{2}$ was only the first term.)")


@pytest.mark.parametrize(
    "gold, response, correct",
    [
        (r"Thus $f = \boxed{\frac{14}{3}}$.", r"\boxed{4\frac23}", True),
        (r"Thus $f = \boxed{\frac{14}{3}}$.", r"\boxed{\frac{14}{5}}", False),
        (r"Therefore, $\boxed{14{,}916}$ is our answer.", r"\boxed{14916}", True),
        (r"so the solutions are $n = \boxed{1,-2}.$", r"\boxed{-2} \quad\text{and}\quad \boxed{1}", True),
        (r"$$\boxed{2}, \boxed{3}, \boxed{5}$$", r"\boxed{\{2, 3, 5\}}", True),
        (SOLUTION, r"\boxed{2}", True),  # the solution's final box is the answer, however it got there
        (r"... Final Answer: The final answer is $28 \%$. I hope it is correct.", r"\boxed{28\%}", True),
        (r"$125$ miles", r"\boxed{125}", True),  # a gold in its own math delimiters
        (r"$(3, \frac{\pi}{2})$", r"\boxed{\left( 3, \frac{\pi}{2} \right)}", True),
    ],
)
def test_reference_given_as_a_worked_solution(gold, response, correct):
    assert score(response, gold) == float(correct)


# --------------------------------------------------------------------------- answer_format: the final-answer statement

MATH_FEW_SHOT = "so the total is 7.\nFinal Answer: The final answer is $\\frac{7}{2}$. I hope it is correct."


@pytest.mark.parametrize(
    "response, gold, boxed, final, any_",
    [
        (MATH_FEW_SHOT, "3.5", 0, 1, 1),
        ("We add them up. Therefore, the answer is 42.", "42", 0, 1, 1),
        ("Answer: $x = \\frac12$", "0.5", 0, 1, 1),
        ("**Answer:** 12", "12", 0, 1, 1),
        ("Final Answer: The largest $n$ is 34.", "34", 0, 1, 1),
        (MATH_FEW_SHOT, "7", 0, 0, 0),  # the statement is read, not the last number before it
        # no box and no statement: only `any` reads the end of the response (as math-verify does)
        ("so we get $x = 42$.", "42", 0, 0, 1),
        ("The solution is $x \\leq 5$", "x \\leq 5", 0, 0, 1),
        # a statement after the last box is the final answer; one before it is not
        ("$= \\boxed{255}$ for the interest. Final Answer: The final answer is $10,455$. I hope it is correct.", "10455",
         0, 1, 1),
        ("The answer is $\\boxed{5}$. Answer one more question?", "5", 1, 1, 1),
        ("The answer is $\\boxed{5}$.\n\nAnswer: 6", "5", 1, 0, 0),
        ("the final answer is not yet known.\n\nWe compute more: $2+3$.", "5", 0, 0, 0),  # the statement's paragraph
    ],
)
def test_answer_formats(response, gold, boxed, final, any_):
    assert score(response, gold) == boxed
    assert score(response, gold, "boxed_or_final") == final
    assert score(response, gold, "any") == any_


def test_default_answer_format_is_boxed_and_unboxed_statements_score_nothing():
    r = math_task.reward("", MATH_FEW_SHOT, {"answer": "3.5"}, format_weight=0.5)
    assert r == {"reward": 0.0, "score": 0.0, "components": {"correct": 0.0, "format": 0.0}}
    r = math_task.reward("", MATH_FEW_SHOT, {"answer": "3.5"}, format_weight=0.5, answer_format="boxed_or_final")
    assert r["score"] == 1.0 and r["components"]["format"] == 1.0
    assert not math_task.format_ok(MATH_FEW_SHOT) and math_task.format_ok(MATH_FEW_SHOT, "boxed_or_final")
    assert not math_task.format_ok("no answer at all", "boxed_or_final") and math_task.format_ok("x", "any")


def test_final_statement_is_bounded_and_cut_at_its_paragraph():
    text = "Reasoning.\n\nFinal Answer: The final answer is $5$. I hope it is correct.\n\nNote: more text."
    assert math_task.final_statement(text) == "final answer is $5$. I hope it is correct."  # the last "final answer"
    assert math_task.final_statement("The answer is:\n\n$$7$$") == "answer is:\n\n$$7$$"  # the paragraph the answer is in
    long = "The final answer is " + "1" * 5000
    assert len(math_task.final_statement(long)) == math_task.MAX_ANSWER_CHARS
    assert math_task.final_statement("no anchor here, 42") is None
    assert math_task.final_statement("To answer this we compute 42") is None  # "answer" alone is no statement


def test_task_option_and_voting_extractor():
    default = get_task("math")
    assert default.reward_kwargs == {"format_weight": 0.0} and default.extract_spec == "relign.envs.math:final_answer"
    t = get_task("math", answer_format="boxed_or_final")
    assert t.reward_kwargs == {"format_weight": 0.0, "answer_format": "boxed_or_final"}
    assert t.reward("", MATH_FEW_SHOT, {"answer": "7/2"})["score"] == 1.0
    assert t.extract_answer(MATH_FEW_SHOT, {}) == "\\frac{7}{2}"
    assert t.extract_answer(r"\boxed{1}, \boxed{2}", {}) == "1, 2"
    assert t.answers_equal("\\frac{7}{2}", "3.5")
    assert get_task("math", answer_format="any").extract_answer("so $x = 42$.", {}) == "x = 42"
    assert default.extract_answer(MATH_FEW_SHOT, {}) is None
    with pytest.raises(ValueError, match="answer_format='boxes': expected one of boxed, boxed_or_final, any"):
        get_task("math", answer_format="boxes")


def test_build_task_and_config_carry_answer_format():
    assert TaskConfig().answer_format == "boxed"
    assert build_task("math").reward_kwargs == {"format_weight": 0.0}
    assert build_task("math500", answer_format="boxed_or_final").reward_kwargs["answer_format"] == "boxed_or_final"
    with pytest.raises(ConfigError, match="task.answer_format=any applies to task.name=math or math500, not task.name=gsm8k"):
        build_task("gsm8k", answer_format="any")
    with pytest.raises(ConfigError, match="answer_format='final'"):
        build_task("math", answer_format="final")


def test_relign_eval_passes_task_answer_format(monkeypatch):
    # `relign eval task.name=math task.answer_format=boxed_or_final ...`: the option reaches build_task
    from relign.config import load_config
    from relign.recipes import build, eval as eval_recipe

    cfg = load_config(eval_recipe.Config, None, ["task.name=math", "task.answer_format=boxed_or_final", "model.path=tiny:micro"])
    assert cfg.task.answer_format == "boxed_or_final"
    seen = {}

    class Stop(Exception):
        pass

    def fake_build_task(name, **kwargs):
        seen[name] = kwargs["answer_format"]
        raise Stop

    for module, call in ((eval_recipe, lambda: eval_recipe.train(cfg)), (build, lambda: build.task_for(cfg.task))):
        monkeypatch.setattr(module, "build_task", fake_build_task)
        with pytest.raises(Stop):
            call()
    assert seen == {"math": "boxed_or_final"}


# --------------------------------------------------------------------------- number formatting

@pytest.mark.parametrize(
    "gold, response, correct",
    [
        ("1000", r"\boxed{1 000}", True),  # math_verify alone reads "1 000" as 1*0
        ("1000", r"\boxed{1\,000}", True),
        ("1000", r"\boxed{1{,}000}", True),
        ("7425000", r"\boxed{7,425,000}", True),
        ("-7425000", r"\boxed{-7 425 000}", True),
        ("10080", r"\boxed{10,\!080}", True),
        ("1000.99", r"\boxed{1\,000.99}", True),
        ("1000.99", r"\boxed{1000,99}", True),  # a decimal comma
        ("2.74", r"\boxed{2,74}", True),
        ("1,22", r"\boxed{1.22}", True),  # ... in the gold too
        ("42", r"\boxed{42\ }", True),  # a trailing backslash, LaTeX spacing or full stop
        ("42", r"\boxed{42\\}", True),
        ("42", r"\boxed{42\;}", True),
        ("42", r"\boxed{42.}", True),
        (r"\frac{1}{2}", r"\boxed{\frac{1}{2}.}", True),
        # and no more than that
        ("10", r"\boxed{1 000}", False),
        ("15", r"\boxed{1,5}", False),
        ("1.22", r"\boxed{1, 22}", False),  # a list with a space is a list
        (r"2, 3", r"\boxed{2,3}", True),
        (r"\{1, 22\}", r"\boxed{1,22}", True),  # a pair as written still matches a pair
        ("1000", r"\boxed{1 00 0}", False),
    ],
)
def test_number_formatting(gold, response, correct):
    assert score(response, gold) == float(correct)
