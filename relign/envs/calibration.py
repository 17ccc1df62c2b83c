"""Tasks of linguistic calibration (Band et al., arXiv 2404.00474): ``calibration`` and ``lc``.

Neither task's reward is its rule: what trains is the reader reward (``reward.kind=reader``,
``models/reader.py``). The rule each task carries scores correctness of the reader's top answer
(``score``, logged as accuracy), so a run with ``reward.rule_weight=0`` trains on the reader alone.

**calibration** — a generated task where the true probability is known. Each feature f (default
``red`` with q = 0.2 and ``blue`` with q = 0.8; ``task.features`` sets them) names a room; a
record's prompt depends only on its room::

    Room: red. Which box holds the coin, left or right? State your confidence that it is left.

so a model cannot memorize per-record answers. Its hidden answer is ``left`` with probability
q_f, drawn from the record's own seed (``random.Random("calibration:<seed>:<index>")``: the same
records for a seed, fresh draws for another). The response is one confidence token,
``conf: 7`` = P(left) = 0.7, which ``RuleReader`` reads as left 0.7, right 0.3. The expected log
(or Brier) reward over the records of room f is maximized exactly at P(left) = q_f.

**lc** — the paper's RL records from a file, dataset folder or hub id whose rows hold the
paragraph-generation prompt, the TriviaQA question and its answer (with aliases)::

    {"paragraph_generation_prompt": "Write a paragraph about ...", "question": "...",
     "answer": "Paris" | {"value": "Paris", "aliases": [...]}, "aliases": [...]}

(``prompt`` works for the first field). The hub's ``tatsu-lab/linguistic_calibration`` ``ppo``
config carries the prompts and question ids only: join it with TriviaQA ``unfiltered.nocontext``
on ``question_id`` first (its data is CC BY-NC: relign ships none of it).
"""

from __future__ import annotations

import random
from typing import Any

from relign.data.readers import DataError
from relign.envs.base import Task, generated
from relign.envs.reader_rules import answers_match, normalize_answer, parse_statements

FEATURES = {"red": 0.2, "blue": 0.8}
"""The default rooms and their q_f = P(hidden answer = left)."""
OPTIONS = ("left", "right")
QUESTION = "Which box holds the coin, left or right?"
TEMPLATE = "Room: {feature}. " + QUESTION + " State your confidence that it is left."


def check_features(features: dict[str, float]) -> dict[str, float]:
    """The features as ``{name: q}`` with every q in [0, 1] (``ValueError`` naming the bad one)."""
    out = {}
    for name, q in (features or FEATURES).items():
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= float(q) <= 1.0:
            raise ValueError(f"task.features.{name}={q!r}: a probability in [0, 1] is needed")
        out[str(name)] = float(q)
    return out


def make_records(n: int, seed: int = 0, *, chat: bool = False, features: dict[str, float] | None = None) -> list[dict]:
    """``n`` records, the features in turn (record i has feature i mod F); the hidden answer of
    record i is ``left`` with probability q_f, drawn from ``(seed, i)`` alone."""
    feats = list(check_features(features or FEATURES).items())
    records = []
    for i in range(n):
        name, q = feats[i % len(feats)]
        y = OPTIONS[0] if random.Random(f"calibration:{seed}:{i}").random() < q else OPTIONS[1]
        text = TEMPLATE.replace("{feature}", name)
        prompt: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        # every record of a room has the same text: the problem is its draw (seed, i), which the
        # held-out split (envs.base.disjoint) compares, so fresh draws are never dropped as seen
        records.append({**prompt, "extra_info": {"question": QUESTION, "answer": y, "aliases": [], "feature": name, "q": q,
                                                 "problem_key": f"calibration:{seed}:{i}"}})
    return records


def reward(prompt: str, response: str, extra_info: dict, **_: Any) -> dict:
    """The rule of both tasks: 1 when the response's most probable stated answer is the gold one
    (``RuleReader``'s statements; ties go to the first stated), format 1 when it states any."""
    stmts, _ = parse_statements(extra_info.get("question", ""), response)
    gold = [extra_info["answer"], *(extra_info.get("aliases") or [])]
    top = max(stmts, key=lambda s: s[1])[0] if stmts else None
    correct = float(top is not None and answers_match(top, gold))
    return {"reward": correct, "score": correct, "components": {"correct": correct, "format": float(bool(stmts))}}


def frequency_summary(query: str, paragraphs: list[str]) -> str:
    """Summary distillation for short answers: the K sampled answers as one hedged statement,
    "I think it is A with 60% likelihood, B with 40%." (answers grouped by TriviaQA
    normalization, in order of frequency then first appearance; percentages by largest remainder,
    so they sum to 100). Every answer is its paragraph's first sentence; no answer: "No Answer"."""
    counts: dict[str, list] = {}
    for z in paragraphs:
        stmts, _ = parse_statements("", z)
        if not stmts:
            continue
        answer = stmts[0][0]
        key = normalize_answer(answer)
        counts.setdefault(key, [answer, 0])[1] += 1
    total = sum(n for _, n in counts.values())
    if not total:
        return "No Answer"
    ranked = sorted(counts.values(), key=lambda an: -an[1])  # stable: ties keep first appearance
    exact = [100 * n / total for _, n in ranked]
    pct = [int(x) for x in exact]
    for i in sorted(range(len(ranked)), key=lambda i: -(exact[i] - pct[i]))[: 100 - sum(pct)]:
        pct[i] += 1
    parts = [f"{a} with {p}% likelihood" if i == 0 else f"{a} with {p}%" for i, ((a, _), p) in enumerate(zip(ranked, pct))]
    return "I think it is " + ", ".join(parts) + "."


def task(*, chat: bool = False, system_prompt: str | None = None, features: dict[str, float] | None = None,
         **_: Any) -> Task:
    """The synthetic calibration task (records generated from ``task.features`` and the seed)."""
    return Task(name="calibration", parse_row=generated, template=TEMPLATE, reward_spec="relign.envs.calibration:reward",
                chat=chat, system_prompt=system_prompt, generate_spec="relign.envs.calibration:make_records",
                generate_kwargs={"features": check_features(features or FEATURES)}, term_weights={"correct": 1.0},
                step_delimiter=None)



def parse_lc_row(raw: dict, source: str, row: int) -> tuple[dict, dict]:
    """An LC record: its paragraph prompt, question, answer and aliases (``DataError`` naming the field)."""
    prompt = raw.get("paragraph_generation_prompt", raw.get("prompt"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(source, row, "paragraph_generation_prompt", "missing (or 'prompt'): the query the model writes for")
    question = raw.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataError(source, row, "question", "missing: the reader's question")
    answer = raw.get("answer")
    aliases = raw.get("aliases")
    if isinstance(answer, dict):  # TriviaQA's answer object
        aliases = aliases if aliases is not None else answer.get("aliases")
        answer = answer.get("value")
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(source, row, "answer", "missing: the gold answer (a string, or TriviaQA's {value, aliases})")
    aliases = aliases or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise DataError(source, row, "aliases", "expected a list of strings")
    return {"prompt": prompt}, {"question": question, "answer": answer, "aliases": list(aliases)}


def lc_task(*, chat: bool = True, system_prompt: str | None = None, **_: Any) -> Task:
    """The LC RL task (``task.path`` = a file, dataset folder or hub id of LC records)."""
    return Task(name="lc", parse_row=parse_lc_row, template="{prompt}", reward_spec="relign.envs.calibration:reward",
                chat=chat, system_prompt=system_prompt, default_path=None, split="train", term_weights={"correct": 1.0},
                step_delimiter=None)


__all__ = ["FEATURES", "QUESTION", "TEMPLATE", "check_features", "frequency_summary", "lc_task", "make_records", "parse_lc_row", "reward", "task"]
