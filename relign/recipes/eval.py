"""``relign eval CONFIG``: evaluate a model on a task (accuracy, pass@k, maj@k, lengths), or
run an inference-time search strategy on it (cot, majority, best_of_n, weighted_majority,
step_beam, mcts) under a budget of generated tokens.

    load the task's problems and the model
    strategy=sample: n samples per problem, scored and voted (``relign.evaluate.evaluate``)
          write RUN/eval.json (settings + metrics + notes), RUN/samples.jsonl (one row per sample)
    strategy=<search>: every problem searched in lockstep batches (``relign.evaluate.search_eval``)
          write RUN/eval.json, RUN/search.jsonl (answer, candidates, cost, tree per problem)
    sweep.strategies x sweep.budgets: one search per cell, RUN/search/<strategy>_<budget>.jsonl,
          RUN/sweep.json + sweep.md (the table) + accuracy_vs_tokens.svg (the chart)
    RUN/metrics.jsonl (eval/<metric> at step 0, for the report), and print the summary

The loops themselves (``evaluate``, ``search_eval``) live in ``relign.evaluate``, shared with
RL's ``eval.every``, ReST-EM and the demo; metrics and the samples' schema are in docs/eval.md.
A strategy's own knobs are the section ``search.<section>.*`` its table row names
(``relign.strategies.registry``): ``search.mcts.*``, ``search.beam.*``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import banner, rundir
from ..checkpoint import atomic_write_text
from ..checks import check_choice, check_fraction, check_model_path, check_non_negative, check_positive, check_wandb
from ..config import ConfigError, LoggingConfig, RunFields, TaskConfig, VllmConfig
from ..algorithms.scoring import brier, ece
from ..envs.base import Task
from ..envs.reader_rules import RuleReader
from ..envs.rewards import RewardPool
from ..envs.tasks import build_task, encode_problems
from ..evaluate import evaluate, format_summary, search_eval, sweep_markdown, write_samples
from ..models.loading import load_model_tokenizer
from ..models.reader import Forecaster, LMReader, ReaderScorer
from ..report.reliability import reliability_svg
from ..report.sweep import write_sweep_svg
from ..rollout.engine import ENGINES
from ..rollout.vllm_engine import check_vllm
from ..strategies.base import Budget
from ..strategies.registry import STRATEGIES, make_strategy, options_for
from ..strategies.scorers import SCORERS, TaskRuleScorer, check_reference, load_scorer, looks_like_hub_id
from . import RunResult, build, frame


@dataclass
class BudgetConfig:
    max_generated_tokens: int | None = None
    """Generated tokens per question, rollouts and expansions included (the equal-compute unit)."""
    max_samples: int | None = None
    """Whole samples per question (cot, majority, best_of_n, weighted_majority)."""
    max_simulations: int | None = None
    """Rounds per question of a tree strategy (MCTS simulations, beam steps)."""


@dataclass
class SearchKnobs:
    """The knobs every search strategy may read (each takes those its class has a field for)."""

    temperature: float = 0.7
    """Sampling temperature of every search strategy (the top-level temperature is the sample eval's)."""
    top_p: float = 1.0
    """Nucleus sampling mass of the search (1 = off)."""
    delimiter: str = "\n"
    """Where a reasoning step ends (chat models often use '\\n\\n')."""
    step_max_tokens: int = 128
    """Longest step of step_beam / mcts; a longer one is cut and continued by the next expansion."""
    max_depth: int = 16
    """Steps on a path of step_beam / mcts; the step that reaches it is generated to the end."""
    answer_marker: str = ""
    """Text that marks a final step (empty: the task's own, e.g. '####' for gsm8k)."""
    aggregate: str = "last"
    """Per-step scores to one: last, min, prod or mean (a PRM's steps)."""
    round_size: int = 4
    """Samples per question per engine call (cot, majority, best_of_n, weighted_majority)."""
    width: int = 4
    """Children per MCTS expansion; next steps per kept beam in step_beam."""
    batch_problems: int = 64
    """Questions searched together (lockstep: one engine call per round for all of them)."""
    scorer_batch_size: int = 16
    """Solutions per forward pass of a learned scorer."""
    prefix_cache_mb: int = 512
    """Keys/values of earlier prefixes the engine keeps for the prefixes that extend them (0 = off)."""


# ``search:`` = the shared knobs + one section per strategy with knobs of its own (search.mcts.*,
# search.beam.*), made from the strategies' table: a new strategy adds its section by its row.
SearchConfig = dataclasses.make_dataclass(
    "SearchConfig", [(spec.section, spec.options, field(default_factory=spec.options))
                     for spec in STRATEGIES.values() if spec.section],
    bases=(SearchKnobs,), namespace={"__module__": __name__, "__doc__": "relign eval's search: section."})


@dataclass
class SweepConfig:
    strategies: list[str] = field(default_factory=list)
    """Strategies to compare (empty with budgets set: the one 'strategy')."""
    budgets: list[int] = field(default_factory=list)
    """max_generated_tokens per question for each cell (empty: budget.max_generated_tokens)."""


@dataclass
class Config(RunFields):
    task: TaskConfig = field(default_factory=lambda: TaskConfig(max_prompt_length=0))
    strategy: str = "sample"
    """sample (n samples per problem: pass@k, maj@k), or a search: cot, majority, best_of_n, weighted_majority, step_beam, mcts."""
    scorer: str = ""
    """What ranks or guides a search: verifier, rm, prm (scorer_path), or rule (only where the reward needs no gold answer); strategy=sample: reader (calib/* metrics)."""
    scorer_path: str = ""
    """Checkpoint folder of a verifier / rm / prm scorer."""
    step_tag: str = " ки"
    """The PRM's step tag (one token of its tokenizer), placed after every step it scores."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    n: int = 1
    """Samples per problem."""
    k: int = 0
    """The k of pass@k and maj@k (0 = n)."""
    ks: list[int] = field(default_factory=list)
    """All k values to report pass@k and maj@k for (empty: 1 and k); each must be <= n."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy decoding, which needs n = 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 512
    """Longest completion in tokens; longer ones count as truncated."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    correct_threshold: float = 1.0
    """A sample counts as correct for pass@k / maj@k when its score is at least this."""
    batch_prompts: int = 32
    """Problems sampled together (each brings n rows to the engine)."""
    max_batch_rows: int = 256
    """Most sequences the engine decodes at once."""
    engine: str = "hf"
    """Inference engine: hf (built in) or vllm (colocated vLLM; pip install "relign[vllm]")."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Settings of the vLLM engine (engine=vllm)."""
    train_seed: int | None = None
    """A generated task's training seed, whose problems the held-out set drops (None: the seed in the config.yaml of the run that wrote model.path, else seed)."""
    train_rows: int = 0
    """That training set's problem count (0: the run's task.max_rows from its config.yaml, else the task's default)."""


def _check(cfg: Config) -> list[int]:
    """Validate the settings before anything is loaded; returns the ks to report."""
    check_positive(cfg, "n", "batch_prompts", "max_batch_rows", "max_new_tokens", "top_p", "search.top_p",
                   "task.reward_timeout", "search.step_max_tokens", "search.max_depth", "search.round_size", "search.width",
                   "search.beam.beams", "search.mcts.rollouts", "search.mcts.top_k", "search.batch_problems",
                   "search.scorer_batch_size")
    check_non_negative(cfg, "k", "top_k", "task.max_rows", "task.max_prompt_length", "task.reward_workers",
                       "search.prefix_cache_mb", "search.mcts.c_puct", "search.mcts.c_uct")
    check_fraction(cfg, "top_p", "search.top_p", closed=True)
    bad_budgets = [b for b in cfg.sweep.budgets if b < 1]
    if bad_budgets:
        raise ConfigError(f"bad value for 'sweep.budgets': {list(cfg.sweep.budgets)}; every budget must be >= 1 token")
    check_wandb(cfg.logging)
    check_model_path("model.path", cfg.model.path)
    check_choice("engine", cfg.engine, ENGINES)
    if cfg.engine == "vllm":
        check_vllm(cfg, "", top_p=cfg.top_p, top_k=cfg.top_k)
    if cfg.task.env:
        raise ConfigError(f"task.env={cfg.task.env}: relign eval covers single-turn tasks (a multi-turn environment runs in relign rl)")
    if cfg.temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.temperature == 0 and cfg.n > 1:
        raise ConfigError(f"temperature=0 is greedy decoding: all n={cfg.n} samples would be the same; "
                          "set a temperature (e.g. temperature=0.6) or n=1")
    k = cfg.k or cfg.n
    if not 1 <= k <= cfg.n:
        raise ConfigError(f"k={cfg.k} must lie in [1, n={cfg.n}] (pass@k and maj@k use k of the n samples)")
    ks = sorted(set(cfg.ks)) or sorted({1, k})
    bad = [x for x in ks if not 1 <= x <= cfg.n]
    if bad:
        raise ConfigError(f"ks={list(cfg.ks)}: every k must lie in [1, n={cfg.n}]")
    return ks


def train(cfg: Config) -> RunResult:
    """``relign eval``: evaluate ``model.path`` on ``task``; writes eval.json, samples.jsonl and metrics.jsonl."""
    ks = _check(cfg)
    t, m = cfg.task, cfg.model
    task = build_task(t.name, path=t.path, reward_fn=t.reward_fn, chat=t.chat, system_prompt=t.system_prompt,
                      format_weight=t.format_weight, extract_fn=t.extract_fn, equal_fn=t.equal_fn,
                      reward_style=t.reward_style, answer_format=t.answer_format, sections=t,
                      features=dict(t.features))
    if cfg.strategy == "sample" and cfg.sweep.budgets and not cfg.sweep.strategies:
        raise ConfigError("sweep.budgets are token budgets of a search: set strategy= (or sweep.strategies) to a search "
                          "strategy; strategy=sample is the plain n-sample eval")
    cells = _check_search(cfg, task) if cfg.strategy != "sample" or cfg.sweep.strategies else []
    reader = _reader_for(cfg) if cfg.strategy == "sample" and cfg.scorer == "reader" else None
    run = frame.open(cfg, "eval")  # a fresh directory, never an earlier eval's (relign.rundir)
    train_seed, train_rows, trained_on = _training_set(cfg)
    records = build.heldout_records(task, t.path, t.split, max_rows=t.max_rows, seed=cfg.seed, train_seed=train_seed,
                                    train_rows=train_rows, trained_on=trained_on)
    tok = load_model_tokenizer(m)
    what = (f"{len(cells)} search(es): " + ", ".join(f"{n} (budget {b.max_generated_tokens or '-'})" for n, b in cells)
            if cells else f"{cfg.n} sample(s) per problem at temperature {cfg.temperature:g}")
    run_facts = dict(run_dir=run.run_dir, device=run.device, steps=what, kind="frozen",
                     data=f"{len(records):,} problems ({task.name}: {t.path or task.default_path})")
    banner.dry_run("eval", cfg, **run_facts)  # --dry-run stops here, before any weights are read
    model = build.load_frozen(m.path, m, run.device)
    banner.start("eval", cfg, model=model, **run_facts)
    # a search extends prompts step by step, up to max_new_tokens in all (+ one step past a cut);
    # no prompt limit: as long as the model takes (0)
    longest = t.max_prompt_length and t.max_prompt_length + cfg.max_new_tokens + (cfg.search.step_max_tokens if cells else 0)
    engine = build.engine_for(cfg.engine, model, tok, max_batch_rows=cfg.max_batch_rows, seed=cfg.seed,
                              prefix_cache_bytes=cfg.search.prefix_cache_mb << 20 if cells else 0, m=m, vllm=cfg.vllm,
                              max_model_len=longest, key="engine")
    try:
        if cells:
            metrics = _search(cfg, cells, task, tok, engine, records, run.run_dir, run.device)
            keys = ("accuracy", "ci_low", "ci_high", "tokens_per_question")
        else:
            metrics = _sample_eval(cfg, ks, task, tok, engine, records, run.run_dir, reader=reader)
            k = cfg.k or cfg.n
            keys = ("accuracy", f"pass@{k}", f"maj@{k}", "length_mean", "truncated_frac", *(CALIB_KEYS if reader else ()))
    finally:
        engine.close()
    return frame.close(run, metrics=metrics, keys=keys, steps=0, resumable=False)


def _training_set(cfg: Config) -> tuple[int, int, str]:
    """(seed, rows, what they are) of the training problems a generated task's held-out set must
    avoid: the keys where set, else those of the run that wrote model.path (its config.yaml), else
    this eval's seed and the task's default count. Evaluating an RL run's checkpoint with another
    seed must not check against a training set that run never saw."""
    if cfg.train_seed is not None:
        return cfg.train_seed, cfg.train_rows, f"train_seed={cfg.train_seed}"
    source = rundir.run_config_of(cfg.model.path)
    run = yaml.safe_load(source.read_text()) if source is not None else None
    run_task = run.get("task") if isinstance(run, dict) else None
    if isinstance(run_task, dict) and run_task.get("name") == cfg.task.name and not run_task.get("path"):
        seed = int(run.get("seed") or 0)
        return seed, cfg.train_rows or int(run_task.get("max_rows") or 0), f"the run {source.parent} (seed {seed}, its config.yaml)"
    why = "no run's config.yaml beside model.path" if run_task is None else (
        f"the run of {source} did not train on generated {cfg.task.name} problems")
    return cfg.seed, cfg.train_rows, f"seed {cfg.seed} ({why}; set train_seed and train_rows to the training run's)"


CALIB_KEYS = ("calib/ece", "calib/brier", "calib/accuracy", "calib/no_answer_frac")


def _reader_for(cfg: Config) -> ReaderScorer:
    """scorer=reader: the rule reader (no scorer_path), or the forecaster at scorer_path (rule extraction)."""
    if not cfg.scorer_path:
        return ReaderScorer(RuleReader())
    try:
        return ReaderScorer(LMReader(None, Forecaster(cfg.scorer_path, key="scorer_path", dtype=cfg.model.dtype,
                                                      trust_remote_code=cfg.model.trust_remote_code)))
    except (OSError, ValueError) as e:
        raise ConfigError(f"scorer=reader scorer_path={cfg.scorer_path}: {e}") from None


def calibration_metrics(reader: ReaderScorer, rows: list[dict]) -> dict[str, float]:
    """calib/ece, calib/brier, calib/accuracy of the reader's top answer over every sample, the
    fraction with no answer (``calib/no_answer_frac``: scored as confidence 1 and wrong, the
    reference's worst case), and each row's ``reader`` (confidence, correct, no_answer, forecast
    of the gold answer)."""
    try:
        details = reader.score_detailed([r["question"] for r in rows], [r["response"] for r in rows],
                                        extra_infos=[r["extra_info"] for r in rows])
    except ValueError as e:  # a record without extra_info.answer
        raise ConfigError(f"scorer=reader: {e}") from None
    conf = [min(max(d["lc_confidence"], 0.0), 1.0) for d in details]
    correct = [d["lc_correct"] for d in details]
    no_answer = [bool(d["lc_no_answer"]) for d in details]
    for r, d, c, na in zip(rows, details, conf, no_answer):
        r["reader"] = {"confidence": c, "correct": d["lc_correct"], "no_answer": na, "forecast": d["lc_forecast"]}
    n = max(len(correct), 1)
    return {"calib/ece": ece(conf, correct), "calib/brier": brier(conf, correct), "calib/accuracy": sum(correct) / n,
            "calib/no_answer_frac": sum(no_answer) / n}


def _sample_eval(cfg: Config, ks: list[int], task: Task, tok, engine, records: list[dict], run_dir: Path,
                 reader: ReaderScorer | None = None) -> dict[str, float]:
    """Sample ``cfg.n`` completions per problem and score them; write eval.json, samples.jsonl and
    the metrics, print the summary and its notes; returns the summary."""
    t, t0 = cfg.task, time.perf_counter()
    try:
        summary, rows = evaluate(
            engine, tok, task, records, n=cfg.n, ks=ks, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens, stop=cfg.stop, batch_prompts=cfg.batch_prompts, seed=cfg.seed,
            reward_workers=t.reward_workers, reward_timeout=t.reward_timeout, progress=cfg.logging.progress,
            desc=f"eval {task.name}", max_prompt_length=t.max_prompt_length, correct_threshold=cfg.correct_threshold,
        )
    except ValueError as e:  # e.g. every prompt longer than task.max_prompt_length
        raise ConfigError(str(e)) from None
    if reader is not None:
        summary.update(calibration_metrics(reader, rows))
        graded = [r["reader"] for r in rows]
        atomic_write_text(run_dir / "reliability.svg", reliability_svg(
            [g["confidence"] for g in graded], [g["correct"] for g in graded], [g["no_answer"] for g in graded],
            standalone=True))
    seconds = time.perf_counter() - t0
    notes = []
    if task.extract_spec is None:
        notes.append(f"maj@k omitted: task '{task.name}' has no answer extractor (set task.extract_fn to enable it)")
    if summary.get("reward_errors") or summary.get("reward_timeouts"):
        notes.append(f"{summary['reward_errors']:.0f} reward calls raised and {summary['reward_timeouts']:.0f} timed out "
                     "(scored 0); see reward_error in samples.jsonl")
    if summary["skipped_long"]:
        notes.append(f"{summary['skipped_long']:.0f} problems skipped: prompt longer than task.max_prompt_length")
    result = {
        "model": cfg.model.path, "task": task.name, "data": t.path or task.default_path, "split": t.split or task.split,
        "n": cfg.n, "k": cfg.k or cfg.n, "ks": ks, "temperature": cfg.temperature, "greedy": cfg.temperature == 0,
        "top_p": cfg.top_p, "top_k": cfg.top_k, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
        "metrics": summary, "notes": notes, "seconds": seconds,
    }
    _save(run_dir, cfg.logging, result, rows)
    print(f"{task.name}: {format_summary(summary)}  ({summary['num_problems']:.0f} problems x {cfg.n} samples, {seconds:.1f}s)")
    for note in notes:
        print(f"note: {note}")
    return summary


# --------------------------------------------------------------------------- inference-time search


def _strategy_options(cfg: Config, name: str) -> dict[str, Any]:
    """The options strategy ``name`` takes: the shared ``search.*`` knobs its class has (with the
    sample eval's length and stop strings), and its own section ``search.<section>.*``."""
    s = cfg.search
    shared = {f.name: getattr(s, f.name) for f in dataclasses.fields(SearchKnobs)}
    shared.update(max_new_tokens=cfg.max_new_tokens, stop=tuple(cfg.stop), answer_marker=s.answer_marker or None)
    return options_for(name, shared, {spec.section: getattr(s, spec.section) for spec in STRATEGIES.values() if spec.section})


def _check_search(cfg: Config, task: Task) -> list[tuple[str, Budget]]:
    """Everything a search eval can get wrong, before a model is loaded; returns its cells
    (strategy, budget): one, or the sweep's strategies x budgets."""
    names = list(cfg.sweep.strategies) or [cfg.strategy]
    bad = [n for n in names if n not in STRATEGIES]
    if bad:
        raise ConfigError(f"unknown strategy {', '.join(map(repr, bad))}; choose one of sample, {', '.join(STRATEGIES)}")
    if cfg.scorer and cfg.scorer not in SCORERS:
        raise ConfigError(f"unknown scorer {cfg.scorer!r}; choose one of {', '.join(SCORERS)}")
    needing = [n for n in names if STRATEGIES[n].scorer]
    if needing and not cfg.scorer:
        raise ConfigError(f"strategy {', '.join(needing)} ranks solutions and needs a scorer: set scorer=verifier|rm|prm "
                          "and scorer_path (or scorer=rule for a task whose reward needs no gold answer)")
    if cfg.scorer == "rule":
        try:  # relign eval never lets a search read the gold answer
            check_reference(TaskRuleScorer(task), task, allow_reference=False)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif cfg.scorer and not cfg.scorer_path:
        raise ConfigError(f"scorer={cfg.scorer} needs scorer_path (a {cfg.scorer} checkpoint folder)")
    elif cfg.scorer and not Path(cfg.scorer_path).expanduser().exists() and not looks_like_hub_id(cfg.scorer_path):
        raise ConfigError(f"scorer_path {cfg.scorer_path!r} does not exist")
    if any(STRATEGIES[n].tree for n in names) and not (cfg.search.answer_marker or task.answer_marker):
        raise ConfigError(f"task '{task.name}' has no answer marker, which step_beam and mcts need to tell a final step: "
                          "set search.answer_marker (e.g. '####')")
    if cfg.search.temperature <= 0 and any(STRATEGIES[n].samples_cap != 1 for n in names):
        raise ConfigError("search.temperature must be > 0: every strategy but cot draws several different samples")
    b = cfg.budget
    budgets = list(cfg.sweep.budgets) or [b.max_generated_tokens]
    cells = []
    try:
        for n in names:
            for tokens in budgets:
                cells.append((n, Budget(max_generated_tokens=tokens, max_samples=b.max_samples,
                                        max_simulations=b.max_simulations)))
            make_strategy(n, None, **_strategy_options(cfg, n))  # bad option values fail here
    except ValueError as e:
        raise ConfigError(f"budget/search: {e}") from None
    return cells


def _search(cfg: Config, cells: list[tuple[str, Budget]], task: Task, tok, engine, records: list[dict],
            run_dir: Path, device) -> dict[str, float]:
    """Run every (strategy, budget) cell on the same problems; write its files and the sweep's table."""
    t = cfg.task
    try:
        problems, skipped = encode_problems(tok, records, max_prompt_length=t.max_prompt_length)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not problems:
        raise ConfigError(f"nothing to evaluate: {len(records)} records, {skipped} longer than task.max_prompt_length")
    scorer = None
    pool = RewardPool.from_task(task, num_workers=t.reward_workers, timeout=t.reward_timeout)
    try:
        if cfg.scorer:
            try:
                scorer = load_scorer(cfg.scorer, task=task, path=cfg.scorer_path, pool=pool, device=device,
                                     step_tag=cfg.step_tag, batch_size=cfg.search.scorer_batch_size, dtype=cfg.model.dtype,
                                     trust_remote_code=cfg.model.trust_remote_code)
            except (OSError, ValueError) as e:
                raise ConfigError(f"scorer={cfg.scorer} scorer_path={cfg.scorer_path}: {e}") from None
        sweep_rows = []
        for name, budget in cells:
            strategy = make_strategy(name, tok, **_strategy_options(cfg, name))
            summary, rows = search_eval(strategy, engine, task, problems, budget=budget,
                                        scorer=scorer if STRATEGIES[name].scorer else None, seed=cfg.seed, pool=pool,
                                        batch_problems=cfg.search.batch_problems, correct_threshold=cfg.correct_threshold,
                                        progress=cfg.logging.progress, desc=f"{name} {task.name}")
            file = "search.jsonl" if len(cells) == 1 else f"search/{name}_{budget.max_generated_tokens or 'none'}.jsonl"
            write_samples(run_dir / file, rows)
            sweep_rows.append({"strategy": name, "scorer": cfg.scorer if STRATEGIES[name].scorer else "",
                               "budget": budget.max_generated_tokens, **summary, "file": file})
            print(f"{name} (budget {budget.max_generated_tokens or '-'}): accuracy {summary['accuracy']:.3f} "
                  f"[{summary['ci_low']:.3f}, {summary['ci_high']:.3f}], {summary['tokens_per_question']:.0f} tokens/question, "
                  f"{summary['engine_calls']:.0f} engine calls, {summary['wall_s']:.1f}s")
    finally:
        pool.close()
    head = {"model": cfg.model.path, "task": task.name, "scorer": cfg.scorer, "seed": cfg.seed,
            "num_problems": len(problems), "skipped_long": skipped}
    if len(cells) > 1:
        atomic_write_text(run_dir / "sweep.json", json.dumps({**head, "rows": sweep_rows}, indent=2) + "\n")
        atomic_write_text(run_dir / "sweep.md", sweep_markdown(sweep_rows))
        write_sweep_svg(run_dir / "accuracy_vs_tokens.svg", sweep_rows)
    first = sweep_rows[0]
    metrics = {k: v for k, v in first.items() if isinstance(v, float)} if len(cells) == 1 else {}
    result = {**head, "strategy": cfg.strategy if len(cells) == 1 else "sweep", "budget": asdict(cfg.budget),
              "search": asdict(cfg.search), "metrics": metrics, "notes": []}
    if len(cells) > 1:
        result["sweep"] = {"strategies": [n for n, _ in cells], "file": "sweep.json"}
    _save(run_dir, cfg.logging, result, None)
    return metrics


def _save(run_dir: Path, lg: LoggingConfig, result: dict[str, Any], rows: list[dict] | None) -> None:
    """eval.json, samples.jsonl, and the metrics as eval/<metric> at step 0 in metrics.jsonl (and TensorBoard / W&B)."""
    atomic_write_text(run_dir / "eval.json", json.dumps(result, indent=2) + "\n")
    if rows is not None:
        write_samples(run_dir / "samples.jsonl", rows)
    tracker = build.tracker_for(lg, run_dir, total_steps=0, desc="eval", progress=False)
    tracker.log(0, {f"eval/{k}": v for k, v in result["metrics"].items()}, advance=False)
    tracker.close()


__all__ = ["Config", "TaskConfig", "train"]
