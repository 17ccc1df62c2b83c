"""Learned-reward scoring: the reward model reads the last real token whatever the padding,
the verifier's score is P("Yes") at the answer position, and the kind is detected."""

from __future__ import annotations

import pytest
import torch

from relign.models.reward import (
    RewardModelScorer,
    VerifierScorer,
    load_reward_model,
    load_scorer,
    scorer_kind,
    sequence_rewards,
    verifier_messages,
)


def test_sequence_reward_reads_the_last_non_pad_token(tiny_model_dir, tokenizer):
    model = load_reward_model(str(tiny_model_dir), pad_token_id=tokenizer.pad_token_id).eval()
    assert torch.count_nonzero(model.score.weight) == 0  # a fresh head starts at zero: r = 0
    torch.nn.init.normal_(model.score.weight, std=0.5)
    rows = [[5, 6, 7, 8, 9], [10, 11, 12]]
    # pad with the EOS id on purpose: the last token is found from the mask, not from the pad id
    ids = torch.full((2, 5), tokenizer.eos_token_id)
    mask = torch.zeros(2, 5, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        batched = sequence_rewards(model, ids, mask)
        alone = torch.cat([sequence_rewards(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long)) for r in rows])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_verifier_score_is_p_yes(tiny_model_dir, tokenizer):
    scorer = VerifierScorer(str(tiny_model_dir), batch_size=2)
    problems, solutions = ["What is 1 + 2?", "Name a colour that is a long word"], ["3", "turquoise, probably"]
    got = scorer.score(problems, solutions)
    for p, s, g in zip(problems, solutions, got):  # one at a time, no padding: softmax at the last position
        text = tokenizer.apply_chat_template(verifier_messages(p, s), tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            probs = torch.softmax(scorer.model(input_ids=ids).logits[0, -1], -1)
        assert g == pytest.approx(probs[tokenizer("Yes", add_special_tokens=False)["input_ids"][0]].item(), abs=1e-6)
        assert 0.0 < g < 1.0


def test_scorer_kind_detection(tiny_model_dir, tmp_path):
    assert scorer_kind(str(tiny_model_dir)) == "verifier"
    assert isinstance(load_scorer(str(tiny_model_dir)), VerifierScorer)
    rm_dir = tmp_path / "rm"
    load_reward_model(str(tiny_model_dir)).save_pretrained(rm_dir)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)
    assert scorer_kind(str(rm_dir)) == "rm"
    scorer = load_scorer(str(rm_dir))
    assert isinstance(scorer, RewardModelScorer)
    assert scorer.score(["q", "q"], ["a", "b b"]) == [0.0, 0.0]  # the zero head of a new RM
    with pytest.raises(FileNotFoundError):
        scorer_kind(str(tmp_path / "missing"))
