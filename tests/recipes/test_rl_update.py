"""The RL update (relign.recipes.rl_update): layouts, micro-batching and ranks change nothing
but speed; the actor loss terms and the metrics match hand-computed numbers."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from relign import distributed
from relign.algorithms.aggregation import aggregate
from relign.models import varlen
from relign.models.value import ValueModel
from relign.recipes.rl_update import (
    ActorLoss,
    Layout,
    Stats,
    forward_logps,
    forward_values,
    plan,
    score_logps,
    update_critic,
    update_policy,
)
from relign.rollout.batch import build_batch
from relign.rollout.multiturn import Episode

from ..conftest import REPO, torch_threads

G = 4
TOL = 1e-5
PACKED_SHARED = Layout("packed", group_size=G)  # a group's prompt once, its responses continuing it in the row
ENV_ROW = 6  # the multi-turn row: environment tokens in the middle of its response


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def proto(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()  # no dropout: every pass over the same tokens gives the same numbers
    return model


@pytest.fixture(scope="module")
def batch(tokenizer, proto):
    """3 groups x G=4: prompts of 3 lengths, random responses of 1..20 tokens, one multi-turn row."""
    rng = random.Random(0)
    V = proto.config.vocab_size
    prompts = ["What is 2 + 3?", "Name a color.", "Count to four, then say that the answer is 4 and stop."]
    episodes = []
    for g, text in enumerate(prompts):
        pid = tokenizer(text)["input_ids"]
        for j in range(G):
            if g * G + j == ENV_ROW:  # model turn, environment reply (mask 0), model turn
                mask = [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
            else:
                mask = [1] * rng.randint(1, 20)
            ids = [rng.randrange(3, V) for _ in mask]
            episodes.append(Episode(prompt_ids=list(pid), response_ids=ids, response_mask=mask,
                                    sampling_logps=[-1.0] * len(ids), token_rewards=[0.0] * len(ids)))
    b = build_batch(episodes, tokenizer.pad_token_id or 0, "cpu", group_size=G)
    assert len(set(b.prompt_lens.tolist())) == 3 and min(b.prompt_lens.tolist()) >= 2
    assert len(set(b.seq_lens.tolist())) > 6  # mixed lengths: padding matters
    assert b.response_mask[ENV_ROW].sum() == 6
    return b


class GradRecorder:
    """An optimizer that records the gradients it is asked to step with and changes nothing."""

    def __init__(self, named_params):
        self.names, self.params = zip(*named_params)
        self.param_groups = [{"params": list(self.params), "lr": 0.0}]
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self):
        self.grads.append({n: p.grad.clone() for n, p in zip(self.names, self.params) if p.grad is not None})

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _advantages(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    per_row = torch.randn(batch.size, 1, generator=g)
    per_tok = 0.3 * torch.randn(batch.input_ids.shape, generator=g)
    return (per_row + per_tok) * batch.response_mask


def _old_logps(proto, batch, seed=2):
    """The current log-probs shifted by up to +-0.3 per token, so that clipping happens."""
    all_rows = torch.arange(batch.size)
    lp = score_logps(proto, batch, [m for m in plan(batch, all_rows, Layout("padded"))], Layout("padded"), temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    return (lp + 0.6 * (torch.rand(lp.shape, generator=g) - 0.5)) * batch.response_mask


def _update(proto, batch, layout, loss_fn, mini_batches=None, by_sequence=False, **kw):
    model = copy.deepcopy(proto)
    if by_sequence:  # what rl.train does with packing=true: no block mask (relign.models.varlen)
        assert varlen.enable(model)
    opt = GradRecorder(model.named_parameters())
    mini_batches = mini_batches or [torch.arange(batch.size)]
    stats, skipped = update_policy(model, opt, None, list(model.parameters()), batch, mini_batches, layout, loss_fn,
                                   max_grad_norm=0.0, **kw)
    assert skipped == 0
    assert len(opt.grads) == len(mini_batches)
    return stats.values["actor/loss"], opt.grads, stats.reduce()


def _assert_same(a, b, tol=TOL):
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    assert loss_a == pytest.approx(loss_b, abs=tol, rel=0)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert ga.keys() == gb.keys() and ga
        for name in ga:
            torch.testing.assert_close(ga[name], gb[name], atol=tol, rtol=0, msg=name)
    assert any(g.abs().max() > 1e-3 for g in grads_a[0].values())  # the gradients compared are not all ~0


# --------------------------------------------------------------------------- layouts


def _all_layouts():
    return {"packed": Layout("packed"), "padded": Layout("padded"), "shared": Layout("shared", group_size=G)}


def test_layouts_give_the_same_logps_and_entropy(proto, batch):
    rows = torch.arange(batch.size)
    m = batch.response_mask
    resp = torch.arange(batch.input_ids.shape[1])[None] >= batch.prompt_lens[:, None]
    resp &= torch.arange(batch.input_ids.shape[1])[None] < batch.seq_lens[:, None]  # the response span
    out = {}
    by_sequence = copy.deepcopy(proto)
    assert varlen.enable(by_sequence)
    with torch.no_grad():
        for name, layout in _all_layouts().items():
            out[name] = forward_logps(proto, batch, rows, layout, temperature=1.0, with_entropy=True)
        out["packed, by sequence"] = forward_logps(by_sequence, batch, rows, Layout("packed"), temperature=1.0,
                                                   with_entropy=True)
        out["packed, prompt once"] = forward_logps(by_sequence, batch, rows, PACKED_SHARED, temperature=1.0,
                                                   with_entropy=True)
    ref_lp, ref_ent = out["padded"]
    assert (ref_lp[m.bool()] < 0).all()  # real log-probs on every target
    assert (ref_ent[m.bool()] > 0).all()
    for name, (lp, ent) in out.items():
        torch.testing.assert_close(lp * m, ref_lp * m, atol=TOL, rtol=0, msg=name)
        torch.testing.assert_close(ent * m, ref_ent * m, atol=TOL, rtol=0, msg=name)
        # 0 on prompts, padding and environment tokens in every layout
        assert (lp[~resp] == 0).all() and (ent[~resp] == 0).all(), name
        assert (lp[m == 0] == 0).all() and (ent[m == 0] == 0).all(), name


def test_the_cuda_paths_code_gives_the_padded_update(proto, batch, monkeypatch):
    """The update in the packed layouts through the CUDA path's code (one gathered varlen call
    per layer, the flash kernel replaced by the dense reference): whole rows and each prompt once
    give the padded update's loss and gradients, and the forward reads no tensor on the host."""
    monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen_attn)
    adv, old, loss_fn = _advantages(batch), _old_logps(proto, batch), ActorLoss(clip_low=0.2, clip_high=0.2)
    padded = _update(proto, batch, Layout("padded"), loss_fn, advantages=adv, old_logps=old)
    reads = []
    real = varlen.attend

    def guarded(*a, **kw):  # the attention with every host read of a tensor recorded
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__"):
                m.setattr(torch.Tensor, name, lambda *_, name=name: reads.append(name))
            return real(*a, **kw)

    monkeypatch.setattr(varlen, "attend", guarded)
    for layout in (Layout("packed", max_tokens=60, max_length=64), PACKED_SHARED):
        _assert_same(_update(proto, batch, layout, loss_fn, by_sequence=True, advantages=adv, old_logps=old), padded)
    assert reads == []


def test_logps_are_the_hand_computed_ones(proto, batch):
    """One row, naively: log_softmax of the full forward, token t scored by position t - 1."""
    row = ENV_ROW
    n = int(batch.seq_lens[row])
    with torch.no_grad():
        logits = proto(batch.input_ids[row : row + 1, :n]).logits[0].double()
        lp, _ = forward_logps(proto, batch, torch.arange(batch.size), Layout("packed"), temperature=0.7)
    logp = torch.log_softmax(logits / 0.7, -1)
    for t in range(1, n):
        want = logp[t - 1, batch.input_ids[row, t]].item() if batch.response_mask[row, t] else 0.0
        assert lp[row, t].item() == pytest.approx(want, abs=TOL), t


def test_shared_layout_zero_on_environment_tokens(proto, batch):
    with torch.no_grad():
        lp, ent = forward_logps(proto, batch, torch.arange(batch.size), Layout("shared", group_size=G),
                                temperature=1.0, with_entropy=True)
    env = batch.response_mask == 0
    assert (lp[env] == 0).all() and (ent[env] == 0).all()


def test_padded_layout_zero_outside_targets_with_one_token_prompt(proto):
    eps = [Episode(prompt_ids=[5], response_ids=[7, 8, 9], response_mask=[1, 1, 1], sampling_logps=[0.0] * 3,
                   token_rewards=[0.0] * 3),
           Episode(prompt_ids=[5, 6, 7], response_ids=[7, 8, 9, 10, 11], response_mask=[1] * 5,
                   sampling_logps=[0.0] * 5, token_rewards=[0.0] * 5)]
    b = build_batch(eps, 0, "cpu")
    with torch.no_grad():
        lp, _ = forward_logps(proto, b, torch.arange(2), Layout("padded"), temperature=1.0)
    assert (lp[b.response_mask == 0] == 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_padded_shared_update_same_loss_and_grads(proto, batch, agg):
    adv, old = _advantages(batch), _old_logps(proto, batch)
    loss_fn = ActorLoss(agg=agg, clip_low=0.2, clip_high=0.28)
    runs = {name: _update(proto, batch, layout, loss_fn, advantages=adv, old_logps=old)
            for name, layout in _all_layouts().items()}
    assert runs["padded"][2]["actor/clip_frac"] > 0  # some tokens are clipped: the clip path is covered
    runs["packed, by sequence"] = _update(proto, batch, Layout("packed"), loss_fn, advantages=adv, old_logps=old,
                                          by_sequence=True)
    _assert_same(runs["packed"], runs["padded"])
    _assert_same(runs["shared"], runs["padded"])
    _assert_same(runs["packed, by sequence"], runs["padded"])
    runs["packed, prompt once"] = _update(proto, batch, PACKED_SHARED, loss_fn, advantages=adv, old_logps=old,
                                          by_sequence=True)
    _assert_same(runs["packed, prompt once"], runs["padded"])
    # clip_frac counts ratios past 1 - 0.2 and 1 + 0.28, a step function: it is an invariance only
    # if no token's log-ratio lies within rounding of a bound (else 1e-7 of noise could flip it)
    lp = score_logps(proto, batch, plan(batch, torch.arange(batch.size), Layout("padded")), Layout("padded"), temperature=1.0)
    log_ratio = (lp - old)[batch.response_mask.bool()]
    for bound in (math.log(1 - 0.2), math.log(1 + 0.28)):
        assert (log_ratio - bound).abs().min() > 1e-4
    for key in ("actor/clip_frac", "actor/entropy"):
        assert runs["packed"][2][key] == pytest.approx(runs["padded"][2][key], abs=TOL)
        assert runs["shared"][2][key] == pytest.approx(runs["padded"][2][key], abs=TOL)


def test_layouts_same_with_kl_entropy_and_two_mini_batches(proto, batch):
    """kl_coef (gradient through logps), entropy bonus (gradient through the entropy), TIS
    weights and one optimizer step per mini-batch."""
    adv, old = _advantages(batch, seed=3), _old_logps(proto, batch, seed=4)
    ref = old - 0.2 * batch.response_mask
    tis = (1.0 + 0.5 * torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(5))) * batch.response_mask
    loss_fn = ActorLoss(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    minis = [torch.arange(0, 8), torch.arange(8, 12)]
    runs = {name: _update(proto, batch, layout, loss_fn, mini_batches=minis, advantages=adv, old_logps=old,
                          ref_logps=ref, tis=tis) for name, layout in _all_layouts().items()}
    _assert_same(runs["packed"], runs["padded"])
    _assert_same(runs["shared"], runs["padded"])
    assert runs["padded"][2]["actor/kl"] > 0
    # groups split over micro-batches (the prompt's gradient sent back once, after the last part)
    split = _update(proto, batch, Layout("shared", group_size=G, max_rows=3), loss_fn, mini_batches=minis,
                    advantages=adv, old_logps=old, ref_logps=ref, tis=tis)
    _assert_same(split, runs["padded"])
    for layout in (PACKED_SHARED, Layout("packed", group_size=G, max_rows=3)):  # whole groups; parts, each with its prompt
        _assert_same(_update(proto, batch, layout, loss_fn, mini_batches=minis, advantages=adv, old_logps=old,
                             ref_logps=ref, tis=tis, by_sequence=True), runs["padded"])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_changes_nothing(proto, batch, agg):
    adv, old = _advantages(batch, seed=6), _old_logps(proto, batch, seed=7)
    loss_fn = ActorLoss(agg=agg, max_len=32)
    biggest = int(batch.seq_lens.max())
    one = _update(proto, batch, Layout("padded", max_tokens=100_000), loss_fn, advantages=adv, old_logps=old)
    for layout in (
        Layout("padded", max_tokens=biggest),  # the longest row alone fills a micro-batch
        Layout("padded", max_rows=1),
        Layout("padded", max_tokens=60),
        Layout("packed", max_tokens=biggest),
        Layout("packed", max_rows=3),
        Layout("shared", group_size=G, max_rows=G),  # one group per micro-batch
        Layout("shared", group_size=G, max_rows=2),  # each group in two parts, its prompt run once
        Layout("shared", group_size=G, max_rows=1),  # one row per micro-batch, the prompt still once per group
    ):
        assert len(plan(batch, torch.arange(batch.size), layout)) > 1
        _assert_same(_update(proto, batch, layout, loss_fn, advantages=adv, old_logps=old), one)
    for layout in (Layout("packed", group_size=G, max_rows=G), Layout("packed", group_size=G, max_rows=2),
                   Layout("packed", group_size=G, max_tokens=60)):
        assert len(plan(batch, torch.arange(batch.size), layout)) > 1
        _assert_same(_update(proto, batch, layout, loss_fn, advantages=adv, old_logps=old, by_sequence=True), one)


@pytest.mark.parametrize("layout", [Layout("shared", group_size=G), Layout("shared", group_size=G, max_rows=2),
                                    Layout("packed"), Layout("padded", max_rows=3)], ids=["shared", "split", "packed", "padded"])
def test_skipping_zero_advantage_groups_changes_nothing(proto, batch, layout, monkeypatch):
    """Groups with A = 0 everywhere (all rewards equal) are not run, and the update is the same:
    the same loss and gradients, also for a mini-batch where no group is left (zero gradients,
    the optimizer still steps)."""
    import relign.recipes.rl_update as ru

    adv, old = _advantages(batch, seed=8), _old_logps(proto, batch, seed=9)
    adv[2 * G : 3 * G] = 0.0  # group 2 (the second mini-batch) solved by every sample
    loss_fn = ActorLoss(agg="seq-mean-token-sum-norm", max_len=32)  # Dr. GRPO's aggregation
    minis = [torch.arange(0, 2 * G), torch.arange(2 * G, 3 * G)]
    rows_run = []
    real = ru.forward_logps
    monkeypatch.setattr(ru, "forward_logps", lambda m, b, rows, *a, **k: rows_run.append(len(rows)) or real(m, b, rows, *a, **k))
    full = _update(proto, batch, layout, loss_fn, mini_batches=minis, advantages=adv, old_logps=old)
    assert sum(rows_run) == batch.size
    rows_run.clear()
    skip = _update(proto, batch, layout, loss_fn, mini_batches=minis, advantages=adv, old_logps=old, skip_inert=True)
    assert sum(rows_run) == 2 * G  # the solved group's forward and backward did not run
    _assert_same(skip, full)
    assert all(g.abs().max() == 0 for g in skip[1][1].values())  # the empty mini-batch: an exact zero gradient
    assert skip[2]["actor/zero_adv_frac"] == pytest.approx(G / batch.size)
    assert skip[2]["actor/skipped_rows_frac"] == pytest.approx((0 + 1) / 2)  # mean over the two mini-batches
    assert full[2]["actor/skipped_rows_frac"] == 0.0


def test_zero_advantage_rows_still_train_under_a_kl_or_entropy_term(proto, batch):
    adv, old = _advantages(batch, seed=8), _old_logps(proto, batch, seed=9)
    adv[:G] = 0.0
    mask = batch.response_mask
    assert ActorLoss().inert_rows(adv, mask).tolist() == [True] * G + [False] * (batch.size - G)
    for loss_fn in (ActorLoss(kl_coef=0.05), ActorLoss(entropy_coef=0.01)):
        assert not loss_fn.inert_rows(adv, mask).any()
        kw = dict(ref_logps=old - 0.1 * mask) if loss_fn.kl_coef else {}
        _, _, stats = _update(proto, batch, Layout("shared", group_size=G), loss_fn, advantages=adv, old_logps=old,
                              skip_inert=True, **kw)
        assert stats["actor/skipped_rows_frac"] == 0.0


def test_loss_is_the_hand_computed_surrogate(proto, batch):
    """actor/loss == token-mean of -min(rho A, clip(rho) A), computed naively from the log-probs."""
    adv, old = _advantages(batch, seed=8), _old_logps(proto, batch, seed=9)
    (loss,), _, _ = _update(proto, batch, Layout("packed", max_tokens=50), ActorLoss(clip_low=0.2, clip_high=0.2),
                            advantages=adv, old_logps=old)
    with torch.no_grad():
        lp, _ = forward_logps(proto, batch, torch.arange(batch.size), Layout("padded"), temperature=1.0)
    total, n = 0.0, 0
    for i, t in batch.response_mask.nonzero().tolist():
        rho = math.exp(lp[i, t].item() - old[i, t].item())
        a = adv[i, t].item()
        total += -min(rho * a, min(max(rho, 0.8), 1.2) * a)
        n += 1
    assert loss == pytest.approx(total / n, abs=TOL)


def test_no_old_logps_means_ratio_one(proto, batch):
    """old_logps None: the ratio is 1, the loss is -token-mean(A), nothing is clipped, and the
    gradient is that of -A log pi (the ratio's gradient at 1)."""
    adv = _advantages(batch, seed=10)
    m = batch.response_mask
    (loss,), (grads,), metrics = _update(proto, batch, Layout("shared", group_size=G), ActorLoss(), advantages=adv)
    assert loss == pytest.approx(float(-(adv * m).sum() / m.sum()), abs=TOL)
    assert metrics["actor/clip_frac"] == 0.0
    assert "actor/logp_mismatch" in metrics
    model = copy.deepcopy(proto)
    lp, _ = forward_logps(model, batch, torch.arange(batch.size), Layout("padded"), temperature=1.0)
    (-(adv * lp * m).sum() / m.sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=TOL, rtol=0, msg=name)


def test_simulated_ranks_sum_to_the_single_process_update(proto, batch, monkeypatch):
    """Each of W ranks runs its share of the micro-batches (empty ones at weight 0); the ranks'
    losses sum to the one-process loss and their gradients (FSDP averages them) to its gradient."""
    adv, old = _advantages(batch, seed=11), _old_logps(proto, batch, seed=12)
    loss_fn = ActorLoss(agg="seq-mean-token-mean")
    layout = Layout("shared", group_size=G)
    (full_loss,), (full_grads,), _ = _update(proto, batch, layout, loss_fn, advantages=adv, old_logps=old)
    W = 4  # more ranks than the 3 groups: one rank only runs a zero-weight pass
    monkeypatch.setattr(distributed, "world_size", lambda: W)
    seen, weights, losses, grads = [], [], [], []
    for r in range(W):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        micro = plan(batch, torch.arange(batch.size), layout)
        seen += [row for m in micro if m.weight for row in m.rows.tolist()]
        weights.append([m.weight for m in micro])
        (loss,), (g,), _ = _update(proto, batch, layout, loss_fn, advantages=adv, old_logps=old)
        losses.append(loss)
        grads.append(g)
    assert sorted(seen) == list(range(batch.size))
    assert len({len(w) for w in weights}) == 1 and sum(w == [0.0] for w in weights) == 1
    assert sum(losses) == pytest.approx(full_loss, abs=TOL)
    for name in full_grads:
        mean = sum(g[name] for g in grads) / W
        torch.testing.assert_close(mean, full_grads[name], atol=TOL, rtol=0, msg=name)


# --------------------------------------------------------------------------- plan


@pytest.mark.parametrize("layout", [
    Layout("padded"), Layout("padded", max_tokens=40), Layout("packed", max_tokens=30, max_rows=3),
    Layout("padded", max_rows=1), Layout("shared", group_size=G), Layout("shared", group_size=G, max_tokens=60),
    Layout("shared", group_size=G, max_rows=5), Layout("shared", group_size=G, max_rows=3),
    Layout("packed", group_size=G, max_tokens=60), Layout("packed", group_size=G, max_rows=3),
])
def test_plan_covers_each_row_once_within_budget(batch, layout):
    rows = torch.arange(batch.size)
    micro = plan(batch, rows, layout)
    assert all(m.weight == 1.0 for m in micro)  # one process: no padding passes
    got = [r for m in micro for r in m.rows.tolist()]
    assert sorted(got) == list(range(batch.size))
    shared = layout.group_size > 1
    if shared and layout.max_rows and layout.max_rows < G:  # groups split in parts of <= max_rows, in order
        k = -(-G // layout.max_rows)
        parts = [(i, k) if layout.kind == "shared" else None for _ in range(batch.size // G) for i in range(k)]
        assert [m.part for m in micro] == parts  # a packed part runs its own prompt
        assert all(len(m.rows) <= layout.max_rows for m in micro)
        assert [r for m in micro for r in m.rows.tolist()] == sorted(got)
        return
    for m in micro:
        r = m.rows.tolist()
        if shared:  # whole groups, in order
            assert len(r) % G == 0
            for k in range(0, len(r), G):
                assert r[k] % G == 0 and r[k : k + G] == list(range(r[k], r[k] + G))
            # tokens as computed: each group's prompt once
            # (packed: each later response repeats the prompt's last token)
            again = 1 if layout.kind == "packed" else 0
            tokens = sum(int(batch.seq_lens[r[k : k + G]].sum() - (G - 1) * (batch.prompt_lens[r[k]] - again))
                         for k in range(0, len(r), G))
            items = len(r) // G
        else:
            tokens, items = int(batch.seq_lens[m.rows].sum()), len(r)
        if items > 1:
            if layout.max_tokens:
                assert tokens <= layout.max_tokens
            if layout.max_rows:
                assert len(r) <= max(layout.max_rows, G if shared else 1)


def test_split_groups_score_like_whole_groups_and_run_each_prompt_once(proto, batch, monkeypatch):
    """score_logps (reference / old log-probs, no gradient) over parts of groups, and the prompt
    forward counted: once per group, not once per part."""
    import relign.recipes.rl_update as ru

    rows = torch.arange(batch.size)
    whole = score_logps(proto, batch, plan(batch, rows, Layout("shared", group_size=G)), Layout("shared", group_size=G),
                        temperature=1.0)
    calls = []
    real = ru.prompt_prefix
    monkeypatch.setattr(ru, "prompt_prefix", lambda *a, **k: calls.append(1) or real(*a, **k))
    layout = Layout("shared", group_size=G, max_rows=1)
    micro = plan(batch, rows, layout)
    split = score_logps(proto, batch, micro, layout, temperature=1.0)
    assert len(micro) == batch.size and len(calls) == batch.size // G
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=0)


def test_packed_groups_run_each_prompt_once(proto, batch, monkeypatch):
    """The packed row of whole groups holds each prompt once, plus its last token again before
    each later response: the tokens the forward sees, counted."""
    model = copy.deepcopy(proto)
    assert varlen.enable(model)
    seen = []
    real = model.model.forward  # the decoder stack: the model's own forward and the fused head (token_logps) both run it
    monkeypatch.setattr(model.model, "forward", lambda input_ids=None, **kw: seen.append(input_ids.shape) or real(input_ids=input_ids, **kw))
    with torch.no_grad():
        forward_logps(model, batch, torch.arange(batch.size), PACKED_SHARED, temperature=1.0)
    P, T = batch.prompt_lens, batch.seq_lens
    want = sum(int(T[k : k + G].sum() - (G - 1) * (P[k] - 1)) for k in range(0, batch.size, G))
    assert seen == [torch.Size([1, want])] and want < int(T.sum()) - 10


def test_plan_of_a_mini_batch_keeps_its_rows(batch):
    rows = torch.arange(4, 12)  # groups 1 and 2
    micro = plan(batch, rows, Layout("shared", group_size=G, max_rows=G))
    assert sorted(r for m in micro for r in m.rows.tolist()) == list(range(4, 12))
    assert len(micro) == 2


# --------------------------------------------------------------------------- ActorLoss by hand


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_ppo_clip_at_ratio_one_is_minus_advantage():
    logps = _t([-1.0, -2.0, -0.5]).requires_grad_()
    A = _t([0.5, -1.5, 2.0])
    mask = _t([1.0, 1.0, 1.0])
    loss, info = ActorLoss()(logps, logps.detach(), A, mask)
    torch.testing.assert_close(loss, _t([-0.5, 1.5, -2.0]))
    assert info["clipped"].sum() == 0 and "kl" not in info
    loss.sum().backward()  # d(-rho A)/d logp = -rho A = -A at rho = 1
    torch.testing.assert_close(logps.grad, -A)


def test_ppo_clip_by_hand():
    # rho = exp(0.5) = 1.6487 on both tokens, eps = 0.2:
    #   A = +1: -min(1.6487, 1.2) = -1.2   (clipped, no gradient)
    #   A = -1: -min(-1.6487, -1.2) = 1.6487 (unclipped)
    #   with dual_clip c = 1.5: A = -1 is capped at -c A = 1.5 (no gradient)
    logps = _t([-1.0, -1.0])
    old = logps - 0.5
    A = _t([1.0, -1.0])
    mask = _t([1.0, 1.0])
    loss, info = ActorLoss()(logps, old, A, mask)
    torch.testing.assert_close(loss, _t([-1.2, math.exp(0.5)]))
    torch.testing.assert_close(info["clipped"], _t([1.0, 0.0]))
    loss, info = ActorLoss(dual_clip=1.5)(logps, old, A, mask)
    torch.testing.assert_close(loss, _t([-1.2, 1.5]))
    torch.testing.assert_close(info["clipped"], _t([1.0, 1.0]))


def test_gspo_by_hand():
    # Row 0: mask [1, 1, 0], A = [1, 3, 99] -> one advantage per sequence: (1 + 3) / 2 = 2.
    # Row 1: mask [1, 1, 1], A = -1 everywhere.
    # old = logps - 0.1 on every token -> s_i = exp(mean log-ratio) = exp(0.1) = 1.105171 for both rows.
    # clip_high 0.05:
    #   row 0 (A = 2 > 0): -min(1.105171 * 2, 1.05 * 2) = -2.1 per token (clipped: no gradient)
    #   row 1 (A = -1):    -min(-1.105171, -1.05)    = 1.105171 per token (unclipped)
    # and 0 at the masked token. The gradient of the unclipped row: d L_it / d lp_it = -A s_i.
    logps = _t([-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]).requires_grad_()
    old = logps.detach() - 0.1
    A = _t([1.0, 3.0, 99.0], [-1.0, -1.0, -1.0])
    mask = _t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    loss, info = ActorLoss(policy_loss="gspo", clip_low=0.05, clip_high=0.05)(logps, old, A, mask)
    s = math.exp(0.1)
    torch.testing.assert_close(loss, _t([-2.1, -2.1, 0.0], [s, s, s]))
    torch.testing.assert_close(info["ratio"], torch.full((2, 3), s))
    torch.testing.assert_close(info["clipped"], _t([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]))
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, _t([0.0, 0.0, 0.0], [s, s, s]))


def test_kl_term_by_hand():
    # logp = -1.0, ref = -1.5: log r = ref - logp = -0.5,
    # k3 = exp(-0.5) - 1 - (-0.5) = 0.6065307 - 0.5 = 0.1065307; with beta = 0.1 the loss at
    # ratio 1 is -A + 0.1 * 0.1065307 = -2 + 0.01065307.
    logps = _t([-1.0])
    k3 = math.exp(-0.5) - 0.5
    loss, info = ActorLoss(kl_coef=0.1)(logps, logps, _t([2.0]), _t([1.0]), ref_logps=_t([-1.5]))
    assert loss.item() == pytest.approx(-2.0 + 0.1 * k3, abs=1e-6)
    assert info["kl"].item() == pytest.approx(k3, abs=1e-6)
    # beta = 0: the KL is a metric only
    loss, info = ActorLoss(kl_coef=0.0)(logps, logps, _t([2.0]), _t([1.0]), ref_logps=_t([-1.5]))
    assert loss.item() == pytest.approx(-2.0, abs=1e-6) and info["kl"].item() == pytest.approx(k3, abs=1e-6)
    # k1 = -log r = 0.5
    _, info = ActorLoss(kl_estimator="k1")(logps, logps, _t([2.0]), _t([1.0]), ref_logps=_t([-1.5]))
    assert info["kl"].item() == pytest.approx(0.5, abs=1e-6)


def test_entropy_bonus_and_tis_by_hand():
    logps = _t([-1.0, -2.0])
    A = _t([1.0, -0.5])
    H = _t([2.0, 0.5])
    # entropy_coef 0.1: -A - 0.1 H = [-1 - 0.2, 0.5 - 0.05]
    loss, _ = ActorLoss(entropy_coef=0.1)(logps, logps, A, _t([1.0, 1.0]), entropy=H)
    torch.testing.assert_close(loss, _t([-1.2, 0.45]))
    # TIS weights multiply the policy term only: w (-A) - 0.1 H
    loss, _ = ActorLoss(entropy_coef=0.1)(logps, logps, A, _t([1.0, 1.0]), entropy=H, tis=_t([0.5, 2.0]))
    torch.testing.assert_close(loss, _t([-0.5 - 0.2, 1.0 - 0.05]))


# --------------------------------------------------------------------------- Stats


def test_stats_by_hand():
    s = Stats()
    x = _t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    s.add_masked("actor/entropy", x, _t([1.0, 1.0, 0.0], [0.0, 1.0, 0.0]))  # 1 + 2 + 5 over 3 tokens
    s.add_masked("actor/entropy", x, _t([0.0, 0.0, 1.0], [0.0, 0.0, 0.0]))  # + 3 over 1 token
    s.add_masked("actor/entropy", 100 * x, torch.ones(2, 3), weight=0.0)  # a zero-weight pass adds nothing
    s.add_masked("actor/kl", x, torch.zeros(2, 3))  # no tokens: left out
    s.add("actor/loss", 1.0)
    s.add("actor/loss", 4.0)
    s.add("actor/skipped_updates", 1.0)
    s.add("actor/skipped_updates", 1.0)
    s.add("actor/empty_updates", 1.0)
    out = s.reduce()
    assert out == {
        "actor/entropy": pytest.approx(11.0 / 4, abs=1e-12),
        "actor/loss": pytest.approx(2.5, abs=1e-12),
        "actor/skipped_updates": 2.0,  # summed, not averaged
        "actor/empty_updates": 1.0,
    }


def test_update_policy_skips_non_finite_and_counts_empty(proto, batch):
    adv = _advantages(batch)
    model = copy.deepcopy(proto)
    opt = GradRecorder(model.named_parameters())
    old = torch.zeros_like(batch.response_mask)
    old[0, int(batch.prompt_lens[0])] = float("nan")
    stats, skipped = update_policy(model, opt, None, list(model.parameters()), batch,
                                   [torch.arange(batch.size), torch.arange(0), torch.arange(batch.size)],
                                   Layout("padded"), ActorLoss(), advantages=adv, old_logps=old)
    assert skipped == 2 and opt.grads == []
    out = stats.reduce()
    assert out["actor/skipped_updates"] == 2.0 and out["actor/empty_updates"] == 1.0


# --------------------------------------------------------------------------- critic


@pytest.fixture(scope="module")
def critic_proto(proto):
    critic = ValueModel(copy.deepcopy(proto))
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():  # a random head: the zero init would make every layout trivially equal
        critic.head.weight.copy_(0.5 * torch.randn(critic.head.weight.shape, generator=g))
        critic.head.bias.fill_(0.1)
    return critic


def _critic_update(critic_proto, batch, layout, **kw):
    critic = copy.deepcopy(critic_proto)
    opt = GradRecorder(critic.named_parameters())
    stats = update_critic(critic, opt, list(critic.parameters()), batch, [torch.arange(batch.size)], layout,
                          max_grad_norm=0.0, **kw)
    return stats.values["critic/value_loss"], opt.grads, {}


@pytest.mark.parametrize("value_clip", [0.0, 0.05])
def test_critic_layouts_and_micro_batches_same_loss_and_grads(critic_proto, batch, value_clip):
    m = batch.response_mask
    with torch.no_grad():
        v = forward_values(critic_proto, batch, torch.arange(batch.size), Layout("padded"))
        v_packed = forward_values(critic_proto, batch, torch.arange(batch.size), Layout("packed"))
    torch.testing.assert_close(v_packed * m, v * m, atol=TOL, rtol=0)
    assert (v_packed[m == 0] == 0).all()
    by_sequence = copy.deepcopy(critic_proto)
    assert varlen.enable(by_sequence)
    with torch.no_grad():
        v_once = forward_values(by_sequence, batch, torch.arange(batch.size), PACKED_SHARED)
    torch.testing.assert_close(v_once * m, v * m, atol=TOL, rtol=0)
    g = torch.Generator().manual_seed(14)
    returns = torch.randn(m.shape, generator=g) * m
    old_values = (v + 0.1 * torch.randn(m.shape, generator=g)) * m
    kw = {"old_values": old_values, "returns": returns, "value_clip": value_clip}
    padded = _critic_update(critic_proto, batch, Layout("padded"), **kw)
    # by hand: token-mean of 1/2 max((V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2)
    err = (v - returns) ** 2
    if value_clip:
        err = torch.maximum(err, (old_values + (v - old_values).clamp(-value_clip, value_clip) - returns) ** 2)
    assert padded[0][0] == pytest.approx(float(aggregate(0.5 * err, m)), abs=TOL)
    for layout in (Layout("packed"), Layout("packed", max_rows=2), Layout("padded", max_tokens=30),
                   Layout("shared", group_size=G, max_rows=G)):
        _assert_same(_critic_update(critic_proto, batch, layout, **kw), padded)


@pytest.mark.parametrize("mini_batches", [1, 3])
def test_the_vineppo_presets_kl_term_is_the_references(proto, batch, mini_batches):
    """VinePPO's reference adds beta * mean over sequences of sum_t clamp(k3_t, 0, 10) to a
    token-mean policy loss (its ``sum(dim=1).mean()``). With relign's VinePPO preset (its
    algorithm.* read from the shipped YAML, the actor loss built as rl.train builds it), the logged
    loss of an update with zero advantages (the policy term is 0) is that number, worked out here
    per sequence, whatever the mini-batches. A per-token beta * k3 under token-mean would be the
    mean response length (~10) times weaker."""
    from relign.config import load_config
    from relign.recipes import rl

    a = load_config(rl.Config, str(REPO / "relign" / "presets" / "vineppo.yaml")).algorithm
    assert (a.kl, a.kl_estimator, a.kl_agg, a.kl_clamp, a.loss_agg) == ("loss", "k3", "seq-mean-token-sum", 10.0, "token-mean")
    beta = a.kl_coef
    loss_fn = rl.actor_loss(a, max_len=32)
    mask = batch.response_mask
    g = torch.Generator().manual_seed(3)
    ref = (score_logps(proto, batch, plan(batch, torch.arange(batch.size), Layout("padded")), Layout("padded"),
                       temperature=1.0) + 2.0 * torch.randn(mask.shape, generator=g)) * mask  # k3 up to past 10
    groups = torch.arange(batch.size).view(-1, G)
    parts = [p.flatten() for p in torch.tensor_split(groups, mini_batches)]
    losses, _, _ = _update(proto, batch, Layout("padded"), loss_fn, mini_batches=parts,
                           advantages=torch.zeros_like(mask), ref_logps=ref)
    with torch.no_grad():
        lp, _ = forward_logps(proto, batch, torch.arange(batch.size), Layout("padded"), temperature=1.0)
    for rows, loss in zip(parts, losses):
        per_seq = []
        for i in rows.tolist():
            total = 0.0
            for t in mask[i].nonzero().flatten().tolist():
                d = ref[i, t].item() - lp[i, t].item()
                total += min(max(math.exp(d) - d - 1.0, 0.0), 10.0)  # k3, clamped as the reference does
            per_seq.append(total)
        assert loss == pytest.approx(beta * sum(per_seq) / len(per_seq), rel=1e-5)
    assert max(per_seq) > 10  # some tokens were clamped: the clamp is exercised
