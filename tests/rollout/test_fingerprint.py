"""The weight fingerprint the sync check compares (rollout/fingerprint.py, rollout/sync_check.py).

Each promise is checked from outside: statistics worked out by hand, layouts built here (a fused
q/k/v, shuffled rows, a transposed Conv1D), and real AdamW updates at the learning rates RL uses
on the micro model, with the engine's copy cast to bf16 as a bf16 engine casts it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from relign.rollout.fingerprint import COLUMNS, differing, fingerprint, output_head
from relign.rollout.hf_engine import HFEngine
from relign.rollout.sync_check import trainer_fingerprint


def test_statistics_by_hand():
    """Decoder layer 0: a 2 x 40 matrix (rows 1..40 and -(1..40)) of which the first 32 columns count,
    and a norm [0.5, -1.5]; the other weights: one weight [2].

    matrix: count 64, sum 528 - 528 = 0, sum |x| 2 * 528 = 1056, sum x^2 2 * (32 * 33 * 65 / 6) = 22880
    norm:   count 2,  sum -1,             sum |x| 2,               sum x^2 0.25 + 2.25 = 2.5
    """
    row = torch.arange(1.0, 41.0)
    named = [("model.layers.0.mlp.w.weight", torch.stack([row, -row])),
             ("model.layers.0.norm.weight", torch.tensor([0.5, -1.5])), ("model.norm.weight", torch.tensor([2.0]))]
    assert COLUMNS == 32
    assert fingerprint(named) == {"decoder layer 0": (66.0, -1.0, 1058.0, 22882.5), "other weights": (1.0, 2.0, 2.0, 4.0)}


def test_fused_and_shuffled_layouts_have_the_trainers_fingerprint():
    """vLLM's layout: q, k and v in one matrix under another name, its rows in another order: the
    same fingerprint to float64 rounding (the sums run in another order)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 48, generator=g) * 0.02 for n in (64, 32, 32))
    emb = torch.randn(100, 48, generator=g)
    trainer = fingerprint([("model.embed_tokens.weight", emb), ("model.layers.3.self_attn.q_proj.weight", q),
                           ("model.layers.3.self_attn.k_proj.weight", k), ("model.layers.3.self_attn.v_proj.weight", v)])
    qkv = torch.cat([q, k, v])[torch.randperm(128, generator=g)]
    engine = fingerprint([("layers.3.attn.qkv_proj.weight", qkv), ("embed.weight", emb)])
    assert trainer.keys() == {"other weights", "decoder layer 3"} and trainer["decoder layer 3"][0] == 128 * COLUMNS
    assert differing(engine, trainer) == []


def test_one_rounding_step_of_one_weight_is_seen(tiny_model_dir):
    """The micro model's largest weight of layer 1's first columns moved to the next float32: that
    decoder layer, and nothing else, differs (one fp32 step of 0.07 is ~2e-11 of the layer's sum of |x|)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    other = copy.deepcopy(model)
    w = other.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        i = w[:, :COLUMNS].abs().argmax()
        r, c = divmod(int(i), COLUMNS)
        w[r, c] = torch.nextafter(w[r, c], torch.tensor(1.0))
    head, tied = output_head(model)
    assert (head, tied) == ("model.embed_tokens.weight", True)
    a = fingerprint(model.named_parameters(), head=head, tied=tied)
    b = fingerprint(other.named_parameters(), head=head, tied=tied)
    assert set(a) == {"other weights", "decoder layer 0", "decoder layer 1", "output head"}
    assert differing(a, b) == ["decoder layer 1"]


def test_a_tied_head_is_its_own_group_and_the_embedding_counts_in_rest(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fp = fingerprint(model.named_parameters(), head="model.embed_tokens.weight", tied=True)
    emb = model.model.embed_tokens.weight.detach()[:, :COLUMNS].double()
    norm = model.model.norm.weight.detach().double()
    assert fp["output head"] == pytest.approx((emb.numel(), emb.sum().item(), emb.abs().sum().item(), (emb**2).sum().item()))
    assert fp["other weights"][0] == emb.numel() + norm.numel()
    assert fp["other weights"][1] == pytest.approx(emb.sum().item() + norm.sum().item(), rel=1e-12)


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lr", [1e-6, 1e-4])
def test_an_update_the_engine_missed_is_seen_and_a_synced_engine_passes(tiny_model_dir, tokenizer, engine_dtype, lr):
    """One AdamW step of the trainer (fp32) at lr 1e-6 or 1e-4; the engine (an HF engine's replica,
    in fp32 or cast to bf16 as a bf16 engine casts it) before and after receiving it. bf16's step
    near 0.02 is ~1e-4: at lr 1e-6 only ~1% of the weights cross to another bf16 value, and the
    fingerprint still sees every layer move."""
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = HFEngine(copy.deepcopy(policy).to(engine_dtype), tokenizer)
    cast = None if engine_dtype == torch.float32 else engine_dtype
    assert differing(engine.weight_fingerprint().groups, trainer_fingerprint(policy, "trainer", cast)) == []

    ids = torch.randint(3, policy.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    policy(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = trainer_fingerprint(policy, "trainer", cast)
    assert set(differing(engine.weight_fingerprint().groups, after)) == {"other weights", "decoder layer 0", "decoder layer 1", "output head"}

    engine.load_weights(policy.named_parameters())
    assert differing(engine.weight_fingerprint().groups, after) == []


def test_gpt2_conv1d_weights_are_compared_as_an_engine_that_loads_them_into_linears_holds_them():
    """GPT-2 stores W [in, out]; vLLM holds W.T. The trainer's side for a checkpoint-format engine
    is the fingerprint of the transposed matrices, built here by hand."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=48, n_head=2, vocab_size=64, n_positions=16))
    convs = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert len(convs) == 4
    by_hand = fingerprint(((n, p.T if n in convs else p) for n, p in model.named_parameters()),
                          head="transformer.wte.weight", tied=True)
    plain = fingerprint(model.named_parameters(), head="transformer.wte.weight", tied=True)
    assert differing(by_hand, plain) == ["decoder layer 0"]  # the transposition matters: 48 columns, 32 of them read
    assert differing(trainer_fingerprint(model, "checkpoint", None), by_hand) == []
