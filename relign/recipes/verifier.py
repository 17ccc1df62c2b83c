"""Generative verifier (GenRM, Zhang et al., arXiv 2408.15240): SFT a model to answer
"Is the answer correct? Yes/No" after a problem and a solution; its score is P("Yes").

    1. data     graded samples -> {"messages": [user: problem + solution + question,
                                                assistant: "Yes" | "No"]}
                from RL traces (RUN/rollouts/step_*.jsonl), eval samples (RUN/samples.jsonl)
                or any JSONL with problem / response / correct; deduplicated, optionally
                balanced, written to RUN/verifier_data.jsonl
    2. train    the SFT recipe on that file (same loop, checkpoints and resume)
    3. measure  on the held-out rows: accuracy of P(Yes) > 0.5, mean P(Yes) on correct and
                on incorrect solutions, written to RUN/verifier_eval.json

A trained verifier is used as a learned reward by ``relign rl reward.model=RUN/checkpoints/step_N``
(``models.reward.VerifierScorer``), and ranks samples in best-of-N search.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import banner, rundir
from ..checks import check_common, check_divides, check_fraction, check_model_path, check_non_negative, check_positive
from ..config import ConfigError, OptimConfig, StepFields
from ..data.readers import DataError, read_records
from ..models.reward import NO, VERIFIER_TEMPLATE, YES, VerifierScorer, verifier_messages
from . import RunResult, frame, sft

PROBLEM_KEYS = ("problem", "question", "prompt")  # RL traces: problem; eval samples: question
RESPONSE_KEYS = ("response", "solution", "completion")
LABEL_KEYS = ("correct", "label", "score")


@dataclass
class VerifierDataConfig:
    rollouts: list[str] = field(default_factory=list)
    """Graded samples: run directories (RL traces in rollouts/, eval samples.jsonl) or JSONL files."""
    path: str = ""
    """Ready verifier rows {problem, response, correct} (used in addition to rollouts)."""
    template: str = VERIFIER_TEMPLATE
    """The verifier's question, with {problem} and {solution}."""
    balance: bool = True
    """Keep as many correct as incorrect solutions (drop the surplus at random)."""
    max_per_problem: int = 0
    """Keep at most this many solutions per problem (0 = all)."""
    eval_fraction: float = 0.1
    """Fraction of the problems held out to measure the verifier."""
    max_length: int = 1024
    """Longest verifier example in tokens."""


@dataclass
class Config(StepFields):
    data: VerifierDataConfig = field(default_factory=VerifierDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03))


def _first(row: dict, keys: tuple[str, ...], types: tuple[type, ...] = (str,)) -> tuple[str | None, Any]:
    """The first of ``keys`` whose value has one of ``types`` (an eval run's ``problem`` is an
    index, its ``question`` the text), else the first present key and its value for the error."""
    present = [k for k in keys if row.get(k) is not None]
    for k in present:
        if isinstance(row[k], types):
            return k, row[k]
    return (present[0], row[present[0]]) if present else (None, None)


def _sources(entry: str) -> list[Path]:
    p = Path(entry)
    if p.is_dir():
        files = sorted((p / "rollouts").glob("step_*.jsonl"), key=lambda f: int(f.stem.split("_")[1]))
        if (p / "samples.jsonl").is_file():
            files.append(p / "samples.jsonl")
        if not files:
            raise FileNotFoundError(f"{p}/rollouts/step_*.jsonl or {p}/samples.jsonl")
        return files
    if not p.is_file():
        raise FileNotFoundError(str(p))
    return [p]


def graded_samples(entries: list[str]) -> list[dict[str, Any]]:
    """Every graded (problem, response, correct) in these sources, in order.

    Field names are those of relign's own outputs and common exports: the problem from
    problem / question / prompt, the response from response / solution / completion, the grade
    from correct / label (bool) or score (correct when > 0.5)."""
    out = []
    for entry in entries:
        for src in _sources(entry):
            for row, raw in read_records(str(src)):
                if not isinstance(raw, dict):
                    raise DataError(str(src), row, None, f"expected an object, got {type(raw).__name__}")
                pk, problem = _first(raw, PROBLEM_KEYS)
                rk, response = _first(raw, RESPONSE_KEYS)
                lk, label = _first(raw, LABEL_KEYS, (bool, int, float))
                for key, value, keys in ((pk, problem, PROBLEM_KEYS), (rk, response, RESPONSE_KEYS)):
                    if not isinstance(value, str):
                        raise DataError(str(src), row, key or "/".join(keys), "missing or not a string")
                if isinstance(label, bool):
                    correct = label
                elif isinstance(label, (int, float)):
                    correct = float(label) > 0.5
                else:
                    raise DataError(str(src), row, lk or "/".join(LABEL_KEYS), f"expected a bool or a number, got {label!r:.40}")
                out.append({"problem": problem, "response": response, "correct": correct})
    return out


def build_verifier_rows(samples: list[dict[str, Any]], *, template: str = VERIFIER_TEMPLATE, balance: bool = True,
                        max_per_problem: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """Graded samples -> chat rows whose assistant turn is "Yes" (correct) or "No".

    Identical (problem, response) pairs are kept once; ``balance`` drops the surplus of the
    larger class at random so that the verifier's prior P(Yes) starts near 1/2."""
    rng = random.Random(seed)
    seen, per_problem, kept = set(), {}, []
    for s in samples:
        key = (s["problem"], s["response"].strip())
        if key in seen:
            continue
        seen.add(key)
        if max_per_problem and per_problem.get(s["problem"], 0) >= max_per_problem:
            continue
        per_problem[s["problem"]] = per_problem.get(s["problem"], 0) + 1
        kept.append(s)
    if balance:
        yes = [s for s in kept if s["correct"]]
        no = [s for s in kept if not s["correct"]]
        n = min(len(yes), len(no))
        keep_ids = {id(s) for s in rng.sample(yes, n) + rng.sample(no, n)}
        kept = [s for s in kept if id(s) in keep_ids]
    return [
        {"messages": [*verifier_messages(s["problem"], s["response"], template),
                      {"role": "assistant", "content": YES if s["correct"] else NO}],
         "problem": s["problem"], "response": s["response"], "correct": s["correct"]}
        for s in kept
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _check(cfg: Config) -> None:
    """Every setting that cannot work, before any data or model is read."""
    d = cfg.data
    if not d.rollouts and not d.path:
        raise ConfigError("give graded samples: data.rollouts=[RUN_DIR or FILE, ...] and/or data.path=FILE")
    if "{problem}" not in d.template or "{solution}" not in d.template:
        raise ConfigError("data.template must contain {problem} and {solution}")
    check_positive(cfg, "batch_size", "micro_batch_size", "epochs", "data.max_length")
    check_non_negative(cfg, "max_steps", "data.max_per_problem")
    check_fraction(cfg, "data.eval_fraction")
    check_divides(cfg, "batch_size", "micro_batch_size")
    check_common(cfg)
    check_model_path("model.path", cfg.model.path)


def train(cfg: Config) -> RunResult:
    # verifier.yaml: config.yaml is the SFT stage's, written by sft.train into the same directory
    run = frame.open(cfg, "verifier", check=_check, config_name="verifier.yaml")
    d, run_dir = cfg.data, run.run_dir

    # ---- 1. data: graded samples -> Yes/No rows, split by problem (no problem on both sides)
    samples = graded_samples(list(d.rollouts) + ([d.path] if d.path else []))
    rows = build_verifier_rows(samples, template=d.template, balance=d.balance, max_per_problem=d.max_per_problem, seed=cfg.seed)
    if len(rows) < 2:
        raise ConfigError(f"only {len(rows)} usable verifier rows from {len(samples)} graded samples "
                          "(both correct and incorrect solutions are needed when data.balance=true)")
    problems = sorted({r["problem"] for r in rows})
    random.Random(cfg.seed).shuffle(problems)
    n_eval = int(len(problems) * d.eval_fraction) if d.eval_fraction > 0 else 0
    held = set(problems[:n_eval])
    train_rows = [r for r in rows if r["problem"] not in held]
    eval_rows = [r for r in rows if r["problem"] in held]
    _write_jsonl(run_dir / "verifier_data.jsonl", train_rows)
    if eval_rows:
        _write_jsonl(run_dir / "verifier_eval_data.jsonl", eval_rows)
    total, per_epoch = frame.schedule(cfg, len(train_rows))  # before SFT drops rows over data.max_length
    # the parameters are counted from the model's config (the SFT stage loads the weights)
    banner.start("verifier", cfg, run_dir=run_dir, device=run.device,
                 data=banner.data_line(len(samples), len(train_rows), len(eval_rows), unit="graded samples",
                                       made="verifier rows"),
                 steps=banner.steps_line(total, max_steps=cfg.max_steps, epochs=cfg.epochs, steps_per_epoch=per_epoch,
                                         batch=f"{cfg.batch_size} rows"))

    # ---- 2. train: the SFT recipe on the chat rows (loss on the "Yes"/"No" turn only)
    sft_cfg = sft.Config(
        model=cfg.model, optim=cfg.optim, logging=cfg.logging, checkpoint=cfg.checkpoint, run_dir=str(run_dir),
        resume=cfg.resume, seed=cfg.seed, device=cfg.device, max_steps=cfg.max_steps, epochs=cfg.epochs,
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
    )
    sft_cfg.data.path = str(run_dir / "verifier_data.jsonl")
    sft_cfg.data.max_length = d.max_length
    if eval_rows:
        sft_cfg.data.eval_path = str(run_dir / "verifier_eval_data.jsonl")
    with rundir.nested():  # this run's banner and summary describe it, not the SFT stage's
        result = sft.train(sft_cfg, desc="verifier")  # writes its own resolved config.yaml next to verifier.yaml

    # ---- 3. measure the verifier on the held-out problems
    metrics = dict(result.metrics)
    if eval_rows and result.checkpoint is not None:
        scorer = VerifierScorer(str(result.checkpoint), device=run.device, template=d.template,
                                max_length=d.max_length)
        p_yes = scorer.score([r["problem"] for r in eval_rows], [r["response"] for r in eval_rows])
        summary = verifier_metrics(p_yes, [r["correct"] for r in eval_rows])
        (run_dir / "verifier_eval.json").write_text(json.dumps(summary, indent=2))
        metrics.update({f"verifier/{k}": v for k, v in summary.items()})
    return frame.close(run, metrics=metrics, steps=result.steps, checkpoint=result.checkpoint,
                       keys=("train/loss", "eval/loss", "verifier/accuracy", "verifier/p_yes_correct", "verifier/p_yes_incorrect"))


def verifier_metrics(p_yes: list[float], correct: list[bool]) -> dict[str, float]:
    """Accuracy of the decision P(Yes) > 0.5, and the mean P(Yes) on each class."""
    n = len(p_yes)
    acc = sum((p > 0.5) == c for p, c in zip(p_yes, correct)) / max(n, 1)
    pos = [p for p, c in zip(p_yes, correct) if c]
    neg = [p for p, c in zip(p_yes, correct) if not c]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"accuracy": acc, "p_yes_correct": mean(pos), "p_yes_incorrect": mean(neg), "rows": float(n)}
