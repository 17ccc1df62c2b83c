"""The ``Engine`` protocol declares every member the recipes read, with defaults for the optional
ones, so no caller asks an engine by ``getattr`` / ``hasattr`` what it can do (issue 48, item 3)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from relign.rollout.engine import Engine
from relign.rollout.sync_check import can_check, check_sync

PACKAGE = Path(__file__).resolve().parents[2] / "relign"


class _Minimal(Engine):
    """An engine of its own that writes only the protocol's required members."""

    weight_format = "trainer"

    def generate(self, prompts, params, *, seeds=None):
        return [[] for _ in prompts]

    def load_weights(self, named_tensors):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass

    def close(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_an_engine_of_its_own_gets_the_optional_members_defaults():
    e, policy = _Minimal(), torch.nn.Linear(2, 2)
    assert isinstance(e, Engine)
    assert e.weight_fingerprint() is None and e.score_tokens([[1, 2]]) is None and e.perf_metrics() == {}
    assert e.weights_stale is False and e.shares_policy(policy) is False
    # the sync check applies (the engine holds weights of its own) and, with nothing to compare, passes with gap 0
    assert can_check(e, policy)
    assert check_sync(e, policy, [[1, 2, 3]], pad_id=0, tol=1e-3, step=1) == 0.0


def _members() -> set[str]:
    """The protocol's members: its annotated attributes and its methods."""
    return set(Engine.__annotations__) | {k for k, v in vars(Engine).items() if callable(v) and not k.startswith("_")}


def test_no_engine_member_is_read_by_getattr_or_hasattr():
    members = _members()
    assert {"score_tokens", "shares_policy", "weights_stale", "weight_format", "weight_fingerprint"} <= members
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in members:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert found == []
