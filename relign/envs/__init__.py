"""Tasks with verifiable rewards and multi-turn environments (DESIGN.md, "Tasks and environments").

* ``base``: ``Task``, ``load_function`` (``"file.py:fn"`` specs) and ``make_custom_task``;
* ``reward_fn``: the reward contract: ``RewardResult``, ``normalize_reward``, the two call
  styles (per sample, TRL's batched) and ``combine`` (the built-in tasks' reward);
* ``gsm8k``, ``math``, ``countdown``, ``arith``: built-in tasks, each with a module-level
  ``reward(prompt, response, extra_info, *, format_weight=0.0)`` and ``task(...)`` factory;
* ``tasks``: the ``TASKS`` registry and ``get_task``, ``build_task`` (the task as rl and eval
  build it), ``Problem``, ``render_prompt`` (the one way a record becomes prompt text + ids),
  ``problem_text``, ``encode_problems``;
* ``rewards``: ``RewardPool``, rewards in worker processes with a timeout per call;
* ``env``: the ``Env`` protocol (RL2's ``step``); ``calculator``: a tool-use env;
* ``safe_arith``: the arithmetic evaluator Countdown and the calculator share;
* ``data/``: the shipped test sets (see data/README.md).

Importing this package is cheap: math_verify/sympy load only when the math reward runs.
"""

from relign.envs.base import Task, load_function, make_custom_task
from relign.envs.env import Env
from relign.envs.reward_fn import RewardResult, normalize_reward
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
