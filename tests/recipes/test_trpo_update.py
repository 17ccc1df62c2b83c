"""TRPO's trust region holds over the whole batch (relign.recipes.rl_update.trpo_update).

The promise (Schulman et al. 2015, eq. 12; openai/baselines ``trpo_mpi``): an accepted step keeps
the mean KL(pi_old || pi_new) over the batch's response tokens within ``max_kl``. The Fisher-vector
product may use a subsample of the sequences (``fvp_subsample``: baselines' ``arr[::5]``); the line
search's KL and the logged ``trpo/kl`` may not. The test measures the KL over every response token
of every row with its own code, before and after the step."""

from __future__ import annotations

import random

import pytest
import torch

from relign.models.loading import load_causal_lm, trainable_parameters
from relign.recipes.rl_update import trpo_update
from relign.rollout.batch import build_batch
from relign.rollout.multiturn import Episode

from ..conftest import torch_threads

MAX_KL = 0.01
ROWS = 10  # fvp_subsample=5 reads rows 0 and 5 only


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _batch(vocab: int, seed: int):
    rng = random.Random(seed)
    eps = []
    for _ in range(ROWS):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 6))]
        response = [rng.randrange(4, vocab) for _ in range(rng.randint(4, 10))]
        eps.append(Episode(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                           sampling_logps=[0.0] * len(response), token_rewards=[0.0] * len(response)))
    return build_batch(eps, 0, "cpu")


@torch.no_grad()
def _log_softmax_all(model, batch) -> torch.Tensor:
    """log pi(. | y_<t) over the vocabulary at every position that predicts a response token: [N, L-1, V]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return torch.log_softmax(logits[:, :-1].double(), -1)


def _kl_over_the_batch(old: torch.Tensor, new: torch.Tensor, batch) -> float:
    """mean over every response token of every row of sum_v pi_old,v (log pi_old,v - log pi_new,v)."""
    mask = batch.response_mask[:, 1:].double()  # position t predicts token t + 1
    kl = (old.exp() * (old - new)).sum(-1)
    return float((kl * mask).sum() / mask.sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_accepted_step_keeps_the_kl_over_every_row_within_max_kl_and_logs_it(tiny_model_dir, seed):
    torch.manual_seed(seed)
    model = load_causal_lm(str(tiny_model_dir))
    batch = _batch(model.config.vocab_size, seed)
    advantages = torch.randn(batch.size, 1).expand_as(batch.response_mask) * batch.response_mask
    old = _log_softmax_all(model, batch)
    # a small damping trusts the curvature of the 2-row subsample: its step overshoots elsewhere
    stats = trpo_update(model, trainable_parameters(model), batch, advantages, None, temperature=1.0, max_kl=MAX_KL,
                        damping=0.01, cg_iters=10, backtrack_ratio=0.8, max_backtracks=10, fvp_subsample=5).reduce()
    kl = _kl_over_the_batch(old, _log_softmax_all(model, batch), batch)
    assert stats["trpo/accepted"] == 1.0, stats  # the step happened: the check below is not vacuous
    assert 0 < kl <= MAX_KL * 1.05
    assert stats["trpo/kl"] == pytest.approx(kl, rel=1e-3)
