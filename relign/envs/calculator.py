"""A calculator tool environment: the smallest useful multi-turn task.

Each turn the model either calls the tool or answers:

* ``<calc>EXPR</calc>`` — the env evaluates EXPR with ``relign.envs.safe_arith`` (the same
  evaluator as Countdown, here allowing decimals and unary minus) and appends
  ``<result>VALUE</result>\\n`` (or ``<result>error: ...</result>\\n``); ``done=False``,
  reward 0. Only the last ``<calc>`` of a turn is evaluated (drivers usually stop sampling
  at ``</calc>``, so there is one).
* ``<answer>N</answer>`` — the episode ends; reward = score = 1 if N equals
  ``extra_info["answer"]`` (within 1e-6), else 0. An answer wins over a ``<calc>`` in the
  same turn.
* neither — the episode ends with reward 0.

``next_state`` is always ``state + action + observation``, so the driver appends only the
observation's tokens. The turn limit belongs to the driver.

``task()`` is the registered task "calculator": its environment is ``CalculatorEnv`` and its
problems are generated (``make_calculator_records``) unless a file of
``{"expression", "answer"}`` rows is given, so nothing outside this module needs to know
that the calculator is multi-turn.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import Task
from relign.envs.safe_arith import ArithError, evaluate, format_number

MAX_EXPR_LEN = 200
TOLERANCE = Fraction(1, 10**6)
TEMPLATE = (
    "Compute {expression}.\n"
    "You can use a calculator: write <calc>EXPRESSION</calc> (numbers, + - * / and parentheses) "
    "and the result comes back as <result>VALUE</result>. "
    "When you know the answer, write it as <answer>NUMBER</answer>."
)

_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _eval(text: str) -> Fraction:
    return evaluate(text, allow_float=True, allow_unary=True, max_len=MAX_EXPR_LEN)


def observe(expr: str) -> str:
    """The tool's reply to ``<calc>expr</calc>``."""
    try:
        return f"<result>{format_number(_eval(expr))}</result>\n"
    except ArithError as e:
        return f"<result>error: {e}</result>\n"


def answer_correct(text: str, answer: Any) -> bool:
    try:
        return abs(_eval(text) - _eval(str(answer))) <= TOLERANCE
    except ArithError:
        return False


class CalculatorEnv:
    """Implements ``relign.envs.env.Env``; stateless, so one instance serves all episodes."""

    async def step(self, state: str, action: str, extra_info: dict) -> dict:
        answers = _ANSWER.findall(action)
        if answers:
            r = float(answer_correct(answers[-1].strip(), extra_info["answer"]))
            return {"next_state": state + action, "reward": r, "score": r, "done": True, "extra_info": extra_info}
        calls = _CALC.findall(action)
        if calls:
            return {
                "next_state": state + action + observe(calls[-1]),
                "reward": 0.0,
                "score": 0.0,
                "done": False,
                "extra_info": extra_info,
            }
        return {"next_state": state + action, "reward": 0.0, "score": 0.0, "done": True, "extra_info": extra_info}


def _expression(rng: random.Random, operands: list[int]) -> str:
    """A random fully-formed expression over ``operands`` (in order), + - * with parentheses."""
    if len(operands) == 1:
        return str(operands[0])
    cut = rng.randrange(1, len(operands))
    left, right = _expression(rng, operands[:cut]), _expression(rng, operands[cut:])
    op = rng.choice(["+", "-", "*"])
    left = f"({left})" if cut > 1 else left
    right = f"({right})" if len(operands) - cut > 1 else right
    return f"{left} {op} {right}"


def make_calculator_records(
    n: int, seed: int = 0, *, min_operands: int = 3, max_operands: int = 4, chat: bool = False
) -> list[dict[str, Any]]:
    """``n`` arithmetic problems with integer answers (2-3 digit operands, + - *, parentheses).

    Records: ``{"prompt": ..., "extra_info": {"answer": "1234", "expression": "..."}}`` (or
    ``messages`` with one user turn when ``chat``). Deterministic in ``seed``.
    """
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        k = rng.randint(min_operands, max_operands)
        expr = _expression(rng, [rng.randint(10, 999) for _ in range(k)])
        answer = format_number(_eval(expr))
        text = TEMPLATE.replace("{expression}", expr)
        prompt: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        records.append({**prompt, "extra_info": {"answer": answer, "expression": expr}})
    return records


def reward(prompt: str, response: str, extra_info: dict, **_: Any) -> dict:
    """A whole episode's text scored at once: 1 if its last ``<answer>`` is right (what the
    environment gives at the end of the episode)."""
    answers = _ANSWER.findall(response)
    r = float(bool(answers) and answer_correct(answers[-1].strip(), extra_info["answer"]))
    return {"reward": r, "score": r, "components": {"correct": r}}


def parse_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    for key in ("expression", "answer"):
        if raw.get(key) is None:
            raise DataError(source, row, key, "missing")
    return {"expression": raw["expression"]}, {"answer": str(raw["answer"]), "expression": raw["expression"]}


def task(*, chat: bool = False, system_prompt: str | None = None, **_: Any) -> Task:
    """The calculator tool task: generated problems, ``CalculatorEnv`` episodes."""
    return Task(
        name="calculator", parse_row=parse_row, template=TEMPLATE, reward_spec="relign.envs.calculator:reward",
        chat=chat, system_prompt=system_prompt, env="relign.envs.calculator:CalculatorEnv",
        generate_spec="relign.envs.calculator:make_calculator_records", term_weights={"correct": 1.0},
    )
