"""``rollouts/step_N.jsonl``: what the model wrote at a step, and what the trainer made of it.

One row per completion (up to a limit): the prompt, the problem, the response, its reward,
score and components, its mean advantage, its finish reason, and per token the text, the
sampling log-prob, whether it trains and its advantage. ``relign report`` renders them.
"""

from __future__ import annotations

import json

from .batch import RolloutBatch


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return str(x)


def write_traces(path, tokenizer, groups, batch: RolloutBatch, advantages, limit: int) -> None:
    rows = []
    i = 0
    for g in groups:
        for e in g.episodes:
            if len(rows) >= limit:
                break
            cols = batch.response_mask[i].nonzero().flatten().tolist()
            start = len(e.prompt_ids)
            rows.append({
                "prompt": g.prompt_text, "problem": g.problem, "response": e.text, "reward": e.reward, "score": e.score,
                "components": e.components, "advantage": float(advantages[i, cols].mean()) if cols else 0.0,
                "finish_reason": e.finish_reason, "length": len(e.response_ids), "extra_info": _jsonable(g.extra_info),
                "tokens": tokenizer.batch_decode([[t] for t in e.response_ids]),  # one call, not one per token
                "token_mask": e.response_mask,
                "logps": [round(x, 4) for x in e.sampling_logps],
                "token_advantages": [round(float(advantages[i, start + j]), 4) for j in range(len(e.response_ids))],
            })
            i += 1
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
