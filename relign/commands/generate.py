"""``relign generate MODEL PROMPTS.jsonl``: batch generation, one JSONL row per completion.

Input rows hold ``prompt`` (a string, sent as it is, or a list of messages) or ``messages``
(a list of ``{role, content}``); message lists are rendered with the chat template (``--chat``
wraps string prompts too). Each output row is the input row's other fields plus::

    {"prompt": <as given>, "completion": "...", "num_tokens": 42, "finish_reason": "stop", "sample": 0}

``--n`` rows per prompt, in input order. Sampling is seeded per prompt (``--seed`` and the
row's position), so the output does not depend on ``--batch-size``, and the same seed gives
the same file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..data.readers import DataError, read_records
from ..errors import ConfigError
from ..models.loading import load_tokenizer, resolve_model_path
from ..rollout.engine import SamplingParams, derive_seed, eos_token_ids
from ..rollout.hf_engine import HFEngine
from ..rollout.vllm_engine import VLLMEngine, import_vllm
from ._common import MODEL_HELP, CommandError, Parser, add_model_args
from .chat import encode, render
from .inference import load_for_inference, resolve_model_arg

ROLES = ("system", "user", "assistant", "tool")


def _check_messages(value: Any, source: str, row: int, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(source, row, key, f"expected a non-empty list of messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(source, row, f"{key}[{i}]", f"expected an object with role and content, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise DataError(source, row, f"{key}[{i}].role", f"expected one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise DataError(source, row, f"{key}[{i}].content", f"expected a string, got {type(m.get('content')).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_row(record: Any, source: str, row: int) -> tuple[str | list[dict[str, str]], dict[str, Any]]:
    """(the prompt: text or messages, the row's other fields) of one input row."""
    if not isinstance(record, dict):
        raise DataError(source, row, None, f"expected an object with 'prompt' or 'messages', got {type(record).__name__}")
    rest = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
    if record.get("prompt") is not None:
        value = record["prompt"]
        if isinstance(value, list):  # TRL's conversational prompt
            return _check_messages(value, source, row, "prompt"), rest
        if not isinstance(value, str):
            raise DataError(source, row, "prompt", f"expected a string or a list of messages, got {type(value).__name__}")
        if not value.strip():
            raise DataError(source, row, "prompt", "empty")
        return value, rest
    if record.get("messages") is not None:
        return _check_messages(record["messages"], source, row, "messages"), rest
    raise DataError(source, row, "prompt", "missing (give 'prompt' as text or messages, or 'messages')")


def read_prompts(path: str) -> list[tuple[str | list[dict[str, str]], dict[str, Any]]]:

    p = Path(path)
    if p.is_dir():
        raise DataError(path, None, None, "is a folder; give a .jsonl/.json/.csv/.parquet file of prompts")
    if not p.is_file():
        raise DataError(path, None, None, "file not found")
    try:
        rows = [parse_row(rec, path, row) for row, rec in read_records(path)]
    except UnicodeDecodeError as e:
        raise DataError(path, None, None, f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not rows:
        raise DataError(path, None, None, "no prompts (the file is empty)")
    return rows


def prompt_ids(tokenizer, prompt: str | list[dict[str, str]], *, chat: bool, system: str) -> list[int]:

    if isinstance(prompt, str) and not chat:
        return encode(tokenizer, prompt, templated=False)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    text, stops = render(tokenizer, messages)
    return encode(tokenizer, text, templated=not stops)


def _generate(engine, prompts: list[list[int]], params, *, seed: int, batch_size: int, progress) -> list:
    """Completions for every prompt, ``batch_size`` prompts per engine call. One stream per
    prompt, fixed by (seed, position): batching cannot change a sample, on either engine."""

    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        out.extend(engine.generate(chunk, params, seeds=[derive_seed(seed, start + i) for i in range(len(chunk))]))
        progress(len(chunk))
    return out


def _vllm_engine(path: str, tokenizer, prompts: list[list[int]], params, *, seed: int, dtype: str, trust_remote_code: bool,
                 batch_size: int):
    """relign's vLLM engine reading the weights itself (no trainer to push them)."""
    from types import SimpleNamespace

    import torch
    from transformers import GenerationConfig

    try:
        gen_config = GenerationConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        gen_config = None
    try:
        return VLLMEngine(path, tokenizer, eos_token_ids=eos_token_ids(tokenizer, SimpleNamespace(generation_config=gen_config)),
                          dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                          max_model_len=max(len(p) for p in prompts) + params.max_new_tokens,
                          max_num_seqs=batch_size * max(1, params.n), seed=seed, trust_remote_code=trust_remote_code,
                          load_format="auto", key="--engine")
    except ConfigError as e:
        raise CommandError(str(e).replace("--engine=", "--engine ")) from None


def main(argv: list[str]) -> int:
    p = Parser("generate", description="Batch generation: one JSONL row per completion (see docs/commands.md).")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("prompts", metavar="PROMPTS", help="JSONL (or .json/.csv/.parquet) rows with 'prompt' or 'messages'")
    p.add_argument("--out", default="", help="output JSONL; '-' for stdout (default: PROMPTS' folder, NAME.generated.jsonl)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest completion in tokens (default 256)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeat for several)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each prompt gets its own stream (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per engine call (default 16)")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="hf (built in) or vllm (pip install \"relign[vllm]\", see docs/rl.md)")
    p.add_argument("--chat", action="store_true", help="wrap string prompts in the chat template as a user turn")
    p.add_argument("--system", default="", help="system prompt for chat-templated prompts")
    add_model_args(p, device_help="auto, cpu, cuda, cuda:1 ... (hf engine; vLLM picks its own)")
    a = p.parse_args(argv)
    for flag, value in (("--n", a.n), ("--batch-size", a.batch_size), ("--max-new-tokens", a.max_new_tokens)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        raise CommandError("--temperature must be >= 0, --top-p in (0, 1] and --top-k >= 0")
    if a.engine == "vllm":

        try:
            import_vllm("--engine")
        except ConfigError as e:
            raise CommandError(str(e).replace("--engine=", "--engine ")) from None

    rows = read_prompts(a.prompts)  # bad input fails before the model loads
    out_path = a.out or str(Path(a.prompts).with_name(Path(a.prompts).stem + ".generated.jsonl"))

    if a.engine == "vllm":  # vLLM loads the weights itself; only the tokenizer is needed here

        path = resolve_model_path(resolve_model_arg(a.model))  # tiny:SIZE is built (once) here
        model, tok = None, load_tokenizer(path, trust_remote_code=a.trust_remote_code, key="MODEL")
    else:
        model, tok = load_for_inference(a.model, dtype=a.dtype, device=a.device, trust_remote_code=a.trust_remote_code)
    prompts = [prompt_ids(tok, prompt, chat=a.chat, system=a.system) for prompt, _ in rows]
    params = SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_new_tokens=a.max_new_tokens, stop=list(a.stop))
    if model is None:
        engine = _vllm_engine(path, tok, prompts, params, seed=a.seed, dtype=a.dtype, trust_remote_code=a.trust_remote_code,
                              batch_size=a.batch_size)
    else:

        engine = HFEngine(model, tok, max_batch_rows=a.batch_size * max(1, params.n), seed=a.seed)
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr, disable=None) as bar:
        results = _generate(engine, prompts, params, seed=a.seed, batch_size=a.batch_size, progress=bar.update)

    lines = []
    for (prompt, rest), completions in zip(rows, results):
        for j, c in enumerate(completions):
            row = {**rest, "prompt": prompt, "completion": c.text, "num_tokens": len(c.token_ids),
                   "finish_reason": c.finish_reason, "sample": j}
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    if out_path == "-":
        sys.stdout.writelines(lines)
        sys.stdout.flush()
    else:  # written whole, then renamed: an interrupted run never leaves half a file
        tmp = f"{out_path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, out_path)
    print(f"wrote {len(lines)} completions ({len(rows)} prompts x {a.n}) to {'stdout' if out_path == '-' else out_path}",
          file=sys.stderr)
    return 0
