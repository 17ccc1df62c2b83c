"""The paper's reader with two random tiny models: an extractor sampled through relign's engine
and a forecaster read as sigma(logit). Finite, deterministic for a seed, independent of batching."""

from __future__ import annotations

import math

import pytest

from relign.models.reader import Forecaster, LMReader, ReaderScorer, parse_extraction


@pytest.fixture(scope="module")
def forecaster_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("forecaster")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def _reader(tiny_model_dir, forecaster_dir, seed):
    from transformers import AutoTokenizer

    from relign.models.loading import load_causal_lm
    from relign.recipes.build import extractor_generate
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(load_causal_lm(str(tiny_model_dir)).eval(), tok, seed=seed)
    generate = extractor_generate(engine, tok, SamplingParams(temperature=0.3, max_new_tokens=12), seed=seed)
    return LMReader(generate, Forecaster(str(forecaster_dir)))


QS = ["Who wrote Hamlet?", "What is the capital of France?", "Which planet is red?"]
ZS = ["I think it is Shakespeare with 70% likelihood.", "Paris, surely.", "No Answer"]
INFOS = [{"question": q, "answer": a, "aliases": []} for q, a in zip(QS, ["Shakespeare", "Paris", "Mars"])]


def test_lm_reader_is_finite_deterministic_and_batch_independent(tiny_model_dir, forecaster_dir):
    scorer = ReaderScorer(_reader(tiny_model_dir, forecaster_dir, seed=3))
    whole = scorer.score_detailed(QS, ZS, extra_infos=INFOS)
    assert all(math.isfinite(v) for d in whole for v in d.values())
    assert all(0.0 <= d["lc_forecast"] <= 1.0 for d in whole)
    # the same seed, a fresh reader, rows in two calls: the same rewards (each extraction is seeded by its own prompt)
    again = ReaderScorer(_reader(tiny_model_dir, forecaster_dir, seed=3))
    parts = again.score_detailed(QS[:1], ZS[:1], extra_infos=INFOS[:1]) + again.score_detailed(QS[1:], ZS[1:],
                                                                                                 extra_infos=INFOS[1:])
    assert [d["reward"] for d in parts] == pytest.approx([d["reward"] for d in whole], abs=1e-6)
    # the forecaster alone: sigma of a random head, in (0, 1); a row scores the same alone or in a batch
    f = Forecaster(str(forecaster_dir))
    a, b = f(["x", "y"]), f(["y"])
    assert 0 < a[0] < 1 and a[1] == pytest.approx(b[0], abs=1e-6)


def test_unfinished_response_gets_the_fixed_penalty(tiny_model_dir, forecaster_dir):
    scorer = ReaderScorer(_reader(tiny_model_dir, forecaster_dir, seed=0), unfinished_reward=-1.0)
    d = scorer.score_detailed(QS[:2], ZS[:2], extra_infos=INFOS[:2], finished=[False, True])
    assert d[0]["reward"] == -1.0 and d[0]["lc_unfinished"] == 1.0 and d[1]["lc_unfinished"] == 0.0


def test_parse_extraction():
    assert parse_extraction("Paris; the Paris ; Lyon") == ["Paris", "Lyon"]  # deduplicated by normalized form
    assert parse_extraction("No Answer") == []
    assert parse_extraction(" ; ;  ") is None  # nothing parsable: counted by the reader, read as no answer
    assert len(parse_extraction("; ".join(f"a{i}" for i in range(50)))) == 8


def test_missing_answer_is_one_line_naming_the_field():
    from relign.envs.reader_rules import RuleReader

    with pytest.raises(ValueError, match=r"record 1: extra_info.answer is missing"):
        ReaderScorer(RuleReader()).score_detailed(QS[:2], ZS[:2], extra_infos=[INFOS[0], {"question": "q"}])
