"""Tasks with verifiable rewards and multi-turn environments (DESIGN.md, "Tasks and environments").

* ``base``: ``Task``, ``RewardResult``, ``normalize_reward``, ``load_function``
  (``"file.py:fn"`` specs) and ``make_custom_task``;
* ``gsm8k``, ``math``, ``countdown``: built-in tasks, each with a module-level
  ``reward(prompt, response, extra_info, *, format_weight=0.0)`` and ``task(...)`` factory;
* ``tasks``: the ``TASKS`` registry and ``get_task``, ``build_task`` (the task as rl and eval build it), ``render_prompt`` (the one way
  a record becomes prompt text + ids), ``problem_text``, ``encode_problems``;
* ``rewards``: ``RewardPool``, rewards in worker processes with a timeout per call;
* ``multiturn``: the ``Env`` protocol (RL2's ``step``); ``calculator``: a tool-use env;
* ``safe_arith``: the arithmetic evaluator Countdown and the calculator share;
* ``data/``: the shipped test sets (see data/README.md).

Importing this package is cheap: math_verify/sympy load only when the math reward runs.
"""

from relign.envs.base import RewardResult, Task, load_function, make_custom_task, normalize_reward
from relign.envs.multiturn import Env
from relign.envs.rewards import RewardPool
from relign.envs.tasks import TASKS, get_task

__all__ = [
    "TASKS",
    "Env",
    "RewardPool",
    "RewardResult",
    "Task",
    "get_task",
    "load_function",
    "make_custom_task",
    "normalize_reward",
]
