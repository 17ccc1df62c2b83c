"""The trace browser, pure: rollouts/step_N.jsonl rows -> the page's JSON, cut to size caps.

Model output is untrusted: the JSON goes into a ``<script type="application/json">`` block
through ``_script_json`` (no ``<``, ``>``, ``&``), and the page's script only sets textContent.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from .load import Run
from .util import (
    MAX_TEXT_CHARS, _as_bool, _clean, _cut, _finite, _first, _json, _script_json, _text, count_lines, read_jsonl
)

# Caps that keep report.html a few MB however long the run: the page says when it cut.
MAX_TRACE_STEPS = 50  # the most recent steps of rollouts/ embedded ...
MAX_TRACE_BYTES = 10_000_000  # ... newest first, until their JSON reaches this
MAX_TOKEN_BYTES = 6_000_000  # token detail (~20 bytes a token) for the newest steps within this
MAX_TRACE_ROWS = 64  # rows per step (the first ones: whole groups, in order)
MAX_TOKENS_PER_ROW = 1024  # token-level detail per response

EXTRACTED_KEYS = ("extracted", "extracted_answer", "pred", "prediction")  # in an RL trace row or its extra_info
GOLD_KEYS = ("answer", "gold", "target", "ground_truth")  # in a trace row's extra_info


def correctness(row: dict[str, Any]) -> bool | None:
    """Correct if the row says so, else if its score is positive; None when it cannot tell."""
    for key in ("correct", "is_correct"):
        said = _as_bool(row.get(key))
        if said is not None:
            return said
    return _as_bool(row.get("score"))


def trace_row(raw: dict[str, Any], prompt_id: int, *, token_detail: bool = True) -> dict[str, Any]:
    """One response of a rollouts/step_N.jsonl row, cut to the caps, in the page's shape.

    With token detail the response is its tokens (the page joins them for search) and the text
    is stored only when the tokens were cut; without, the text alone.
    """
    extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
    tokens = raw.get("tokens") if isinstance(raw.get("tokens"), list) and token_detail else []
    n = min(len(tokens), MAX_TOKENS_PER_ROW)
    row = {
        "prompt_id": prompt_id,
        "response": _cut(str(raw.get("response", ""))) if n == 0 or n < len(tokens) else "",
        "reward": _finite(raw.get("reward")),
        "score": _finite(raw.get("score")),
        "correct": correctness(raw),
        "advantage": _finite(raw.get("advantage")),
        "finish_reason": str(raw.get("finish_reason", "")),
        "length": raw.get("length"),
        "gold": _first(extra, GOLD_KEYS),
        "extracted": _first(raw, EXTRACTED_KEYS) or _first(extra, EXTRACTED_KEYS),
        "components": _clean(raw.get("components") or {}),
        "tokens": [str(t) for t in tokens[:n]],
        "tokens_cut": len(tokens) - n,
    }
    for key in ("token_mask", "logps", "token_advantages"):
        values = raw.get(key)
        if n and isinstance(values, list) and len(values) >= n:
            row[key] = _clean(values[:n])
    if all(m == 1 for m in row.get("token_mask", [])):
        row.pop("token_mask", None)  # single-turn: every token is the model's; the page assumes so
    return row


def trace_step(step: int, raws: list[dict[str, Any]], total_rows: int, *, token_detail: bool = True) -> dict[str, Any]:
    """A step's rows with prompts stored once (a group of G responses shares one prompt).

    ``problems`` holds each prompt's problem without chat markup, when the trace has it: the
    page shows it in the prompt's one-line summary, where a chat template's preamble would be.
    """
    prompts: list[str] = []
    problems: list[str] = []
    index: dict[str, int] = {}
    rows = []
    for raw in raws:
        p = str(raw.get("prompt", ""))
        if p not in index:
            index[p] = len(prompts)
            prompts.append(_cut(p))
            problems.append(_cut(_text(raw.get("problem")), 300))
        rows.append(trace_row(raw, index[p], token_detail=token_detail))
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    correct = [r["correct"] for r in rows if r["correct"] is not None]
    return {
        "step": step, "prompts": prompts, "problems": problems, "rows": rows, "total_rows": total_rows,
        "token_detail": token_detail and any(r["tokens"] for r in rows),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "accuracy": sum(correct) / len(correct) if correct else None,
    }


def build_traces(files: list[tuple[int, Path]]) -> dict[str, Any]:
    """The trace browser's data, newest steps first into a size budget.

    The newest steps carry token detail while it fits MAX_TOKEN_BYTES; older ones carry text
    only; steps stop when MAX_TRACE_BYTES is reached (or after MAX_TRACE_STEPS).
    """
    steps: list[dict[str, Any]] = []
    used, token_detail = 0, True
    for step, path in reversed(files[-MAX_TRACE_STEPS:]):
        raws = read_jsonl(path, limit=MAX_TRACE_ROWS)
        total_rows = count_lines(path)
        data = trace_step(step, raws, total_rows, token_detail=token_detail)
        size = len(_json(data))
        if token_detail and used + size > MAX_TOKEN_BYTES:
            token_detail = False  # and for every older step: one boundary is easy to state on the page
            data = trace_step(step, raws, total_rows, token_detail=False)
            size = len(_json(data))
        if steps and used + size > MAX_TRACE_BYTES:
            break
        steps.append(data)
        used += size
    steps.reverse()
    return {"steps": steps, "total_steps": len(files), "token_steps": sum(s["token_detail"] for s in steps)}


def render_traces(run: Run) -> str:
    if not run.trace_files:
        return ""
    data = build_traces(run.trace_files)
    shown, total = len(data["steps"]), data["total_steps"]
    notes = [f"the last {shown} of {total} steps" if shown < total else f"all {total} steps"]
    if any(s["total_rows"] > len(s["rows"]) for s in data["steps"]):
        notes.append(f"the first {MAX_TRACE_ROWS} responses of each")
    if data["token_steps"] < shown:
        notes.append(f"token detail for the newest {data['token_steps']} (size budget), text only for the others")
    notes.append(f"tokens up to {MAX_TOKENS_PER_ROW} and text up to {MAX_TEXT_CHARS} characters a response")
    return f"""
<section id="traces"><h2>Rollout traces</h2>
<p class="note">Embedded: {html.escape("; ".join(notes))}. All of them are in <code>rollouts/step_N.jsonl</code>.</p>
<div class="trace-browser">
  <nav id="step-list" aria-label="steps"></nav>
  <div class="trace-main">
    <div class="trace-controls">
      <label>Show <select id="trace-filter">
        <option value="all">all</option><option value="correct">correct</option>
        <option value="incorrect">incorrect</option><option value="truncated">truncated</option></select></label>
      <label>Search <input id="trace-search" type="search" placeholder="text in prompt or response"></label>
      <label>Shade tokens by <select id="trace-shade">
        <option value="advantage">advantage</option><option value="logp">log-prob</option>
        <option value="none">nothing</option></select></label>
      <span id="trace-count"></span>
    </div>
    <p class="note" id="shade-note"></p>
    <div id="trace-view"></div>
  </div>
</div>
<script type="application/json" id="trace-data">{_script_json(data)}</script>
</section>"""
