"""The policy's weights in the form an engine takes them (``Engine.weight_format``).

* ``trainer``: the trainable parameters under the trainer's own names. The HF engine holds
  the policy module itself (one process) or a replica of it (torchrun), LoRA wrapper included.
* ``checkpoint``: every parameter under its Hugging Face checkpoint name, with a LoRA adapter
  merged into its base weight (W + s·B·A, computed beside the model, which stays unmerged:
  merging in place and back would drift the base weights by rounding at every sync). This is
  what an engine that loads checkpoints takes (vLLM).

Both gather FSDP2-sharded parameters one tensor at a time, in module order, so a consumer that
streams decoder layer by decoder layer holds one layer at a time. Every rank must iterate
(each gather is a collective).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import distributed


def trainer_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the trainable parameters."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield name, distributed.full_tensor(p.detach())


def checkpoint_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) of every parameter, LoRA merged (see the module docstring)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's wrapped LM
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_" in name or ".modules_to_save." in name or ".original_module." in name:
                continue  # adapter tensors: folded into the base weight below
            if ".base_layer." not in name:
                yield name, distributed.full_tensor(p.detach())
                continue
            owner, leaf = name.split(".base_layer.")
            w = distributed.full_tensor(p.detach())
            if leaf == "weight":
                w = w + _lora_delta(base.get_submodule(owner)).to(w.dtype)
            yield f"{owner}.{leaf}", w


def _lora_delta(layer) -> torch.Tensor | float:
    """s·B·A summed over the layer's active adapters (0 when it is already merged)."""
    if getattr(layer, "merged", False):
        return 0.0
    delta = 0.0
    for a in layer.active_adapters:
        if a not in layer.lora_A:
            continue
        A = distributed.full_tensor(layer.lora_A[a].weight.detach()).float()
        B = distributed.full_tensor(layer.lora_B[a].weight.detach()).float()
        delta = delta + layer.scaling[a] * (B @ A)
    if getattr(layer, "fan_in_fan_out", False) and torch.is_tensor(delta):  # GPT-2's Conv1D stores W transposed
        delta = delta.T
    return delta


def engine_weights(engine, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as ``engine`` takes them."""
    if engine.weight_format == "checkpoint":
        return checkpoint_weights(model)
    return trainer_weights(model)
