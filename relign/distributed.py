"""torchrun initialisation, FSDP2 wrapping and cross-rank reductions.

Recipes learn about ranks only through this module: ``rank()``, ``world_size()``,
``data_rank()``, ``data_size()``, ``all_reduce_sum`` and ``wrap_fsdp``. Single process is the
default and costs nothing.

The ranks form one ``(dp, cp, tp)`` device mesh (``init_mesh``, from ``parallel.tp_size`` and
``parallel.cp_size``; docs/parallel.md): the tp ranks of a model replica hold its heads and MLP
width in shards, the cp ranks its sequences in chunks, and the dp replicas see different rows.
Data is split by the data-parallel coordinates (``data_rank()`` of ``data_size()``), sums of
per-row results run over the dp group, and FSDP2 shards over dp x cp. With tp = cp = 1 (the
default) there is no mesh: the data ranks are the ranks and every group is the world, as before.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import watchdog
from .errors import ConfigError


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init(device: torch.device | None = None, wait_timeout: float = 0.0) -> None:
    """Join the torchrun process group if launched by torchrun (WORLD_SIZE > 1).

    ``wait_timeout``: the run's deadline for a blocking wait (``rollout.wait_timeout``; 0: none).
    The group's own timeout is set a minute past it (``group_timeout``): the collectives relign
    does not wait on itself (FSDP2's all-gathers and reduce-scatters inside the forward and
    backward) then fail by NCCL's (or gloo's) own timeout, while relign's watchdog, a minute
    earlier, still catches every collective relign waits on, with the stacks."""
    if is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    use_cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=group_timeout(wait_timeout))


def group_timeout(wait_timeout: float) -> timedelta:
    """The process group's timeout for a run whose waits have ``wait_timeout`` seconds (0: no
    deadline): 60 s more, so that the watchdog (stacks, exit 124) always fires first on a
    collective relign waits on; 30 minutes without a deadline, as before."""
    return timedelta(seconds=wait_timeout + 60.0) if wait_timeout > 0 else timedelta(minutes=30)


_SIZES = {"tp": 1, "cp": 1}
_MESH: Any = None  # the (dp, cp, tp) DeviceMesh when tp * cp > 1, else None
_DP_CP: Any = None  # its dp and cp dimensions flattened into one (FSDP's mesh), kept: torch deprecates slicing it again


def init_mesh(tp_size: int = 1, cp_size: int = 1) -> None:
    """Lay the ranks out as a ``(dp, cp, tp)`` mesh, dp = world / (tp * cp): rank
    ``(d * cp + c) * tp + t``, so a replica's tp ranks are neighbours (on one node, where its
    all-reduces are cheapest). tp = cp = 1: no mesh, nothing changes. The sizes are the caller's to
    check (``recipes.frame.check_parallel``: at least 1 each, tp x cp dividing the world)."""
    global _MESH, _DP_CP
    world = world_size()
    _SIZES.update(tp=tp_size, cp=cp_size)
    _MESH = _DP_CP = None
    if tp_size * cp_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        _MESH = init_device_mesh(device, (world // (tp_size * cp_size), cp_size, tp_size), mesh_dim_names=("dp", "cp", "tp"))
        _DP_CP = _MESH["dp", "cp"]._flatten("dp_cp")  # FSDP's mesh: cp ranks hold the same weights and sum their gradients


def mesh(name: str = "") -> Any:
    """The mesh (``name`` empty) or its ``dp``, ``cp``, ``tp`` or ``dp_cp`` dimension; None without a mesh."""
    if _MESH is None:
        return None
    if name == "dp_cp":
        return _DP_CP
    return _MESH[name] if name else _MESH


def mesh_shape() -> dict[str, int]:
    """``{"dp": .., "cp": .., "tp": ..}``: what ``--dry-run`` and the start banner print."""
    return {"dp": world_size() // (_SIZES["tp"] * _SIZES["cp"]), **{k: _SIZES[k] for k in ("cp", "tp")}}


def data_rank() -> int:
    """This rank's data-parallel coordinate: which share of each step's rows it trains on (the
    tp and cp ranks of one replica share its rows)."""
    return rank() // (_SIZES["tp"] * _SIZES["cp"])


def data_size() -> int:
    """How many shares the rows of a step are split into: dp."""
    return world_size() // (_SIZES["tp"] * _SIZES["cp"])


def grad_scale() -> int:
    """FSDP averages gradients over the ranks it shards over (dp x cp): a loss normalized by
    global counts is multiplied by this so that the gradients sum instead. The world size
    without a mesh."""
    return world_size() // _SIZES["tp"]


def _group(group: str):
    """The process group of ``group``: "dp" (the ranks that hold different rows; the world
    without a mesh), "dp_cp" (those and the cp ranks that hold different chunks of them: for
    sums of per-token results under context parallel) or "world"."""
    if group == "world" or _MESH is None:
        return None
    return mesh(group).get_group()


def cp_group():
    """The process group of this rank's cp ranks (the ranks that hold chunks of the same rows);
    None when parallel.cp_size is 1."""
    return _MESH["cp"].get_group() if _MESH is not None and _SIZES["cp"] > 1 else None


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def _on_host(out: torch.Tensor) -> torch.Tensor:
    """``out`` once the CPU has waited for the work that writes it. On NCCL a collective returns
    once it is enqueued, and its ``wait()`` only makes the current CUDA stream wait: the CPU
    would block later, at the copy back or the caller's ``.item()``, outside the watched block,
    and a dead rank would hang the others with no stacks. Synchronizing the stream inside the
    block is that wait (it also covers any earlier collective the stream waits on: FSDP2's,
    which relign does not call itself). On the CPU (gloo) there is nothing left to wait for."""
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()
    return out


def _all_reduce(t: torch.Tensor, op, group=None, host: bool = True) -> torch.Tensor:
    if not is_initialized():
        return t
    out = t.detach().clone()
    # NCCL reduces CUDA tensors only: a CPU counter travels through the GPU and comes back
    moved = dist.get_backend() == "nccl" and out.device.type != "cuda"
    if moved:
        out = out.cuda()
    with watchdog.waiting("a collective (all_reduce) with the other ranks"):
        dist.all_reduce(out, op=op, group=group, async_op=True).wait()  # gloo: the whole wait; NCCL: the stream's
        if moved:
            return out.to(t.device)  # the copy back: the CPU waits for the sum here
        return _on_host(out) if host else out


def all_reduce_sum(t: torch.Tensor, group: Any = "dp", *, host: bool = True) -> torch.Tensor:
    """Sum over the data-parallel ranks (``group="world"``: over all ranks; or a process group
    itself, a mesh dimension's ``get_group()``); a new tensor, identity on one process. The tp
    ranks of a replica compute the same per-row results, so a sum of those runs over dp, once per
    replica.

    The sum is finished when this returns (the CPU waited for it under the watchdog), so the
    caller's ``.item()`` cannot block. ``host=False``: a sum that only feeds the next kernels (a
    forward's, inside the model): on CUDA the stream waits for it and the CPU goes on."""
    if not is_initialized():
        return t
    return _all_reduce(t, dist.ReduceOp.SUM, _group(group) if isinstance(group, str) else group, host)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Max over all ranks; finished when this returns (as ``all_reduce_sum``)."""
    return _all_reduce(t, dist.ReduceOp.MAX) if is_initialized() else t


def lockstep(parts: list, filler) -> list[tuple[Any, bool]]:
    """This rank's micro-batches of a pass with no backward as ``(part, real)`` pairs, padded
    with ``(filler, False)`` up to the most any rank has. Each FSDP2 forward all-gathers, so
    every rank must run as many as the others: with 33 rows on 2 ranks in batches of 16, one
    rank has 2 batches and the other 1, and the first would wait forever for the second's
    all-gather. The caller runs the forward on a filler part and throws its result away
    (``real`` False). No padding on one process."""
    n = len(parts)
    if world_size() > 1:
        n = int(all_reduce_max(torch.tensor([len(parts)])).item())
    return [(p, True) for p in parts] + [(filler, False)] * (n - len(parts))


def barrier() -> None:
    if is_initialized():
        # NCCL's barrier is an all-reduce on a dummy tensor whose wait() synchronizes the stream
        # on the CPU: the whole wait is inside the block (and gloo's is the call)
        with watchdog.waiting("a collective (barrier) with the other ranks"):
            dist.barrier()


def all_gather_object(obj, group: str = "world"):
    """Every rank's ``obj``, in rank order (``[obj]`` on one process); ``group="dp"``: one per
    data-parallel replica, in dp order. For small Python data: the rollout groups of a step
    (token ids, rewards), not tensors of activations."""
    if not is_initialized():
        return [obj]
    pg = _group(group)
    out = [None] * (world_size() if pg is None else dist.get_world_size(pg))
    # on NCCL too every wait is inside the call: it reads the sizes with .item() and copies
    # each rank's bytes back to the CPU
    with watchdog.waiting("a collective (all_gather_object) with the other ranks"):
        dist.all_gather_object(out, obj, group=pg)
    return out


def on_main_for_all(fn):
    """``fn()`` run on rank 0 only, its result (or its error) given to every rank. An error that
    is not a ConfigError is re-raised as itself on rank 0 and as a RuntimeError elsewhere, so
    no rank is left waiting in a collective."""
    answer, failure = None, None
    if is_main():
        try:
            answer = ("ok", fn())
        except ConfigError as e:
            answer = ("config", str(e))
        except Exception as e:
            answer, failure = ("other", f"{type(e).__name__}: {e}"), e
    kind, value = all_gather_object(answer)[0]
    if failure is not None:
        raise failure
    if kind == "config":
        raise ConfigError(value)
    if kind == "other":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded DTensor) parameter; a collective when sharded,
    finished when this returns (its wait under the watchdog, as ``all_reduce_sum``)."""
    if not hasattr(t, "full_tensor"):
        return t
    with watchdog.waiting("a collective (full_tensor: gathering a sharded tensor) with the other ranks"):
        out = t.full_tensor()
        if hasattr(out, "wait"):  # an AsyncCollectiveTensor: the gather still in flight
            out = out.wait()
        return _on_host(out)


def _layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the blocks to shard one by one: the decoder layers transformers lists in
    ``_no_split_modules`` (for any model nested inside ``model``: a peft wrapper, a critic)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return names


def wrap_fsdp(model: torch.nn.Module, mixed: torch.dtype | None = None) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) per decoder layer and at the root.
    ``mixed``: the compute dtype of a mixed-precision model (``models.precision.mixed_dtype``:
    bf16 for ``model.dtype=bf16-mixed``), None for a model that computes in its weights' dtype.

    No-op on a single process. Parameters become DTensors; gradients are reduce-scattered,
    which averages them over ranks. Recipes normalize losses by global counts and multiply
    the loss by ``grad_scale()`` (the world size without a mesh) to turn that average back
    into the global sum. Every rank
    must then run the same number of forward and backward passes (each one all-gathers the
    layers' parameters).
    """
    if world_size() == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    classes = _layer_classes(model)
    # on a (dp, cp, tp) mesh: over dp x cp, the ranks that hold the same weights (a tp-sharded
    # weight is a DTensor on the tp dimension; FSDP shards it further, 2-D); the world otherwise
    where = {"mesh": mesh("dp_cp")} if _MESH is not None else {}
    policy = _mixed_precision_policy(mixed)
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in classes]
    for layer in layers:
        if policy:  # a layer's norms stay fp32, each its own unit (see _mixed_precision_policy)
            for sub in layer.modules():
                owns = next(sub.parameters(recurse=False), None) is not None
                if sub is not layer and owns and not isinstance(sub, torch.nn.Linear):
                    fully_shard(sub, **where)
        fully_shard(layer, **policy, **where)
    fully_shard(model, **where)
    return model


def _mixed_precision_policy(dtype: torch.dtype | None) -> dict:
    """``model.dtype=bf16-mixed``: the decoder layers' linear weights are all-gathered in bf16
    (half the bytes of fp32) and their gradients reduce-scattered in fp32 into the fp32 shards
    the optimizer keeps. Autocast would round these weights to bf16 for every product anyway,
    so gathering them in bf16 changes no number. What autocast leaves in fp32 stays fp32: the
    norms' weights (their own FSDP units, gathered in fp32), the root's parameters (embeddings,
    final norm, LM head, a critic's head) and the residual stream (``cast_forward_inputs=False``).
    2 ranks then match 1 to the order of float sums (tested). Nothing for fp32 or bf16 (``dtype`` None)."""
    if dtype is None:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)}


def reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters an FSDP2 root keeps after a forward with no backward.

    FSDP2 leaves the root's own parameters (embeddings, final norm, a critic's head) gathered
    after a forward, for the backward that usually follows. After a pass under ``no_grad``
    (reference, old log-probs, values, eval) none follows, and the next training forward then
    finds them gathered and leaves their gradients on the unsharded tensors: they never reach
    the sharded parameters, so those parameters silently stop training. Call this after every
    forward that has no backward. No-op on one process.
    """
    if hasattr(model, "reshard"):
        model.reshard()


_CLOSERS: list = []


def at_cleanup(fn) -> None:
    """Run ``fn`` in ``cleanup``, before the process group goes: a vLLM engine joins the
    trainer's group and tears the groups down itself when it shuts down."""
    _CLOSERS.append(fn)


def cleanup() -> None:
    global _MESH, _DP_CP
    while _CLOSERS:
        _CLOSERS.pop()()
    _MESH = _DP_CP = None
    _SIZES.update(tp=1, cp=1)
    if is_initialized():
        dist.destroy_process_group()
