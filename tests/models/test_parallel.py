"""Tensor and context parallelism on CPU with gloo (docs/parallel.md): each layout computes what one
process computes. The ranks are forks of the test process (tests/multirank.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ..multirank import run_ranks

pytestmark = pytest.mark.slow  # several ranks on a 2-core machine


def _tp_plan(n_layers: int) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return plan


def _probe(model) -> dict:
    """One rank of the probe: torch's own DTensor TP on a 2-layer Qwen2, and an autograd all-to-all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.nn.functional import all_to_all_single
    from torch.distributed.tensor.parallel import parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = copy.deepcopy(model)
    parallelize_module(model, init_device_mesh("cpu", (world,)), _tp_plan(len(model.model.layers)))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids).logits
    out.logsumexp(-1).mean().backward()
    want = ref(input_ids=ids).logits
    want.logsumexp(-1).mean().backward()
    grads = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = (g - q.grad).abs().max().item()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    # all_to_all_single: rank r sends x[2j:2j+2] to rank j; y = the pieces from ranks 0 and 1
    x = (torch.arange(4.0) + 10 * rank).requires_grad_()
    y = all_to_all_single(torch.empty(4), x)
    (y * torch.arange(4.0)).sum().backward()
    return {"logits": (out - want).abs().max().item(), "grads": grads, "local_rows": q_proj.to_local().shape[0],
            "rows": q_proj.shape[0], "y": y.tolist(), "x_grad": x.grad.tolist()}


def test_probe_gloo_runs_tensor_parallel_and_autograd_all_to_all():
    """What the design needs from gloo: ColwiseParallel/RowwiseParallel on q/k/v, o, gate/up,
    down give the unsharded model's logits and every parameter's gradient (each rank holds half
    of q_proj's rows), and all_to_all_single moves pieces and their gradients back."""
    from relign.models.tiny import build_tiny_model

    model, _ = build_tiny_model(size="micro", seed=0)
    a, b = run_ranks(_probe, 2, model)
    for r in (a, b):
        assert r["logits"] < 1e-6
        assert len(r["grads"]) == len(list(model.parameters())) and max(r["grads"].values()) < 1e-6, r["grads"]
        assert (r["local_rows"], r["rows"]) == (32, 64)  # 4 heads x 16 dims, 2 heads per rank
    # rank 0 gets [x0[0], x0[1], x1[0], x1[1]] = [0, 1, 10, 11], rank 1 [x0[2], x0[3], x1[2], x1[3]].
    assert a["y"] == [0.0, 1.0, 10.0, 11.0] and b["y"] == [2.0, 3.0, 12.0, 13.0]
    # d/dx of sum_j j * y_j: an element landing at slot j gets j; x_r[i] lands at slot 2r + i % 2.
    assert a["x_grad"] == [0.0, 1.0, 0.0, 1.0] and b["x_grad"] == [2.0, 3.0, 2.0, 3.0]
