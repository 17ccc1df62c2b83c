"""RuleReader: the stated forms, TriviaQA normalization, aliases, "No Answer", bad confidences."""

from __future__ import annotations

import time

import pytest

from relign.envs.reader_rules import RuleReader, answers_match, normalize_answer, parse_statements

BINARY = "Room: red. Which box holds the coin, left or right?"


def test_normalize_answer_like_triviaqa():
    assert normalize_answer("The Beatles!") == "beatles"
    assert normalize_answer("  an   Apple_Pie. ") == "apple pie"
    assert normalize_answer("A") == "a"  # an answer that is only an article keeps it
    assert answers_match("the beatles", ["Beatles", "The Fab Four"])
    assert answers_match("FAB FOUR", ["Beatles", "The Fab Four"])
    assert not answers_match("Rolling Stones", "The Beatles")


@pytest.mark.parametrize("paragraph, expected", [
    ("I think it is Paris with 60% likelihood, Lyon with 40%.", [("Paris", 0.6), ("Lyon", 0.4)]),
    ("I estimate 70% that the capital is Paris; 30% that it is Lyon.", [("Paris", 0.7), ("Lyon", 0.3)]),
    ("I estimate 50% Shorwell, 50% Ryde", [("Shorwell", 0.5), ("Ryde", 0.5)]),
    ("I estimate 25% Shorwell and 75% Ryde", [("Shorwell", 0.25), ("Ryde", 0.75)]),
    ("Shorwell (50%) or Ryde (50%)", [("Shorwell", 0.5), ("Ryde", 0.5)]),
    ("I am certain that it is The Beatles.", [("The Beatles", 1.0)]),
    ("The answer is Paris.", [("Paris", 1.0)]),  # unhedged: 1.0
    ("Paris", [("Paris", 1.0)]),
    ("No Answer", []),
    ("no answer.", []),
    ("Paris with 60% probability, paris with 30%", [("Paris", 0.6)]),  # first statement per answer
])
def test_stated_forms(paragraph, expected):
    stmts, bad = parse_statements("What is the capital of France?", paragraph)
    assert bad == 0
    assert [a for a, _ in stmts] == [a for a, _ in expected]
    assert [p for _, p in stmts] == pytest.approx([p for _, p in expected])


def test_binary_confidence_token():
    # conf: N on a two-option question: the first option with N/10, the second with the rest
    stmts, _ = parse_statements(BINARY, "conf: 7")
    assert stmts[0] == ("left", 0.7) and stmts[1][0] == "right" and stmts[1][1] == pytest.approx(0.3)
    assert parse_statements(BINARY, "conf: 40%")[0][0] == ("left", 0.4)
    assert parse_statements(BINARY, "conf: 10")[0] == [("left", 1.0), ("right", 0.0)]
    # the same statement on a question without two options states nothing
    assert parse_statements("Where is the coin?", "conf: 7") == ([], 0)


@pytest.mark.parametrize("paragraph", ["conf: 12", "conf: seven", "conf: -1", "conf: 3.5", "Paris with 140% likelihood",
                                       "Paris with x% likelihood"])
def test_confidence_outside_0_1_or_not_a_number_is_counted_and_dropped(paragraph):
    stmts, bad = parse_statements(BINARY, paragraph)
    assert stmts == [] and bad == 1


def test_reader_protocol_extract_and_forecast_with_aliases_case_and_articles():
    r = RuleReader()
    qs = ["Who sang Help?"] * 3
    zs = ["I think it is the beatles with 80% likelihood, The Rolling Stones with 20%.", "No Answer", "conf: 12"]
    assert r.extract(qs, zs) == [["the beatles", "The Rolling Stones"], [], []]
    gold = ["Beatles", "The Fab Four"]
    assert r.forecast(qs, zs, [gold, gold, gold]) == pytest.approx([0.8, 0.0, 0.0])
    assert r.forecast(qs[:1], zs[:1], ["ROLLING STONES"]) == pytest.approx([0.2])
    assert r.bad == 2  # "conf: 12" read by extract and by forecast


def test_hostile_paragraph_is_cheap():
    t0 = time.perf_counter()
    parse_statements(BINARY, "x " * 200_000 + "with 5%")
    assert time.perf_counter() - t0 < 2.0
