"""Model FLOPs and model FLOPs utilization (``perf/mfu``): one formula for the runs and the benches.

The count is the model's arithmetic, not the kernels': a matrix product of [m, k] by [k, n] is
2·m·k·n FLOPs, and nothing else is counted (norms, softmax, RoPE and the optimizer are a few
percent at most). For one forward pass:

* a token through the decoder: 2 × (its linear weights), every layer (``token``);
* the LM head, 2 × hidden × vocab, only at the positions where it runs (``head``): a trainer that
  scores the response only (``logits_to_keep``) does not run it on the prompt, so counting 6N
  for every token, as the usual 6N + attention estimate does, overstates a run whose prompts are
  long (on the GPU bench's SFT rows, whose first eighth is prompt, by 3%);
* attention: 4 × heads × head_dim per (query, key) pair, every layer (``pair``): q·k and p·v;
  a causal sequence of n tokens has n(n+1)/2 pairs, and a sequence continuing a prefix of p
  tokens has p pairs more per token.

Training is forward + backward = 3 × forward (the backward computes the inputs' gradients and
the weights', two products per product), and a recomputation under gradient checkpointing is
not counted (it is hardware FLOPs, not model FLOPs). LoRA training is counted as full training,
as veRL and most reports count it.

MFU = model FLOPs / (seconds × devices × peak FLOP/s). The peak is the device's dense bf16 rate
(``PEAKS``, from the device name) unless ``logging.peak_tflops`` sets it; with neither (a CPU, an
unknown GPU) there is no MFU: runs then log no ``perf/mfu`` rather than a made-up one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..devices import GPUS

# device-name fragment -> (dense bf16 TFLOP/s, HBM TB/s), most specific first (vendors' data sheets): read
# from relign.devices.GPUS, the one table of devices (relign plan takes their memory from it too)
PEAKS: list[tuple[str, float, float]] = [(fragment, tflops, tbs) for _, fragments, _, tflops, tbs in GPUS
                                         for fragment in fragments]


def device_peak(name: str) -> tuple[float, float]:
    """(dense bf16 TFLOP/s, HBM TB/s) of the device called ``name`` (``torch.cuda.get_device_name``),
    (0, 0) when it is not in ``PEAKS``."""
    return next(((flops, bw) for fragment, flops, bw in PEAKS if fragment in name), (0.0, 0.0))


def peak_flops(device: torch.device | str, tflops: float = 0.0) -> float | None:
    """The peak FLOP/s of one ``device``: ``tflops`` × 1e12 when set (``logging.peak_tflops``),
    else from a GPU's name (``PEAKS``), else None (a CPU, an unknown GPU: no MFU)."""
    if tflops > 0:
        return tflops * 1e12
    device = torch.device(device)
    if device.type != "cuda":
        return None
    known, _ = device_peak(torch.cuda.get_device_name(device))
    return known * 1e12 if known else None


class ModelFlops:
    """Forward FLOPs of one decoder-only transformer (a transformers config): ``token`` per token
    through the decoder, ``head`` per position the LM head runs at, ``pair`` per (query, key)
    pair attention computes."""

    def __init__(self, cfg):
        h, n = cfg.hidden_size, cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or n
        d = getattr(cfg, "head_dim", None) or h // n
        per_layer = h * n * d + 2 * h * kv * d + n * d * h + 3 * h * cfg.intermediate_size  # q, k, v, o; gate, up, down
        self.token = 2 * per_layer * cfg.num_hidden_layers
        self.head = 2 * h * cfg.vocab_size
        self.pair = 4 * n * d * cfg.num_hidden_layers  # q.k and p.v, every layer

    def causal(self, n: int) -> float:
        """Attention FLOPs of one causal sequence of ``n`` tokens."""
        return n * (n + 1) / 2 * self.pair

    def full(self, queries: int, keys: int) -> float:
        """Attention FLOPs of a call that computes every (query, key) pair (a dense mask)."""
        return queries * keys * self.pair

    def sequence(self, tokens: int, head: int, prefix: int = 0) -> float:
        """Forward FLOPs of ``tokens`` tokens that attend causally to themselves and to all of
        ``prefix`` earlier keys (a continuation of a shared prompt; 0: a sequence on its own),
        with the LM head at ``head`` of them."""
        return tokens * self.token + head * self.head + (self.causal(tokens) + tokens * prefix * self.pair)

    def group(self, prompt: int, responses: Sequence[int], *, shared: bool, head: bool = True) -> float:
        """Forward FLOPs of one prompt's responses, the LM head at the response tokens (none when
        not ``head``: a reward model's or a critic's scalar head is a few FLOPs). ``shared``: the
        prompt runs once and every response attends to it (a DPO pair, an RL group in relign's
        shared-prompt layouts; the packed layout's repeated prompt token is layout, like padding,
        and not counted); else every [prompt | response] row runs on its own."""
        if shared:
            return prompt * self.token + self.causal(prompt) + sum(self.sequence(r, r * head, prefix=prompt) for r in responses)
        return sum(self.sequence(prompt + r, r * head) for r in responses)


def model_flops(model: torch.nn.Module) -> ModelFlops | None:
    """``ModelFlops`` of a transformers model, or of the first one inside ``model`` (a peft
    wrapper, a value model's LM); None when no config in it gives the shape."""
    needed = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    for m in model.modules():
        cfg = getattr(m, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        if cfg is not None and all(isinstance(getattr(cfg, k, None), int) for k in needed):
            return ModelFlops(cfg)
    return None


def mfu(flops: float, seconds: float, peak: float | None, devices: int = 1) -> dict[str, float]:
    """``{"perf/mfu": flops / (seconds × devices × peak)}``, or nothing when the peak is unknown."""
    if not peak or seconds <= 0:
        return {}
    return {"perf/mfu": flops / (seconds * devices * peak)}
