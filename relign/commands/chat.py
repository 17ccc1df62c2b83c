"""``relign chat MODEL``: talk to a model in the terminal.

Each turn is rendered with the tokenizer's chat template (plain ``User:`` / ``Assistant:``
text when it has none) and sampled by relign's own HF engine, the one the recipes roll out
with. Lines come from stdin, so a pipe works as well as a keyboard::

    printf 'What is 2+3?\\n/reset\\nAnd 4*5?\\n' | relign chat runs/sft/checkpoints/step_60

``/reset`` forgets the conversation (the system prompt stays), ``/exit`` (or end of input) quits.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO

from ..rollout.engine import SamplingParams
from ..rollout.hf_engine import HFEngine
from ._common import MODEL_HELP, CommandError, Parser, add_model_args
from .inference import load_for_inference

HELP = "commands: /reset forgets the conversation, /exit quits (so does end of input, Ctrl-D)"
# The plain-text fallback ends each turn where the next user turn would begin.
PLAIN_STOP = "\nUser:"


def render(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[str]]:
    """(prompt text ending where the assistant speaks, stop strings) for a conversation."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), []
    names = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
    turns = [f"{names.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n".join([*turns, "Assistant:"]), [PLAIN_STOP]


def encode(tokenizer, text: str, *, templated: bool) -> list[int]:
    # A chat template writes its own special tokens (BOS, role markers); plain text gets the
    # tokenizer's usual ones, as any HF pipeline would add.
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]


class ChatSession:
    """A conversation with a model: the history, and one sampled reply per user turn."""

    def __init__(self, engine, tokenizer, params, *, system: str = "", max_context: int | None = None):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.system = system
        self.max_context = max_context  # prompt + reply tokens the model can attend to
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> tuple[list[int], list[str], int]:
        """(token ids, stop strings, turns dropped): the oldest turns go first when the
        conversation no longer fits the context (the system prompt and the last turn stay)."""
        dropped = 0
        head = 1 if self.system else 0
        while True:
            text, stops = render(self.tokenizer, self.messages)
            ids = encode(self.tokenizer, text, templated=not stops)
            budget = None if self.max_context is None else self.max_context - self.params.max_new_tokens
            if budget is None or len(ids) <= budget or len(self.messages) - head <= 1:
                return ids, stops, dropped
            del self.messages[head : head + 2]  # one user turn and its reply
            dropped += 1

    def reply(self, text: str) -> tuple[str, int]:
        """The model's answer to ``text`` (added to the history) and the number of old turns dropped."""
        from dataclasses import replace

        self.messages.append({"role": "user", "content": text})
        ids, stops, dropped = self.prompt_ids()
        params = replace(self.params, stop=[*self.params.stop, *stops])
        completion = self.engine.generate([ids], params)[0][0]
        answer = completion.text.strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer, dropped


def _lines(stream: TextIO, interactive: bool) -> Iterator[str]:
    if not interactive:
        yield from stream
        return
    while True:
        try:
            yield input("you> ")
        except EOFError:
            print()
            return


def repl(session: ChatSession, lines: Iterable[str], out: TextIO = sys.stdout) -> int:
    """Answer each line; returns the number of replies given."""
    replies = 0
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            print("(conversation reset)", file=out, flush=True)
            continue
        if line in ("/help", "/?"):
            print(HELP, file=out, flush=True)
            continue
        answer, dropped = session.reply(line)
        if dropped:
            print(f"(dropped the {dropped} oldest turn(s) to fit the model's context)", file=out)
        print(f"assistant: {answer}", file=out, flush=True)
        replies += 1
    return replies


def main(argv: list[str]) -> int:
    p = Parser("chat", description="Talk to a model with its chat template. " + HELP + ".")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply in tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling stream (default 0)")
    add_model_args(p)
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be at least 1, got {a.max_new_tokens}")
    if a.temperature < 0 or not 0 < a.top_p <= 1:
        raise CommandError("--temperature must be >= 0 and --top-p in (0, 1]")

    model, tok = load_for_inference(a.model, dtype=a.dtype, device=a.device, trust_remote_code=a.trust_remote_code)
    engine = HFEngine(model, tok, max_batch_rows=1, seed=a.seed)
    params = SamplingParams(n=1, temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens)
    session = ChatSession(engine, tok, params, system=a.system,
                          max_context=getattr(model.config, "max_position_embeddings", None))
    interactive = sys.stdin.isatty()
    if interactive:
        template = "its chat template" if getattr(tok, "chat_template", None) else "plain text (no chat template)"
        print(f"chatting with {a.model} ({template}); {HELP}")
    try:
        repl(session, _lines(sys.stdin, interactive))
    except KeyboardInterrupt:
        print()
    return 0
