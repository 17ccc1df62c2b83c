"""``relign lc-data MODEL LC_ROWS``: the summary-distillation SFT rows of linguistic calibration.

Band et al. (arXiv 2404.00474), stage 1: sample K paragraphs per query from the base model, summarize
them into one paragraph that states its uncertainty, and fine-tune on the summaries. For each row
of LC_ROWS (the ``lc`` task's records: ``paragraph_generation_prompt`` or ``prompt``, ``question``,
``answer``; docs/calibration.md) this samples ``--k`` completions of the prompt (seeded by the row's
position, as ``relign generate``), calls the summarizer named by ``--summarizer``
(``fn(query, paragraphs) -> str``; default ``relign.envs.calibration:frequency_summary``, for short
answers: "I think it is A with 60% likelihood, B with 40%."; the paper used Claude: pass your own
``file.py:function``) and writes ``{"prompt": query, "completion": summary}`` rows for ``relign sft``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..data.readers import DataError, read_records
from ..envs.base import load_function
from ..envs.calibration import parse_lc_row
from ..rollout.engine import SamplingParams
from ..rollout.hf_engine import HFEngine
from ._common import MODEL_HELP, CommandError, Parser, add_model_args
from .generate import _generate, prompt_ids
from .inference import load_for_inference


def main(argv: list[str]) -> int:
    p = Parser("lc-data", description="Summary-distillation SFT rows of linguistic calibration (docs/calibration.md).")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("rows", metavar="LC_ROWS", help="the lc task's records (JSONL, JSON, CSV, parquet)")
    p.add_argument("--out", default="", help="output JSONL (default: LC_ROWS' folder, NAME.lc_sft.jsonl)")
    p.add_argument("--k", type=int, default=8, help="paragraphs sampled per query (default 8)")
    p.add_argument("--summarizer", default="relign.envs.calibration:frequency_summary",
                   help="fn(query, paragraphs) -> str by spec 'module:function' or 'file.py:function'")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=300, help="longest paragraph in tokens (default 300)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each query gets its own stream (default 0)")
    p.add_argument("--batch-size", type=int, default=8, help="queries per engine call (default 8)")
    p.add_argument("--no-chat", action="store_true", help="send the query as raw text (default: a user turn of the chat template)")
    add_model_args(p, device_help="auto, cpu, cuda, cuda:1 ...")
    a = p.parse_args(argv)
    if a.k < 1 or a.batch_size < 1 or a.max_new_tokens < 1 or a.temperature <= 0:
        raise CommandError("--k, --batch-size and --max-new-tokens must be at least 1, --temperature > 0")
    try:
        summarize = load_function(a.summarizer)
    except (ValueError, TypeError, FileNotFoundError, ImportError, AttributeError) as e:
        raise CommandError(f"--summarizer {a.summarizer}: {e}") from None
    if not Path(a.rows).is_file():
        raise DataError(a.rows, None, None, "file not found")
    queries = [parse_lc_row(raw if isinstance(raw, dict) else {}, a.rows, row)[0]["prompt"]
               for row, raw in read_records(a.rows)]  # bad rows fail before the model loads
    model, tok = load_for_inference(a.model, dtype=a.dtype, device=a.device, trust_remote_code=a.trust_remote_code)
    ids = [prompt_ids(tok, q, chat=not a.no_chat, system="") for q in queries]
    params = SamplingParams(n=a.k, temperature=a.temperature, max_new_tokens=a.max_new_tokens)
    engine = HFEngine(model, tok, max_batch_rows=a.batch_size * a.k, seed=a.seed)
    results = _generate(engine, ids, params, seed=a.seed, batch_size=a.batch_size, progress=lambda n: None)
    lines = []
    for q, completions in zip(queries, results):
        summary = summarize(q, [c.text for c in completions])
        if not isinstance(summary, str):
            raise CommandError(f"--summarizer {a.summarizer} returned {type(summary).__name__}, not a string")
        lines.append(json.dumps({"prompt": q, "completion": summary}, ensure_ascii=False) + "\n")
    out = a.out or str(Path(a.rows).with_name(Path(a.rows).stem + ".lc_sft.jsonl"))
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, out)
    print(f"wrote {len(lines)} summary rows ({len(queries)} queries x {a.k} samples) to {out}", file=sys.stderr)
    return 0
