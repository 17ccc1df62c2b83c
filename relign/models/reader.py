"""Readers of linguistic calibration (Band et al., arXiv 2404.00474) and the reward they give.

A reader reads a paragraph z written for a question x and forecasts the answer:

    class Reader(Protocol):
        extract(questions, paragraphs) -> list[list[str]]            the answers each z commits to
        forecast(questions, paragraphs, answers) -> list[float]       P(answer a is right | x, z)

Two implementations:

* ``RuleReader`` (``envs/reader_rules.py``): explicit confidence statements, no model; for tests
  and the synthetic ``calibration`` task.
* ``LMReader``: the paper's surrogate reader of two models. *ExtractAnswers* is a causal LM
  sampled through relign's engine (the caller passes ``generate``: prompt texts -> completion
  texts) on ``EXTRACT_TEMPLATE``; its output is the answers joined by "; ", or "No Answer".
  *ForecastProbs* is a one-output sequence classifier (``relign rm loss=bce``) read as
  sigma(logit) on ``FORECAST_TEMPLATE`` with an empty response. Templates are relign's own.

``ReaderScorer`` turns a reader into the RL reward (``algorithms.scoring.lc_reward``): the
reference's rows are one forecast of the gold answer, then one per deduplicated extracted
answer; R = S(f_y) - lam |sum_a f_a - 1| + offset, and a response that never stopped gets the
fixed ``unfinished_reward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..algorithms.scoring import RULES, ece, lc_reward, top_answer
from ..envs.reader_rules import NO_ANSWER, RuleReader, answers_match, normalize_answer
from .reward import RewardModelScorer, Scorer, scorer_kind

EXTRACT_TEMPLATE = ("Question: {question}\n\nParagraph: {paragraph}\n\nList every answer to the question that the "
                    "paragraph gives, separated by '; ', or write 'No Answer' if it gives none.")
"""The extractor's prompt (its SFT rows use it too: ``{prompt: extract_prompt(x, z), completion: "a; b"}``)."""
FORECAST_TEMPLATE = ("Question: {question}\n\nParagraph: {paragraph}\n\nCandidate answer: {answer}\n\n"
                     "How likely is the candidate answer correct, judging only from the paragraph?")
"""The forecaster's prompt (its BCE rows: ``{prompt: forecast_prompt(x, z, a), response: "", label: p}``)."""
MAX_ANSWERS = 8
"""Most answers kept from one extraction: a degenerate extractor must not multiply the forecaster's rows."""
MAX_ANSWER_CHARS = 200


def extract_prompt(question: str, paragraph: str) -> str:
    return EXTRACT_TEMPLATE.replace("{question}", question).replace("{paragraph}", paragraph)


def forecast_prompt(question: str, paragraph: str, answer: str) -> str:
    return FORECAST_TEMPLATE.replace("{question}", question).replace("{paragraph}", paragraph).replace("{answer}", answer)


class Reader(Protocol):
    def extract(self, questions: Sequence[str], paragraphs: Sequence[str]) -> list[list[str]]: ...

    def forecast(self, questions: Sequence[str], paragraphs: Sequence[str],
                 answers: Sequence[str | Sequence[str]]) -> list[float]: ...


def parse_extraction(text: str) -> list[str] | None:
    """The extractor's output as answers: split on ";", stripped, deduplicated by normalized form,
    at most ``MAX_ANSWERS``; [] for "No Answer"; None when nothing is left (nothing parsable)."""
    if normalize_answer(text) == NO_ANSWER:
        return []
    out: list[str] = []
    seen: set[str] = set()
    for part in text.split(";"):
        a = part.strip()[:MAX_ANSWER_CHARS]
        key = normalize_answer(a)
        if key and key != NO_ANSWER and key not in seen:
            seen.add(key)
            out.append(a)
    return out[:MAX_ANSWERS] or None


class Forecaster:
    """ForecastProbs: P(a correct | x, z) = sigma(logit) of a one-output sequence classifier."""

    def __init__(self, path: str, *, key: str = "reward.model", **kwargs: Any):
        kind = scorer_kind(path)  # FileNotFoundError for a folder without config.json
        if kind != "rm":
            raise ValueError(f"{key}={path} is not a sequence-classification checkpoint (a forecaster is one: "
                             "train it with relign rm loss=bce)")
        self.scorer = RewardModelScorer(path, **kwargs)

    def __call__(self, prompts: list[str]) -> list[float]:
        logits = self.scorer.score(prompts, [""] * len(prompts))
        return torch.sigmoid(torch.tensor(logits, dtype=torch.float64)).tolist()


class LMReader:
    """The paper's reader: an extractor LM (``generate``: prompt texts -> texts; None: the rule
    reader extracts) and a forecaster (prompt texts -> probabilities).

    ``empty`` counts extractions with nothing parsable (read as no answer)."""

    def __init__(self, generate: Callable[[list[str]], list[str]] | None, forecaster: Callable[[list[str]], list[float]]):
        self.generate, self.forecaster = generate, forecaster
        self.rules = RuleReader()
        self.empty = 0

    def extract(self, questions: Sequence[str], paragraphs: Sequence[str]) -> list[list[str]]:
        if self.generate is None:
            return self.rules.extract(questions, paragraphs)
        texts = self.generate([extract_prompt(q, z) for q, z in zip(questions, paragraphs, strict=True)])
        out = []
        for t in texts:
            answers = parse_extraction(t)
            self.empty += answers is None
            out.append(answers or [])
        return out

    def forecast(self, questions: Sequence[str], paragraphs: Sequence[str],
                 answers: Sequence[str | Sequence[str]]) -> list[float]:
        names = [a if isinstance(a, str) else a[0] for a in answers]  # the model reads the answer, not its aliases
        return self.forecaster([forecast_prompt(q, z, a) for q, z, a in zip(questions, paragraphs, names, strict=True)])


def gold_of(extra_info: dict, row: int) -> list[str]:
    """[answer, *aliases] of a record's ``extra_info`` (``ValueError`` naming the field if absent)."""
    answer = extra_info.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"reward.kind=reader: record {row}: extra_info.answer is missing or not a string "
                         f"(keys: {sorted(extra_info)})")
    aliases = extra_info.get("aliases") or []
    return [answer, *(a for a in aliases if isinstance(a, str))]


class ReaderScorer(Scorer):
    """The reader reward of a batch of responses, with its components (``score_detailed``)."""

    def __init__(self, reader: Reader, *, rule: str = "log", eps: float = 1e-4, lam: float = 5.0, offset: float = 5.0,
                 unfinished_reward: float = -1.0):
        if rule not in RULES:
            raise ValueError(f"unknown scoring rule {rule!r} (log or brier)")
        self.reader, self.rule, self.eps, self.lam, self.offset = reader, rule, eps, lam, offset
        self.unfinished_reward = unfinished_reward

    def score(self, problems: list[str], responses: list[str], *, extra_infos: list[dict] | None = None,
              finished: list[bool] | None = None) -> list[float]:
        return [d["reward"] for d in self.score_detailed(problems, responses, extra_infos=extra_infos, finished=finished)]

    def score_detailed(self, problems: list[str], responses: list[str], *, extra_infos: list[dict] | None = None,
                       finished: list[bool] | None = None) -> list[dict[str, float]]:
        """Per response: ``reward`` and ``lc_<rule>``, ``lc_norm_penalty``, ``lc_forecast`` (of the
        gold answer), ``lc_unfinished``, ``lc_answers`` (extracted), ``lc_confidence`` (the top
        extracted answer's forecast, clipped to [0, 1]), ``lc_correct`` (the top answer is the gold
        one) and ``lc_no_answer``. A response with no extracted answer is confidence 1 and wrong
        (``algorithms.scoring.top_answer``): abstaining must count against calibration, not for it."""
        n = len(responses)
        infos = extra_infos or [{}] * n
        finished = finished or [True] * n
        golds = [gold_of(info, i) for i, info in enumerate(infos)]
        questions = [info.get("question") or p for info, p in zip(infos, problems)]
        extracted = self.reader.extract(questions, responses)
        # one batched forecast: the gold row of every response, then one row per extracted answer
        rows_q, rows_z, rows_a = list(questions), list(responses), list(golds)
        for q, z, ans in zip(questions, responses, extracted):
            rows_q += [q] * len(ans)
            rows_z += [z] * len(ans)
            rows_a += ans
        f = self.reader.forecast(rows_q, rows_z, rows_a)
        out, at = [], n
        for i in range(n):
            ans, fs = extracted[i], f[at : at + len(extracted[i])]
            at += len(ans)
            true_index = next((j for j, a in enumerate(ans) if answers_match(a, golds[i])), None)
            d = lc_reward(f[i], fs, true_index=true_index, rule=self.rule, eps=self.eps, lam=self.lam, offset=self.offset,
                          finished=finished[i], unfinished_reward=self.unfinished_reward)
            conf, correct, answered = top_answer(fs, [answers_match(a, golds[i]) for a in ans])
            d.update(lc_answers=float(len(ans)), lc_confidence=conf, lc_correct=correct, lc_no_answer=float(not answered))
            out.append(d)
        return out

    def step_metrics(self, components: list[dict[str, float]]) -> dict[str, float]:
        """The step's calibration over its responses (``score_detailed``'s components): ``calib/ece`` of
        the stated confidences against correctness (a response without an answer already counts as
        confidence 1 and wrong) and ``calib/no_answer_frac``; none when a response lacks the reader's parts."""
        if not components or not all("lc_confidence" in c for c in components):
            return {}
        conf = [min(max(c["lc_confidence"], 0.0), 1.0) for c in components]
        return {"calib/ece": ece(conf, [c["lc_correct"] for c in components]),
                "calib/no_answer_frac": sum(c.get("lc_no_answer", 0.0) for c in components) / len(components)}


__all__ = ["EXTRACT_TEMPLATE", "FORECAST_TEMPLATE", "Forecaster", "LMReader", "Reader", "ReaderScorer", "RuleReader",
           "extract_prompt", "forecast_prompt", "gold_of", "parse_extraction"]
