"""`relign eval strategy=...` (inference-time search) and a sweep, through the real CLI on the tiny model."""

from __future__ import annotations

import json
import math
import xml.dom.minidom

import pytest

from relign.cli import main

from ..conftest import REPO, write_jsonl

FAST = ["max_new_tokens=24", "search.step_max_tokens=8", "search.max_depth=4", "logging.tensorboard=false",
        "logging.progress=false", "task.reward_workers=0"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_tree(tree: list[dict]) -> None:
    assert tree[0]["id"] == 0 and tree[0]["parent"] is None
    ids = {n["id"] for n in tree}
    assert all(n["parent"] in ids for n in tree[1:])
    assert tree[0]["visits"] == sum(1 for n in tree[1:] if n["value"] is not None)  # one visit per evaluated child
    chosen = [n for n in tree if n["chosen"]]
    by_id = {n["id"]: n for n in tree}
    for n in chosen:  # the chosen nodes form one chain from the root
        assert n["parent"] is None or by_id[n["parent"]]["chosen"]


def test_mcts_eval_writes_results_and_the_report_shows_the_tree(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["eval", str(REPO / "examples" / "eval_gsm8k.yaml"), f"model.path={tiny_model_dir}", "task.max_rows=3",
                 "strategy=mcts", "scorer=verifier", f"scorer_path={tiny_model_dir}", "budget.max_generated_tokens=80",
                 f"run_dir={run}", *FAST]) == 0
    result = json.loads((run / "eval.json").read_text())
    m = result["metrics"]
    assert result["strategy"] == "mcts" and m["num_problems"] == 3 and 0 <= m["ci_low"] <= m["accuracy"] <= m["ci_high"] <= 1
    rows = _rows(run / "search.jsonl")
    assert [r["problem"] for r in rows] == [0, 1, 2] and all(r["error"] is None for r in rows)
    for r in rows:
        # the budget: at most one round over it (3 x width x step_max_tokens, or the finishing rollout)
        assert 0 < r["cost"]["generated_tokens"] <= 80 + max(3 * 4 * 8, 24)
        assert r["cost"]["engine_calls"] >= 1 and r["cost"]["scorer_calls"] >= 1
        assert r["candidates"] and all(math.isfinite(c["score"]) for c in r["candidates"])
        _check_tree(r["tree"])
    assert m["tokens_per_question"] == pytest.approx(sum(r["cost"]["generated_tokens"] for r in rows) / 3)
    page = (run / "report.html").read_text()
    assert 'data-node="1"' in page and "sweep" not in json.loads((run / "eval.json").read_text())["strategy"]


def test_sweep_writes_one_table_and_one_chart(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["eval", f"model.path={tiny_model_dir}", "task.name=gsm8k", "task.max_rows=2",
                 "sweep.strategies=[majority,best_of_n,mcts]", "sweep.budgets=[30,90]", "scorer=verifier",
                 f"scorer_path={tiny_model_dir}", f"run_dir={run}", *FAST]) == 0
    sweep = json.loads((run / "sweep.json").read_text())
    cells = [(r["strategy"], r["budget"]) for r in sweep["rows"]]
    assert cells == [(s, b) for s in ("majority", "best_of_n", "mcts") for b in (30, 90)]
    for r in sweep["rows"]:
        assert (run / r["file"]).is_file() and len(_rows(run / r["file"])) == 2
        assert r["engine_calls"] >= 1 and r["num_problems"] == 2 and r["ci_low"] <= r["accuracy"] <= r["ci_high"]
        assert r["scorer"] == ("" if r["strategy"] == "majority" else "verifier")
    # a larger budget never spends fewer tokens (the same seeds: the small run is a prefix of the large one)
    tok = {(r["strategy"], r["budget"]): r["tokens_per_question"] for r in sweep["rows"]}
    assert all(tok[(s, 90)] >= tok[(s, 30)] for s in ("majority", "best_of_n", "mcts"))
    table = (run / "sweep.md").read_text().splitlines()
    assert len(table) == 2 + 6 and "accuracy [95% CI]" in table[0]
    svg = xml.dom.minidom.parse(str(run / "accuracy_vs_tokens.svg"))
    assert len([g for g in svg.getElementsByTagName("g") if g.getAttribute("class") == "series"]) == 3
    page = (run / "report.html").read_text()
    assert "mcts (verifier)" in page and "errbar" in page


def test_rule_scorer_allowed_where_the_reward_needs_no_gold_answer(tiny_model_dir, tmp_path):
    # countdown checks the expression against the numbers in the prompt: no gold answer is read
    run = tmp_path / "run"
    assert main(["eval", f"model.path={tiny_model_dir}", "task.name=countdown", "task.max_rows=2", "strategy=step_beam",
                 "scorer=rule", "search.beam.beams=2", "search.width=2", "budget.max_simulations=2", f"run_dir={run}", *FAST]) == 0
    rows = _rows(run / "search.jsonl")
    assert len(rows) == 2 and all(r["tree"] is None and r["cost"]["scorer_calls"] >= 1 for r in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy=nope"], "choose one of sample, cot, majority, best_of_n, weighted_majority, step_beam, mcts"),
        (["strategy=mcts", "scorer=nope"], "choose one of rule, verifier, rm, prm"),
        (["strategy=best_of_n", "scorer=rule", "budget.max_samples=2"], "reads the gold answer"),  # the guard
        (["strategy=mcts", "scorer=verifier", "scorer_path=no/such/dir/here", "budget.max_simulations=2"],
         "scorer_path 'no/such/dir/here' does not exist"),
        (["strategy=majority", "budget.max_generated_tokens=0"], "budget.max_generated_tokens must be a positive integer"),
        (["strategy=majority", "budget.max_samples=-3"], "budget.max_samples must be a positive integer"),
        (["strategy=majority"], "a budget needs at least one of"),
        (["strategy=best_of_n", "budget.max_samples=2"], "needs a scorer"),
        (["strategy=majority", "budget.max_samples=2", "search.temperature=0"], "search.temperature must be > 0"),
        (["sweep.budgets=[64]"], "sweep.budgets are token budgets of a search"),
    ],
)
def test_search_config_errors_are_one_line(args, message, tiny_model_dir, tmp_path, capsys):
    assert main(["eval", f"model.path={tiny_model_dir}", "task.max_rows=1", f"run_dir={tmp_path / 'run'}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_tree_search_on_a_task_without_answer_marker_names_the_option(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say 1:", "answer": "1"}])
    reward = tmp_path / "r.py"
    reward.write_text("def reward(prompt, response, extra_info):\n    return float(extra_info['answer'] in response)\n")
    args = ["eval", f"model.path={tiny_model_dir}", "task.name=custom", f"task.path={data}", f"task.reward_fn={reward}",
            "task.chat=false", "strategy=mcts", "scorer=verifier", f"scorer_path={tiny_model_dir}",
            "budget.max_simulations=1", f"run_dir={tmp_path / 'run'}", *FAST]
    assert main(args) == 2
    assert "set search.answer_marker" in capsys.readouterr().err
    assert main([*args, "search.answer_marker='####'"]) == 0  # set (quoted: YAML reads # as a comment), it runs


def test_search_preset_runs_as_shipped(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["eval", str(REPO / "examples" / "eval_search.yaml"), f"model.path={tiny_model_dir}", "task.max_rows=2",
                 f"run_dir={run}", "logging.tensorboard=false", "logging.progress=false", "task.reward_workers=0"]) == 0
    sweep = json.loads((run / "sweep.json").read_text())
    assert sweep["task"] == "countdown" and sweep["scorer"] == "rule"
    assert {r["strategy"] for r in sweep["rows"]} == {"majority", "best_of_n", "step_beam", "mcts"}
    assert all(r["failed"] == 0 and r["num_problems"] == 2 for r in sweep["rows"])
