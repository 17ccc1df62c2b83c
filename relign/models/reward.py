"""Learned rewards: a scalar reward model, a generative verifier, and the scorer both serve through.

* **Reward model** — a sequence-classification model with one output (a linear ``score`` head
  on a causal-LM backbone, as ``AutoModelForSequenceClassification`` builds it from any causal
  LM folder), read at the last non-pad token of ``[prompt | response]``. Saved in the plain HF
  format, so TRL/vLLM/transformers load it as it is.
* **Generative verifier (GenRM)** — a causal LM fine-tuned to answer "Is the answer correct?
  Yes/No" after a problem and a solution (Zhang et al., arXiv 2408.15240). Its score is
  P("Yes") at the answer position, a probability in [0, 1].

Both implement ``Scorer.score(problems, responses) -> list[float]``, batched: the RL recipe
adds it to the rule reward, and best-of-N search ranks samples with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from ..data.preference import encode_prompt_response
from . import lean
from .loading import _check_source, disable_dropout, load_causal_lm, load_tokenizer, resolve_dtype, resolve_model_path, to_device
from .logprobs import right_pad
from . import precision

VERIFIER_TEMPLATE = "Problem:\n{problem}\n\nSolution:\n{solution}\n\nIs the answer correct? Answer Yes or No."
"""The verifier's question. Training data (``recipes.verifier``) and scoring both use it."""
YES, NO = "Yes", "No"


class Scorer(Protocol):
    """A learned reward for RL (``reward.model``, ``reward.kind``); relign's own subclass it for the
    defaults of its optional members."""

    def score(self, problems: list[str], responses: list[str]) -> list[float]:
        """One score per (problem, response), in order."""
        ...

    def score_detailed(self, problems: list[str], responses: list[str], *, extra_infos: list[dict] | None = None,
                       finished: list[bool] | None = None) -> list[dict[str, float]]:
        """Per response: its score under ``reward`` and the named parts the RL collector logs beside it
        (``reward/<part>``). The default: the score alone."""
        return [{"reward": float(s)} for s in self.score(problems, responses)]

    def step_metrics(self, components: list[dict[str, float]]) -> dict[str, float]:
        """The scorer's own metrics of an RL step, from its responses' reward components (the reader's
        calibration, ``ReaderScorer``). The default: none."""
        return {}


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def _head(model: torch.nn.Module) -> torch.nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.score


def load_reward_model(path: str, *, dtype: str = "fp32", attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                      gradient_checkpointing: bool = False, lean_activations: bool = True, pad_token_id: int | None = None,
                      device="cpu"):
    """A one-output sequence-classification model; from a causal LM folder the ``score`` head is new.

    The head of a new model starts at zero (transformers would draw it at random): every
    reward starts at 0, so the first loss is log 2 and the first gradients come from the data,
    not from a random ranking. Dropout is off (``loading.disable_dropout``); train mode stays."""
    import logging

    from transformers import AutoModelForSequenceClassification

    path = resolve_model_path(path)
    _check_source(path, "model.path")
    cfg_file = Path(path) / "config.json"
    fresh = True
    if cfg_file.is_file():
        archs = json.loads(cfg_file.read_text()).get("architectures") or []
        fresh = not any(a.endswith("ForSequenceClassification") for a in archs)
    # "Some weights were newly initialized" is expected for a fresh head: don't print it
    logging.getLogger("transformers.modeling_utils").setLevel(logging.ERROR)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    # rewards must be a deterministic function of the weights (training in train mode, scoring
    # in eval mode); the recipe wraps LoRA after this, so lora.dropout is left as asked
    disable_dropout(model)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    if fresh:
        torch.nn.init.zeros_(model.score.weight)
        if getattr(model.score, "bias", None) is not None:
            torch.nn.init.zeros_(model.score.bias)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    to_device(model, device)
    precision.enable(model, dtype)
    if lean_activations:
        lean.lean_activations(model)
    return model.train()


def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """r(x, y) [B] (fp32): the score head at each row's last non-pad token.

    Rows are right-padded. The last token is found from the attention mask, not from the pad
    id, so a tokenizer whose pad id equals its EOS id still reads the EOS position (the model's
    own pooling looks for the pad id). The model's own forward runs all the same, for its final
    hidden states: under FSDP2 that forward, not the backbone's, gathers the root's parameters
    (embeddings, final norm, head); calling the backbone directly failed under torchrun."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    h = out.hidden_states[-1]  # [B, T, H], after the final norm
    last = attention_mask.sum(-1) - 1  # [B]
    pooled = h[torch.arange(h.shape[0], device=h.device), last]  # [B, H]
    return _head(model)(pooled).squeeze(-1).float()


class RewardModelScorer(Scorer):
    """Scores with a Bradley-Terry reward model, rendering (problem, response) as in training."""

    def __init__(self, path: str, *, device="cpu", batch_size: int = 16, max_length: int = 2048, chat_template: bool = True,
                 dtype: str = "fp32", trust_remote_code: bool = False):
        self.tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
        self.model = load_reward_model(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                       pad_token_id=self.tok.pad_token_id, device=device).eval().requires_grad_(False)
        self.device, self.batch_size, self.max_length, self.chat_template = device, batch_size, max_length, chat_template

    @torch.no_grad()
    def score(self, problems: list[str], responses: list[str]) -> list[float]:
        rows = [encode_prompt_response(self.tok, p, r, chat_template=self.chat_template)[0][-self.max_length:]
                for p, r in zip(problems, responses)]
        out: list[float] = []
        for i in range(0, len(rows), self.batch_size):
            ids, mask = right_pad(rows[i : i + self.batch_size], self.tok.pad_token_id, self.device)
            out.extend(sequence_rewards(self.model, ids, mask).tolist())
        return out


def verifier_messages(problem: str, solution: str, template: str = VERIFIER_TEMPLATE) -> list[dict[str, str]]:
    return [{"role": "user", "content": template.replace("{problem}", problem).replace("{solution}", solution)}]


class VerifierScorer(Scorer):
    """Scores with a generative verifier: P("Yes") for the first answer token."""

    def __init__(self, path: str, *, device="cpu", batch_size: int = 16, max_length: int = 2048,
                 template: str = VERIFIER_TEMPLATE, dtype: str = "fp32", trust_remote_code: bool = False):
        self.tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
        self.model = load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code, device=device).eval().requires_grad_(False)
        self.device, self.batch_size, self.max_length, self.template = device, batch_size, max_length, template
        # the first token of the answer as the verifier's SFT data tokenized it (on its own)
        self.yes_id = self.tok(YES, add_special_tokens=False)["input_ids"][0]

    def _prompt_ids(self, problem: str, solution: str) -> list[int]:
        text = self.tok.apply_chat_template(verifier_messages(problem, solution, self.template), tokenize=False,
                                            add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"][-self.max_length:]

    @torch.no_grad()
    def score(self, problems: list[str], responses: list[str]) -> list[float]:
        rows = [self._prompt_ids(p, r) for p, r in zip(problems, responses)]
        out: list[float] = []
        for i in range(0, len(rows), self.batch_size):
            # left-padded, so every row's answer position is the last column and the LM head
            # runs there only (logits_to_keep=1)
            ids, mask = right_pad([r[::-1] for r in rows[i : i + self.batch_size]], self.tok.pad_token_id, self.device)
            ids, mask = ids.flip(-1), mask.flip(-1)
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1).logits
            probs = torch.softmax(logits[:, -1].float(), dim=-1)  # [B, V]
            out.extend(probs[:, self.yes_id].tolist())
        return out


def scorer_kind(path: str) -> str:
    """'rm' for a sequence-classification checkpoint, 'verifier' for a causal LM."""
    cfg_file = Path(resolve_model_path(path)) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(cfg_file)
    archs = json.loads(cfg_file.read_text()).get("architectures") or []
    return "rm" if any(a.endswith("ForSequenceClassification") for a in archs) else "verifier"


def load_scorer(path: str, kind: str = "auto", **kwargs) -> Scorer:
    """A reward model or a generative verifier from a checkpoint folder (``kind``: auto, rm, verifier)."""
    kind = scorer_kind(path) if kind == "auto" else kind
    if kind == "rm":
        kwargs.pop("template", None)
        return RewardModelScorer(path, **kwargs)
    if kind == "verifier":
        kwargs.pop("chat_template", None)
        return VerifierScorer(path, **kwargs)
    raise ValueError(f"unknown scorer kind {kind!r} (auto, rm or verifier)")
