"""A toy RL task a random tiny model solves sometimes: start the answer with a space.

About 15% of a random micro model's completions start with a space-led token, so groups
have reward variance from the first step and RL has something to amplify.
"""

from __future__ import annotations

from pathlib import Path

from .conftest import write_jsonl

REWARD_SRC = '''
def reward(prompt, response, extra_info):
    return 1.0 if response.startswith(" ") else 0.0


def graded(prompt, response, extra_info):
    """A reward with more spread (for tests that need non-zero advantages)."""
    return {"reward": response.count(" ") / 4.0, "score": float(response.startswith(" ")),
            "components": {"spaces": float(response.count(" ")), "lead": float(response.startswith(" "))}}
'''


def make_toy(tmp: Path) -> tuple[Path, Path]:
    prompts = write_jsonl(tmp / "toy_prompts.jsonl", [{"prompt": f"Write something {i}:"} for i in range(64)])
    reward = tmp / "toy_reward.py"
    reward.write_text(REWARD_SRC)
    return prompts, reward


def toy_overrides(model_dir, tmp: Path, *, fn: str = "reward") -> list[str]:
    prompts, reward = make_toy(tmp)
    return [
        f"model.path={model_dir}", "task.name=custom", f"task.path={prompts}", f"task.reward_fn={reward}:{fn}",
        "task.chat=false", "task.reward_workers=0", "rollout.max_new_tokens=4", "logging.tensorboard=false",
        "logging.progress=false",
    ]
