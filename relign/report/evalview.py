"""The eval section: eval.json's summary and a per-problem grid of samples, votes and answers.

Reads ``samples.jsonl`` of ``relign eval`` (or the newest ``eval/step_N.jsonl`` of an RL run
with in-training eval samples); one row per sample, or one per problem with a list.
"""

from __future__ import annotations

import html
from typing import Any

from .reliability import reliability_svg
from .load import Run
from .traces import GOLD_KEYS
from .util import _as_bool, _cut, _finite, _first, _flatten, _is_int, _kv_table, _num_or, _text, fmt

MAX_EVAL_PROBLEMS = 500  # problems shown in the eval grid ...
MAX_EVAL_BYTES = 8_000_000  # ... until their samples' text reaches this

# Field names of eval samples.jsonl rows, first match wins. The eval writer is young: adapt
# here, not in the code below. "answer" is read as the gold answer (as in extra_info).
SAMPLE_FIELDS: dict[str, tuple[str, ...]] = {
    "problem": ("problem_index", "problem_idx", "problem_id", "problem", "index", "idx", "id"),
    "prompt": ("prompt", "question", "problem"),
    "response": ("response", "completion", "text", "output"),
    "extracted": ("extracted", "extracted_answer", "pred", "prediction", "parsed"),
    "gold": ("gold", "gold_answer", "target", "reference", "ground_truth", "answer"),
    "correct": ("correct", "is_correct", "score"),
    "reward": ("reward",),
    "finish_reason": ("finish_reason",),
    "length": ("length", "num_tokens", "response_length"),
    "majority": ("majority", "majority_answer", "maj_answer", "maj"),
    "majority_correct": ("majority_correct", "maj_correct"),
    "votes": ("votes", "vote_counts"),
    "samples": ("samples", "responses", "completions"),
}


def pick(row: dict[str, Any], field_name: str) -> Any:
    """The value of the first alias of ``field_name`` (SAMPLE_FIELDS) that the row has."""
    for name in SAMPLE_FIELDS[field_name]:
        if name in row and row[name] is not None:
            return row[name]
    return None


def group_samples(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """samples.jsonl rows (one per sample, or one per problem with a list) -> one dict per problem."""
    problems: dict[Any, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        nested = pick(row, "samples")
        # the problem's number if the row has one ("problem" may also be its text), else its prompt
        idx = next((row[n] for n in SAMPLE_FIELDS["problem"] if _is_int(row.get(n))), None)
        if idx is None:
            idx = i if isinstance(nested, list) else _text(pick(row, "prompt")) or i
        p = problems.setdefault(idx, {
            "index": idx if _is_int(idx) else len(problems), "prompt": None, "gold": None,
            "majority": None, "majority_correct": None, "votes": None, "samples": [],
        })
        for key in ("prompt", "gold", "majority", "majority_correct", "votes"):
            if p[key] is None:
                p[key] = pick(row, key)
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        if p["gold"] is None:
            p["gold"] = _first(extra, GOLD_KEYS)
        for s in nested if isinstance(nested, list) else [row]:
            s = s if isinstance(s, dict) else {"response": s}
            p["samples"].append({
                "response": _cut(str(pick(s, "response") or "")),
                "extracted": pick(s, "extracted"),
                "correct": _as_bool(pick(s, "correct")),
                "reward": _finite(pick(s, "reward")),
                "finish_reason": pick(s, "finish_reason"),
                "length": pick(s, "length"),
            })
    for p in problems.values():
        if p["majority_correct"] is None and p["majority"] is not None:
            # not recorded: the majority answer is correct if a sample that gave it was graded correct
            same = [s["correct"] for s in p["samples"] if _text(s["extracted"]) == _text(p["majority"])]
            graded = [c for c in same if c is not None]
            p["majority_correct"] = any(graded) if graded else None
    return list(problems.values())


def render_eval(run: Run) -> str:
    if run.eval_summary is None and not run.samples:
        return ""
    in_training = run.samples_file.startswith("eval/")
    title = f"Held-out eval samples ({run.samples_file[5:-6].replace('_', ' ')}, the latest)" if in_training else "Evaluation"
    out = [f'<section id="eval"><h2>{html.escape(title)}</h2>']
    if run.eval_summary is not None:
        out.append(_kv_table(_flatten(run.eval_summary), "eval-summary"))
    if in_training:  # an eval run opens with its diagram (render_reliability); a training run's comes here
        out.append(render_reliability(run, heading="h3"))
    if run.samples:
        problems = group_samples(run.samples)
        shown, size = [], 0
        for p in problems[:MAX_EVAL_PROBLEMS]:  # and stop at MAX_EVAL_BYTES: n samples of long answers add up
            shown.append(_problem_html(p))
            size += len(shown[-1])
            if size > MAX_EVAL_BYTES:
                break
        if len(problems) > len(shown):
            out.append(f'<p class="note">Showing the first {len(shown)} of {len(problems)} problems '
                       f"(all are in <code>{html.escape(run.samples_file)}</code>).</p>")
        out.append('<p class="note">One square per sample: <span class="cell correct"></span> correct, '
                   '<span class="cell incorrect"></span> incorrect, <span class="cell unknown"></span> not graded; '
                   'an outlined square was cut at the length limit. Click a problem to read its samples.</p>')
        out.append('<div id="eval-grid">' + "".join(shown) + "</div>")
    out.append("</section>")
    return "".join(out)


def render_reliability(run: Run, heading: str = "h2") -> str:
    """The reliability diagram of the reader's top answers (``relign eval scorer=reader``: rows
    with ``reader``), or "" when no sample was read. A row written before abstentions were
    recorded has no ``no_answer``: it is drawn as answered."""
    graded = [r["reader"] for r in run.samples if isinstance(r.get("reader"), dict)]
    graded = [g for g in graded if _finite(g.get("confidence")) is not None and _finite(g.get("correct")) is not None]
    if not graded:
        return ""
    conf = [min(max(float(g["confidence"]), 0.0), 1.0) for g in graded]
    svg = reliability_svg(conf, [float(g["correct"]) for g in graded], [bool(g.get("no_answer")) for g in graded])
    return (f'<section id="reliability"><{heading}>Reliability diagram</{heading}><p class="note">The reader\'s top '
            "answer of each sample, binned by its stated confidence: the bar is how often the answers of the bin were "
            "right, the dot their mean stated confidence; a calibrated reader's bars end on the diagonal. Below, the "
            "samples per bin and, apart, those the reader found no answer in (counted in the ECE as confidence 1 and "
            f'wrong).</p><figure class="reliability">{svg}</figure></section>')


def _problem_html(p: dict[str, Any]) -> str:
    cells = "".join(
        f'<span class="cell {_cell_class(s["correct"])}{" cut" if s["finish_reason"] == "length" else ""}" '
        f'title="{html.escape(_text(s["extracted"]) or "no answer")}"></span>' for s in p["samples"]
    )
    n_ok = sum(1 for s in p["samples"] if s["correct"])
    votes = p["votes"]
    if isinstance(votes, dict):
        votes_text = ", ".join(f"{_text(k)}: {_text(v)}" for k, v in sorted(votes.items(), key=lambda kv: -_num_or(kv[1])))
    else:
        votes_text = _text(votes)
    maj_mark = {True: " ✓", False: " ✗"}.get(_as_bool(p["majority_correct"]), "")
    details = "".join(
        f'<div class="sample"><div class="meta">sample {j} · {_cell_text(s["correct"])} · answer '
        f'<code>{html.escape(_text(s["extracted"]) or "—")}</code>'
        + (f' · reward {fmt(s["reward"])}' if s["reward"] is not None else "")
        + (f' · {html.escape(_text(s["finish_reason"]))}' if s["finish_reason"] else "")
        + (f' · {html.escape(_text(s["length"]))} tokens' if s["length"] is not None else "")
        + f'</div><pre>{html.escape(s["response"])}</pre></div>'
        for j, s in enumerate(p["samples"])
    )
    return (
        f'<details class="problem" data-correct="{n_ok}" data-samples="{len(p["samples"])}"><summary>'
        f'<span class="pidx">#{html.escape(_text(p["index"]))}</span><span class="cells">{cells}</span>'
        f'<span class="pmeta">{n_ok}/{len(p["samples"])} correct · gold <code>{html.escape(_text(p["gold"]) or "—")}</code>'
        + (f' · majority <code>{html.escape(_text(p["majority"]))}</code>{maj_mark}' if p["majority"] is not None else "")
        + (f" · votes {html.escape(votes_text)}" if votes_text else "")
        + f'</span></summary><pre class="prompt">{html.escape(_cut(_text(p["prompt"])))}</pre>{details}</details>'
    )


def _cell_class(correct: bool | None) -> str:
    return "unknown" if correct is None else "correct" if correct else "incorrect"


def _cell_text(correct: bool | None) -> str:
    return "not graded" if correct is None else "correct" if correct else "incorrect"
