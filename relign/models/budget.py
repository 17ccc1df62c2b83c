"""Token budgets of one forward/backward pass, sized for the device (``max_tokens_per_micro: null``).

A pass has fixed costs that do not grow with its tokens: the Python that launches some 1,500
kernels, autocast's weight casts, the gradient accumulation over all weights. On a GPU the
4,096-token passes that suit a CPU leave it waiting on the host (specs/gpu_speed.md, P3), so
on CUDA the default budget is ``CUDA_TOKENS`` tokens, or fewer where the free memory cannot
hold that many tokens' activations. The CPU keeps its old defaults: there the passes cost their
arithmetic, and a bigger one only holds more memory.

What one token costs (``bytes_per_token``, an estimate, **not measured**): 48 bytes per hidden
unit per layer (Korthikanti et al. 2022 count 34 for 16-bit activations without recompute; the
bf16-mixed residual stream and norms stay fp32, so more), or 52 per layer's input under
gradient checkpointing (the fp32 layer inputs, plus one layer recomputed at a time: ~48 / L),
and 6 bytes per vocabulary entry (the bf16 logits and their fp32 chunk upcast, kept for the
backward). Of the free memory, the optimizer's state yet to be allocated (fp32 gradients and
AdamW's two moments: 12 bytes per trainable parameter) is set aside, and 60% of the rest goes
to activations.
"""

from __future__ import annotations

import torch

CUDA_TOKENS = 32768
CPU_TOKENS = 4096  # RL's budget on the CPU (SFT's is off there: micro_batch_size examples per pass)
MIN_TOKENS = 1024


def _config(model):
    cfg = getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def bytes_per_token(model, *, checkpointing: bool = False) -> int:
    """Estimated bytes one token of a training pass keeps for the backward (see the module)."""
    cfg = _config(model)
    d, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    per_layer = 4 * d + 48 * d // max(layers, 1) if checkpointing else 48 * d
    return layers * per_layer + 6 * vocab


def device_tokens(setting: int | None, model, device, *, cpu: int, checkpointing: bool = False) -> int:
    """``max_tokens_per_micro`` for this run: ``setting`` when it is given (0 = no limit), else by
    device: ``cpu`` on the CPU; on CUDA ``CUDA_TOKENS``, or what 60% of the free memory (less the
    optimizer state to come) holds if that is fewer, in steps of 1,024 and at least ``MIN_TOKENS``."""
    if setting is not None:
        return setting
    device = torch.device(device)
    if device.type != "cuda":
        return cpu
    free, _ = torch.cuda.mem_get_info(device)
    # this rank's share of each trainable parameter (FSDP2 holds DTensor shards)
    state = 12 * sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters() if p.requires_grad)
    fit = int(0.6 * max(free - state, 0) / bytes_per_token(model, checkpointing=checkpointing))
    return max(MIN_TOKENS, min(CUDA_TOKENS, fit // 1024 * 1024))
