"""torchrun initialisation, FSDP2 wrapping and cross-rank reductions.

Recipes learn about ranks only through this module: ``rank()``, ``world_size()``,
``all_reduce_sum`` and ``wrap_fsdp``. Single process is the default and costs nothing.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init(device: torch.device | None = None) -> None:
    """Join the torchrun process group if launched by torchrun (WORLD_SIZE > 1)."""
    if is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    use_cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (returns a new tensor; identity on one process)."""
    if not is_initialized():
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if not is_initialized():
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def wrap_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) per decoder layer and at the root.

    No-op on a single process. Parameters become DTensors; gradients are reduce-scattered,
    which averages them over ranks. Recipes normalize losses by global counts and multiply
    the loss by the world size to turn that average back into the global sum.
    """
    if world_size() == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    layers = None
    for name in ("model.layers", "base_model.model.model.layers", "transformer.h"):
        obj = model
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
            layers = obj
            break
        except AttributeError:
            continue
    for layer in layers or []:
        fully_shard(layer)
    fully_shard(model)
    return model


def cleanup() -> None:
    if is_initialized():
        dist.destroy_process_group()
