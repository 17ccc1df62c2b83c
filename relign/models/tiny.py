"""Tiny random Qwen2- or Llama-shaped models with a locally trained tokenizer.

Tests, the demo and the benchmarks use these: nothing is downloaded. The tokenizer is a
byte-level BPE trained with ``tokenizers`` on a synthetic corpus (English function words,
numbers, arithmetic, LaTeX bits, answer tags) so any text still encodes byte by byte and the
common pieces of reasoning text are single tokens. It ships a ChatML chat template.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

# Sizes: hidden, layers, heads, kv heads, MLP width. "small" is ~10M parameters with the
# default 4096-token vocabulary (the size the throughput benchmarks use). "shallow" is tiny's
# width with 2 layers: the demo's model (docs/demo.md), too shallow to add up five numbers in
# one shot but deep enough for one step at a time, and about 1.7x faster a step than tiny.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "micro": (64, 2, 4, 2, 192),
    "tiny": (128, 4, 4, 2, 384),
    "shallow": (128, 2, 4, 2, 384),
    "small": (256, 10, 8, 4, 1024),
    "base": (512, 8, 8, 4, 1536),
}

_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this are from or have not "
    "but what all were when we there can your which their if do will each how up out them then "
    "she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much before go good "
    "new write our used me man too any day same right look think also around another came come "
    "work three word must because does part even place well such here take why help put "
    "different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always show large often "
    "together asked house don't world going want school important until form food keep children "
    "feet land side without boy once animal life enough took four head above kind began almost "
    "live page got earth need far hand high year mother light country father let night picture "
    "being study second soon story since white ever paper hard near sentence better best across "
    "during today however sure knew it's try told young sun thing whole hear example heard "
    "several change answer room sea against top turned learn point city play toward five himself "
    "usually money seen didn't car morning I'm body upon family later turn move face door cut "
    "done group true half red fish plants living wind question problem solution step total each "
    "per cost costs dollars cents apples books students hours minutes miles buys sells gives "
    "has had more less than twice half times sum difference product quotient equal equals "
    "therefore so final answer is correct incorrect yes no let's think step by step first "
    "second third then finally compute calculate number numbers target use using only once "
    "assistant user system reason reasoning verify check result value values remaining left "
    "Janet James Maria John Sarah Tom Lisa Mark each week day month year price profit"
).split()

_LATEX = [
    "\\boxed{", "\\frac{", "\\sqrt{", "\\cdot", "\\times", "\\left(", "\\right)", "\\pi",
    "x^2", "y^2", "\\le", "\\ge", "\\neq", "\\{", "\\}", "$", "$$",
]
_TAGS = ["<think>", "</think>", "<answer>", "</answer>", "####", "<<", ">>", "\n\n", "Answer:"]


def _corpus(seed: int = 0, n_lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.45:
            n = rng.randint(4, 16)
            words = [rng.choice(_WORDS) for _ in range(n)]
            s = " ".join(words)
            lines.append(s[0].upper() + s[1:] + rng.choice([".", "?", "!", ","]))
        elif kind < 0.75:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*", "/"])
            lines.append(f"{a} {op} {b} = {rng.randint(0, 9999)}. <<{a}{op}{b}>> #### {rng.randint(-99, 9999):,}")
        elif kind < 0.9:
            lines.append(" ".join(rng.choice(_LATEX) + str(rng.randint(0, 99)) + "}" for _ in range(3)))
        else:
            lines.append(" ".join(rng.choice(_TAGS) + rng.choice(_WORDS) for _ in range(4)))
    # every 1-3 digit number once so they become single tokens
    lines.extend(" ".join(str(i) for i in range(j, j + 50)) for j in range(0, 1000, 50))
    return lines


def build_tokenizer(vocab_size: int = 4096, seed: int = 0):
    """Train a byte-level BPE tokenizer in-process and wrap it as a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's normalizer and pre-tokenizer, so that transformers' AutoTokenizer (which picks
    # Qwen2Tokenizer from config.json's model_type and rebuilds the pipeline) tokenizes
    # exactly as the tokenizer we trained.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    hf.padding_side = "left"  # generation-friendly; collators pad explicitly
    return hf


def build_tiny_model(
    out_dir: str | Path | None = None,
    *,
    arch: str = "qwen2",
    size: str = "micro",
    vocab_size: int = 4096,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_word_embeddings: bool = True,
):
    """Build (and optionally save) a random model + tokenizer. Returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    hidden, layers, heads, kv, inter = SIZES[size]
    tokenizer = build_tokenizer(vocab_size, seed=seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common, rope_theta=10000.0)
    elif arch == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0)
    else:
        raise ValueError(f"arch must be qwen2 or llama, got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return model, tokenizer


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
