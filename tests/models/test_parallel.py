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
    from torch.distributed._functional_collectives import all_to_all_single_autograd
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
    # the autograd all-to-all models.cp uses: rank r sends x[2j:2j+2] to rank j; y = the pieces from ranks 0 and 1
    x = (torch.arange(4.0) + 10 * rank).requires_grad_()
    y = all_to_all_single_autograd(x, None, None, dist.group.WORLD)
    y = y.wait() if hasattr(y, "wait") else y
    (y * torch.arange(4.0)).sum().backward()
    return {"logits": (out - want).abs().max().item(), "grads": grads, "local_rows": q_proj.to_local().shape[0],
            "rows": q_proj.shape[0], "y": y.tolist(), "x_grad": x.grad.tolist()}


def test_probe_gloo_runs_tensor_parallel_and_autograd_all_to_all():
    """What the design needs from gloo: ColwiseParallel/RowwiseParallel on q/k/v, o, gate/up,
    down give the unsharded model's logits and every parameter's gradient (each rank holds half
    of q_proj's rows), and the functional collectives' autograd all_to_all_single moves pieces,
    and their gradients back. (torch.distributed.nn's all_to_all_single works too, deprecated.)"""
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


G = 4  # completions per prompt


def _rollout_batch(tokenizer, vocab: int):
    """3 groups x G: prompts of 3 lengths, responses of 1..20 random tokens (mixed lengths)."""
    import random

    from relign.rollout.batch import build_batch
    from relign.rollout.multiturn import Episode

    rng = random.Random(0)
    episodes = []
    for text in ["What is 2 + 3?", "Name a color.", "Count to four, then say that the answer is 4 and stop."]:
        pid = tokenizer(text)["input_ids"]
        for _ in range(G):
            n = rng.randint(1, 20)
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            episodes.append(Episode(prompt_ids=list(pid), response_ids=ids, response_mask=[1] * n,
                                    sampling_logps=[-1.0] * n, token_rewards=[0.0] * n))
    return build_batch(episodes, tokenizer.pad_token_id or 0, "cpu", group_size=G)


def _layouts():
    from relign.recipes.rl_update import Layout

    return {"packed, prompt once": Layout("packed", group_size=G), "shared KV": Layout("shared", group_size=G),
            "padded": Layout("padded")}


def _tp_logps(model, batch, want: dict) -> dict:
    """One rank of a tp = 2 mesh: the batch's log-probs in each layout (every rank scores all rows: dp = 1)."""
    from relign import distributed
    from relign.recipes import frame
    from relign.recipes.rl_update import plan, score_logps

    distributed.init_mesh(tp_size=2)
    model = frame.shard(model)  # tensor parallel over the 2 ranks, then FSDP2 over dp = 1
    q = model.model.layers[0].self_attn.q_proj.weight
    rows = torch.arange(batch.size)
    out = {"placements": str(q.placements), "local": list(q.to_local().shape), "logps": {}}
    with torch.no_grad():
        for name, layout in _layouts().items():
            lp = score_logps(model, batch, plan(batch, rows, layout), layout, temperature=1.0)
            out["logps"][name] = (lp - want[name]).abs().max().item()
    return out


def test_tensor_parallel_logps_in_every_layout(tiny_model_dir, tokenizer):
    """tp = 2 on 2 ranks (relign's own path: frame.shard applies the model's plan, then FSDP2):
    the log-probs of a mixed-length batch equal one process's within 1e-6 in every layout
    (packed with each group's prompt once, shared KV, padded)."""
    from transformers import AutoModelForCausalLM

    from relign.models import varlen
    from relign.recipes.rl_update import forward_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert varlen.enable(model)  # the packed layout's attention, sequence by sequence (as rl does)
    batch = _rollout_batch(tokenizer, model.config.vocab_size)
    assert len(set(batch.seq_lens.tolist())) > 6
    rows = torch.arange(batch.size)
    with torch.no_grad():
        want = {name: forward_logps(model, batch, rows, layout, temperature=1.0)[0] for name, layout in _layouts().items()}
    for r in run_ranks(_tp_logps, 2, model, batch, want):
        # q_proj's weight: FSDP's dim-0 shard over dp (of size 1) of tp's dim-0 shard: 32 of its 64 rows here
        assert r["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))" and r["local"] == [32, 64]
        for name, err in r["logps"].items():  # measured 4.8e-7: one float32 ulp of log-probs near -8
            assert err < 1e-6, (name, err)


def _two_d_grads_and_clipping(model, ids, grads) -> dict:
    """One rank of a dp = 2 x tp = 2 mesh: a backward of its replica's half of the rows, then the
    gradient clipped to a tenth of the whole gradient's norm."""
    from relign import distributed
    from relign.optim import clip_gradients
    from relign.recipes import frame

    distributed.init_mesh(tp_size=2)
    model = frame.shard(model)
    d = distributed.data_rank()
    half = len(ids) // distributed.data_size()
    # the loss is a sum over rows: FSDP averages the replicas' gradients, grad_scale (2) makes it the sum
    (model(input_ids=ids[d * half:(d + 1) * half]).logits.logsumexp(-1).sum() * distributed.grad_scale()).backward()
    out = {"data": (d, distributed.data_size()), "grads": {}, "placements": set()}
    for n, p in model.named_parameters():
        out["grads"][n] = (distributed.full_tensor(p.grad) - grads[n]).abs().max().item()
        out["placements"].add(str(p.grad.placements))
    norm = clip_gradients(list(model.parameters()), max_norm=float(grads["norm"]) / 10)
    out["norm"] = norm
    out["clipped"] = max((distributed.full_tensor(p.grad) - grads[n] / 10).abs().max().item()
                         for n, p in model.named_parameters())
    out["placements"] = sorted(out["placements"])
    return out


def test_two_d_mesh_gradients_and_clipping_with_mixed_placements():
    """dp = 2 x tp = 2 on 4 ranks: every parameter's gradient is the 1-process gradient of the
    whole batch, and clipping with mixed placements (q/k/v/o/MLP weights split over tp and
    FSDP-sharded over dp on a 2-D mesh; norms and embeddings FSDP-sharded on dp only) sees the
    1-process norm: the square root of every gradient entry's square, summed here in float64
    from the whole gradients; every clipped gradient is the whole one times max_norm / norm.
    (A norm that summed FSDP's _StridedShard pieces over tp only read 5.48 for 6.12 here.)"""
    from relign.models.tiny import build_tiny_model

    model, _ = build_tiny_model(size="micro", seed=0)
    ids = torch.randint(0, 200, (4, 12), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    ref(input_ids=ids).logits.logsumexp(-1).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    grads["norm"] = torch.tensor(sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5)
    results = run_ranks(_two_d_grads_and_clipping, 4, model, ids, grads)
    assert [r["data"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # rank = dp x 2 + tp
    for r in results:
        assert r["placements"] == ["(Shard(dim=0), Shard(dim=1))", "(Shard(dim=0),)",
                                   "(_StridedShard(dim=0, sf=2), Shard(dim=0))"]
        assert max(r["grads"].values()) < 1e-6, r["grads"]
        assert r["norm"] == pytest.approx(float(grads["norm"]), rel=1e-6)
        assert r["clipped"] < 1e-6


def _qwen3_tp(model, lean: bool) -> dict:
    from relign import distributed
    from relign.models.lean import lean_activations
    from relign.models.tp import apply_tp

    distributed.init_mesh(tp_size=2)
    ref = copy.deepcopy(model)
    if lean:  # relign's lean kernels first, as load_causal_lm applies them; the norms keep theirs under tp
        assert lean_activations(model) > 0
    apply_tp(model, distributed.mesh("tp"))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids).logits
    out.logsumexp(-1).mean().backward()
    want = ref(input_ids=ids).logits
    want.logsumexp(-1).mean().backward()
    grads = {n: (distributed.full_tensor(p.grad) - q.grad).abs().max().item()
             for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    return {"logits": (out - want).abs().max().item(), "grads": grads}


@pytest.mark.parametrize("lean", [False, True])
def test_qwen3_plan_sums_the_per_head_norms_gradients(lean):
    """Qwen3's own plan (transformers' base_model_tp_plan) on tp = 2: q_norm and k_norm are whole
    weights applied to each rank's own heads, so each rank's weight gradient is a partial sum over
    heads; 'replicated_with_grad_allreduce' sums it over the tp ranks. Logits and every gradient,
    those norms' included, equal the unsharded model's, with relign's lean kernels too."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for r in run_ranks(_qwen3_tp, 2, model, lean):
        assert r["logits"] < 1e-6
        norms = {n: e for n, e in r["grads"].items() if "q_norm" in n or "k_norm" in n}
        assert len(norms) == 4 and max(r["grads"].values()) < 1e-6, r["grads"]


def _cp_logps_and_grads(model, ids, pos) -> dict:
    """One rank of a cp = 2 mesh: its targets' log-probs of the packed row, the backward of their
    sum, and the parameter gradients summed over the cp ranks (what FSDP over dp x cp does)."""
    from relign import distributed
    from relign.models.cp import cp_token_logps, enable_ulysses

    distributed.init_mesh(cp_size=2)
    group = distributed.mesh("cp").get_group()
    enable_ulysses(model, 2)
    lp, _ = cp_token_logps(model, ids, pos, group)
    lp.sum().backward()
    mine = (lp != 0).nonzero()[:, 1].tolist()
    whole = lp.detach().clone()
    dist.all_reduce(whole, group=group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[n] = g
    return {"mine": mine, "logps": whole, "grads": grads}


def test_ulysses_context_parallel_equals_one_process_across_the_chunk_boundary(tiny_model_dir):
    """cp = 2 on 2 ranks: a packed row of 3 sequences (7, 12 and 10 tokens, 29 in all: chunks of
    15 tokens, the second sequence crossing the boundary at 15, the row padded by one token) gives
    one process's log-probs and gradients within 1e-5. Rank 0 scores tokens 1..15 (the 15th is
    rank 1's first token), rank 1 tokens 16..28."""
    from transformers import AutoModelForCausalLM

    from relign.models import varlen
    from relign.models.logprobs import token_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert varlen.enable(model)
    lens = [7, 12, 10]
    ids = torch.randint(3, 200, (1, sum(lens)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    ref = copy.deepcopy(model)
    want, _ = token_logps(ref, ids, position_ids=pos)
    want.sum().backward()
    a, b = run_ranks(_cp_logps_and_grads, 2, model, ids, pos)
    assert a["mine"] == list(range(1, 16)) and b["mine"] == list(range(16, 29))
    for r in (a, b):
        torch.testing.assert_close(r["logps"], want, atol=1e-5, rtol=0)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][n], p.grad, atol=1e-5, rtol=1e-5, msg=n)


def _cp_whole_rows(model, critic, ids, pos) -> dict:
    """One rank of a cp = 2 mesh, as RL runs it: whole-row log-probs, entropy and values on every
    rank (``whole_row``), one loss of them all, its backward, the gradients summed over cp."""
    from relign import distributed
    from relign.models.cp import cp_token_logps, cp_values, enable_ulysses, whole_row

    distributed.init_mesh(cp_size=2)
    group = distributed.cp_group()
    enable_ulysses(model, 2)
    enable_ulysses(critic, 2)
    lp, ent = cp_token_logps(model, ids, pos, group, temperature=0.7, with_entropy=True, entropy_grad=True)
    lp, ent, v = whole_row(lp, group), whole_row(ent, group), whole_row(cp_values(critic, ids, pos, group), group)
    _loss(lp, ent, v).backward()
    grads = {}
    for n, p in [*model.named_parameters(), *critic.named_parameters(prefix="critic")]:
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[n] = g
    return {"logps": lp.detach(), "entropy": ent.detach(), "values": v.detach(), "grads": grads}


def _loss(lp, ent, v):
    """A loss that weighs every column differently (a ratio-like term, an entropy bonus, a value error)."""
    w = torch.linspace(-1.0, 2.0, lp.shape[1])[None]
    return (w * lp.exp()).sum() - 0.1 * (w * ent).sum() + ((v - w) ** 2).sum()


def test_context_parallel_whole_rows_entropy_and_values_equal_one_process(tiny_model_dir):
    """What RL reads under cp = 2: every rank holds the whole packed row's log-probs (temperature
    0.7), entropy (with its gradient) and critic values, equal to one process's within 1e-5; a
    loss of all three on every rank backpropagates, summed over the cp ranks, to one process's
    gradients of the policy and the critic. The row: 7 + 12 + 10 tokens, the middle sequence
    crossing the chunk boundary; the values at rank 1's first targets read rank 0's last
    hidden state."""
    from transformers import AutoModelForCausalLM

    from relign.models import varlen
    from relign.models.logprobs import token_logps
    from relign.models.value import ValueModel

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    critic = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)).eval()
    torch.nn.init.normal_(critic.head.weight, std=0.1, generator=torch.Generator().manual_seed(1))  # not 0: values vary
    assert varlen.enable(model) and varlen.enable(critic)
    lens = [7, 12, 10]
    ids = torch.randint(3, 200, (1, sum(lens)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    ref, ref_critic = copy.deepcopy(model), copy.deepcopy(critic)
    lp, ent = token_logps(ref, ids, position_ids=pos, temperature=0.7, with_entropy=True, entropy_grad=True)
    v = ref_critic(ids, position_ids=pos)
    _loss(lp, ent, v).backward()
    want = dict(ref.named_parameters()) | dict(ref_critic.named_parameters(prefix="critic"))
    for r in run_ranks(_cp_whole_rows, 2, model, critic, ids, pos):
        torch.testing.assert_close(r["logps"], lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r["entropy"], ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r["values"], v.detach(), atol=1e-5, rtol=0)
        assert r["values"][0, 15:18].abs().min() > 0  # rank 1's first targets are real values
        for n, p in want.items():
            torch.testing.assert_close(r["grads"][n], p.grad, atol=1e-5, rtol=1e-5, msg=n)
