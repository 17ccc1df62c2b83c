"""Karmarkar–Karp partitions and the micro-batch plan built on them (relign.data.balance)."""

from __future__ import annotations

import math
import random

import pytest

from relign.data.balance import karmarkar_karp, micro_batch_plan


def _sums(sizes, bins):
    return [sum(sizes[i] for i in b) for b in bins]


def _random_sizes(rng: random.Random, n: int) -> list[int]:
    """Token-count-like sizes: mostly short, some long, the odd zero."""
    kind = rng.random()
    if kind < 0.3:
        return [rng.randint(1, 20) for _ in range(n)]
    if kind < 0.6:
        return [rng.randint(1, 4000) for _ in range(n)]
    if kind < 0.9:  # heavy tail: a few very long sequences among short ones
        return [int(rng.paretovariate(1.2) * 30) for _ in range(n)]
    return [rng.choice([0, 0, 1, 7, 50]) for _ in range(n)]


# --------------------------------------------------------------------------- karmarkar_karp by hand


def test_two_bins_by_hand():
    # Partial partitions are [sums desc] with the item's bins; the two with the largest spread
    # (ties: lower item index / creation order first) are joined largest-with-smallest.
    #   start: P0 = {8 | -}, P1 = {7 | -}, P2 = {6 | -}, P3 = {5 | -}, P4 = {4 | -}
    #   join P0 (spread 8), P1 (7):  [8 + 0, 0 + 7] -> {0: 8 | 1: 7}          spread 1   (P5)
    #   join P2 (6), P3 (5):         [6 + 0, 0 + 5] -> {2: 6 | 3: 5}          spread 1   (P6)
    #   join P4 (4), P5 (1):         [4 + 7, 0 + 8] -> {4,1: 11 | 0: 8}       spread 3   (P7)
    #   join P7 (3), P6 (1):         [11 + 5, 8 + 6] -> {4,1,3: 16 | 0,2: 14}  spread 2
    # (the optimum is 15/15; KK's spread 2 is within its bound max(sizes) = 8)
    sizes = [8, 7, 6, 5, 4]
    bins = karmarkar_karp(sizes, 2)
    assert bins == [[1, 3, 4], [0, 2]]
    assert _sums(sizes, bins) == [16, 14]


def test_three_bins_by_hand():
    #   join P0 = {8|-|-} (spread 8), P1 = {7|-|-} (7):
    #        [8 + 0, 0 + 0, 0 + 7] -> sorted {0: 8 | 1: 7 | -: 0}           spread 8   (P5)
    #   join P5 (8), P2 = {6|-|-} (6): a desc + b asc
    #        [8 + 0, 7 + 0, 0 + 6] -> {0: 8 | 1: 7 | 2: 6}                   spread 2   (P6)
    #   join P3 = {5|-|-} (5), P4 = {4|-|-} (4):
    #        [5 + 0, 0 + 0, 0 + 4] -> {3: 5 | 4: 4 | -: 0}                   spread 5   (P7)
    #   join P7 (5), P6 (2):
    #        [5 + 6, 4 + 7, 0 + 8] -> {2,3: 11 | 1,4: 11 | 0: 8}             spread 3
    #   the two 11s are ordered by their smallest index: {1,4} before {2,3}
    sizes = [8, 7, 6, 5, 4]
    bins = karmarkar_karp(sizes, 3)
    assert bins == [[1, 4], [2, 3], [0]]
    assert _sums(sizes, bins) == [11, 11, 8]


def test_equal_sizes_by_hand():
    #   join P0, P1 (spread 4, 4): {0: 4 | 1: 4}  spread 0   (P4)
    #   join P2, P3:               {2: 4 | 3: 4}  spread 0   (P5)
    #   join P4, P5: [4 + 4, 4 + 4] -> {0,3 | 1,2}
    assert karmarkar_karp([4, 4, 4, 4], 2) == [[0, 3], [1, 2]]


# --------------------------------------------------------------------------- karmarkar_karp properties


def test_k1_gives_everything_in_order():
    assert karmarkar_karp([3, 1, 2], 1) == [[0, 1, 2]]
    assert karmarkar_karp([], 1) == [[]]


def test_fewer_items_than_bins_leaves_empty_bins():
    # join P1 = {9|-|-|-} (spread 9) and P0 = {5|-|-|-}: [9 + 0, 0, 0, 0 + 5], sorted by sum
    assert karmarkar_karp([5, 9], 4) == [[1], [0], [], []]
    assert karmarkar_karp([], 3) == [[], [], []]


def test_zero_size_items_are_placed():
    sizes = [0, 5, 0, 3, 0]
    bins = karmarkar_karp(sizes, 2)
    assert sorted(i for b in bins for i in b) == list(range(5))
    assert sorted(_sums(sizes, bins)) == [3, 5]  # the zeros go anywhere, 5 and 3 apart
    assert sorted(i for b in karmarkar_karp([0, 0, 0], 2) for i in b) == [0, 1, 2]


def test_deterministic_and_sorted():
    rng = random.Random(7)
    sizes = [rng.randint(1, 50) for _ in range(40)]
    a = karmarkar_karp(sizes, 5)
    b = karmarkar_karp(list(sizes), 5)
    assert a == b
    assert all(bin_ == sorted(bin_) for bin_ in a)


@pytest.mark.parametrize("k", [0, -1])
def test_bad_k_raises(k):
    with pytest.raises(ValueError):
        karmarkar_karp([1, 2, 3], k)
    with pytest.raises(ValueError):
        micro_batch_plan([1, 2, 3], ranks=k)


def test_negative_size_raises():
    with pytest.raises(ValueError):
        karmarkar_karp([3, -1, 2], 2)
    with pytest.raises(ValueError):
        karmarkar_karp([3, -1, 2], 1)


def test_karmarkar_karp_bound_on_random_lists():
    """spread (max - min bin sum) <= max item, so the largest bin <= ceil(total / k) + max item;
    every index exactly once, bins sorted."""
    cases = 0
    for seed in range(300):
        rng = random.Random(seed)
        k = rng.randint(2, 8)
        n = rng.randint(1, 100)
        sizes = _random_sizes(rng, n)
        bins = karmarkar_karp(sizes, k)
        assert len(bins) == k
        assert sorted(i for b in bins for i in b) == list(range(n)), seed
        assert all(b == sorted(b) for b in bins)
        sums = _sums(sizes, bins)
        assert max(sums) - min(sums) <= max(sizes), (seed, k, sizes, sums)
        assert max(sums) <= math.ceil(sum(sizes) / k) + max(sizes), (seed, k, sizes, sums)
        if n <= k and min(sizes) > 0:  # at most one item per bin
            assert all(len(b) <= 1 for b in bins)
        cases += 1
    assert cases == 300


# --------------------------------------------------------------------------- micro_batch_plan by hand


def test_plan_by_hand():
    # one rank, 16 tokens, budget 8: need = ceil(16 / 8) = 2 micro-batches; KK([4, 4, 4, 4], 2)
    # is {0,3 | 1,2} (test_equal_sizes_by_hand), both at 8 <= 8
    assert micro_batch_plan([4, 4, 4, 4], max_tokens=8) == [[[0, 3], [1, 2]]]
    # budget 10 for [5, 5, 5]: ceil(15 / 10) = 2, KK gives {1,2: 10 | 0: 5}, 10 fits
    assert micro_batch_plan([5, 5, 5], max_tokens=10) == [[[1, 2], [0]]]
    # budget 9: the same split has a bin of 10 > 9, so one more micro-batch: one item each
    assert micro_batch_plan([5, 5, 5], max_tokens=9) == [[[0], [1], [2]]]
    # two ranks, no budget: KK's two bins (test_two_bins_by_hand), one micro-batch each
    assert micro_batch_plan([8, 7, 6, 5, 4], ranks=2) == [[[1, 3, 4]], [[0, 2]]]
    # max_items only: 5 items, at most 2 per micro-batch -> at least ceil(5 / 2) = 3
    p = micro_batch_plan([1, 1, 1, 1, 1], max_items=2)
    assert len(p[0]) == 3 and sorted(len(m) for m in p[0]) == [1, 2, 2]


def test_item_over_budget_goes_alone():
    sizes = [3, 50, 4, 2, 5]
    (rank,) = micro_batch_plan(sizes, max_tokens=10)
    assert [1] in rank
    for mb in rank:
        assert len(mb) == 1 or sum(sizes[i] for i in mb) <= 10


def test_more_ranks_than_items():
    sizes = [3, 9]
    p = micro_batch_plan(sizes, ranks=5, max_tokens=12)
    assert len(p) == 5
    assert {len(r) for r in p} == {1}  # the same number of passes everywhere
    got = sorted(i for r in p for mb in r for i in mb)
    assert got == [0, 1]
    assert sum(1 for r in p if r == [[]]) == 3  # three ranks run one empty (zero-weight) pass


def test_empty_input():
    assert micro_batch_plan([], ranks=2, max_tokens=8) == [[[]], [[]]]


# --------------------------------------------------------------------------- micro_batch_plan properties


def _check_plan(sizes, ranks, max_tokens, max_items):
    p = micro_batch_plan(sizes, ranks=ranks, max_tokens=max_tokens, max_items=max_items)
    ctx = (sizes, ranks, max_tokens, max_items)
    assert len(p) == ranks, ctx
    assert len({len(r) for r in p}) == 1, ctx  # every rank runs the same number of passes
    assert sorted(i for r in p for mb in r for i in mb) == list(range(len(sizes))), ctx
    for r in p:
        for mb in r:
            if len(mb) > 1:
                if max_tokens:
                    assert sum(sizes[i] for i in mb) <= max_tokens, ctx
                if max_items:
                    assert len(mb) <= max_items, ctx
            if len(mb) > 1 and max_tokens:
                assert all(sizes[i] <= max_tokens for i in mb), ctx  # an item over budget is alone
    rank_tokens = [sum(sizes[i] for mb in r for i in mb) for r in p]
    if sizes:
        assert max(rank_tokens) - min(rank_tokens) <= max(sizes), ctx
    return p


def test_micro_batch_plan_properties_on_random_inputs():
    for seed in range(150):
        rng = random.Random(1000 + seed)
        n = rng.randint(1, 60)
        sizes = [rng.randint(1, 300) for _ in range(n)]  # real items have at least one token
        ranks = rng.randint(1, 8)
        max_tokens = rng.choice([0, 1, 50, 200, 400, 2000])
        max_items = rng.choice([0, 0, 1, 2, 5])
        p = _check_plan(sizes, ranks, max_tokens, max_items)
        if max_tokens == 0 and max_items == 0:
            assert all(len(r) == 1 for r in p)  # no limit: one pass per rank
        if max_tokens:  # no fewer passes than the busiest rank's tokens need, nor more than its items
            per_rank = [sum(sizes[i] for mb in r for i in mb) for r in p]
            most = max(sum(len(mb) for mb in r) for r in p)
            assert min(math.ceil(max(per_rank) / max_tokens), most) <= len(p[0]) <= max(1, most)


def test_max_items_respected_with_many_ranks():
    sizes = [10, 1, 1, 1, 1, 1, 1, 1, 1, 10]
    for ranks in (1, 2, 3):
        for max_items in (1, 2, 3):
            _check_plan(sizes, ranks, 0, max_items)
            _check_plan(sizes, ranks, 12, max_items)


def test_max_items_respected_with_zero_size_items():
    # Karmarkar–Karp can put two zero-size items in one bin even with a bin per item
    _check_plan([0, 0, 0], 1, 0, 1)


def test_over_budget_item_costs_one_pass():
    # one rank, one 9-token item, budget 4: one pass suffices (not ceil(9 / 4) = 3, two empty)
    assert micro_batch_plan([9], max_tokens=4) == [[[0]]]
    # [20, 1, 1] with budget 4: at most 3 passes (one per item), not ceil(22 / 4) = 6
    assert len(micro_batch_plan([20, 1, 1], max_tokens=4)[0]) <= 3
