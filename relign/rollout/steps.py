"""Split a response into reasoning steps in token ids (shared by search and VinePPO).

Steps are found in the engine's own token ids, never by decoding and re-tokenizing: a
re-tokenized response can differ from the sampled ids (BPE merges across the cut), and then
the trainer's log-probs would no longer line up with the tokens that were sampled.

A step ends after the token that completes an occurrence of the delimiter. A token that
straddles the delimiter (``".\\n\\n"`` with delimiter ``"\\n"``) closes the step it ends. As in
VinePPO's GSM8K splitter (treetune ``split_solution``):

* pieces that hold nothing but whitespace merge into the step that follows them (a response
  that opens with blank lines, or a blank line between two steps, makes no empty step);
* a trailing piece of whitespace (or a bare EOS) merges into the last real step.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_texts(token_ids: Sequence[int], tokenizer, cache: dict[int, str] | None = None) -> list[str]:
    """Each token decoded on its own (special tokens as ""). Byte-level BPE pieces of a
    multi-byte character decode to replacement characters, which never hold a delimiter."""
    cache = {} if cache is None else cache
    out = []
    for t in token_ids:
        s = cache.get(t)
        if s is None:
            s = cache[t] = tokenizer.decode([t], skip_special_tokens=True)
        out.append(s)
    return out


def step_ends(token_ids: Sequence[int], tokenizer, delimiter: str = "\n", *, cache: dict[int, str] | None = None) -> list[int]:
    """Exclusive end index of every step of a response, token-aligned; the last is ``len(token_ids)``.

    ``token_ids`` is the response only (no prompt). An empty response has no steps (``[]``).
    """
    if not delimiter:
        raise ValueError("step delimiter must be a non-empty string")
    n = len(token_ids)
    if n == 0:
        return []
    texts = token_texts(token_ids, tokenizer, cache)
    # char_end[i]: the length of the concatenated text through token i
    char_end, total = [], 0
    for s in texts:
        total += len(s)
        char_end.append(total)
    full = "".join(texts)
    ends: list[int] = []
    start_tok = 0
    pos = full.find(delimiter)
    while pos != -1:
        last_char = pos + len(delimiter) - 1
        # the token holding the delimiter's last character closes the step
        tok = _token_at(char_end, last_char, start_tok)
        piece = full[_char_start(char_end, start_tok) : char_end[tok]]
        if piece.strip():  # an all-whitespace piece joins the next step
            ends.append(tok + 1)
            start_tok = tok + 1
        pos = full.find(delimiter, max(pos + len(delimiter), char_end[tok]))
    if ends and ends[-1] == n:
        return ends
    tail = full[_char_start(char_end, start_tok) :] if start_tok < n else ""
    if ends and not tail.strip():
        ends[-1] = n  # trailing whitespace / EOS belongs to the last step
    else:
        ends.append(n)
    return ends


def _char_start(char_end: list[int], tok: int) -> int:
    return char_end[tok - 1] if tok > 0 else 0


def _token_at(char_end: list[int], char: int, lo: int) -> int:
    """The first token at or after ``lo`` whose text reaches past ``char``."""
    import bisect

    return max(lo, bisect.bisect_right(char_end, char))


def step_prefixes(prompt_ids: Sequence[int], response_ids: Sequence[int], ends: Sequence[int],
                  max_steps: int | None = None) -> list[list[int]]:
    """The states before each step, as exact ids: s_0 = the prompt, s_i = prompt + steps 1..i.

    With L steps there are L states s_0 .. s_{L-1} (the terminal state after the last step
    needs no estimate: its value is 0). ``max_steps`` = M keeps s_0 .. s_min(L-1, M), as
    VinePPO's ``max_step_for_value_estimation``; the later states are backfilled by the caller.
    """
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0 or None, got {max_steps}")
    starts = [0, *ends[:-1]]
    if max_steps is not None:
        starts = starts[: max_steps + 1]
    prompt = list(prompt_ids)
    return [prompt + list(response_ids[:s]) for s in starts]


def split_steps(token_ids: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    """The steps' token ids, cut at ``ends``."""
    starts = [0, *ends[:-1]]
    return [list(token_ids[s:e]) for s, e in zip(starts, ends)]
