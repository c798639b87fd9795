"""The length-bucket plan: every row once, within the row cap, and the cheapest contiguous
bucketing under its cost model (checked against every partition of the sorted lengths)."""

from __future__ import annotations

import itertools
import random

import pytest

from lens_attrib.length_buckets import bucket_cost, cheapest_buckets, plan_forwards


def _cost_of_plan(lengths, plan, overhead):
    return sum(overhead + len(f) * max(lengths[r] for r in f) for f in plan)


def _brute_force(lengths, cap, overhead):
    """The least modelled cost over every partition of the distinct lengths into runs."""
    distinct = sorted(set(lengths))
    count = {n: lengths.count(n) for n in distinct}
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(distinct) - 1):
        total, rows = 0.0, 0
        for i, n in enumerate(distinct):
            rows += count[n]
            if i == len(distinct) - 1 or cuts[i]:
                total += bucket_cost(rows, n, cap, overhead)
                rows = 0
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_the_cheapest_contiguous_bucketing(seed) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(2, 30) for _ in range(rng.randint(1, 40))]
    cap, overhead = rng.choice([1, 3, 8, 64]), rng.choice([0.0, 5.0, 32.0, 200.0])
    plan = plan_forwards(lengths, lambda n: cap, overhead=overhead)
    assert sorted(r for f in plan for r in f) == list(range(len(lengths)))
    assert all(1 <= len(f) <= cap for f in plan)
    counts = {n: lengths.count(n) for n in set(lengths)}
    buckets = cheapest_buckets(counts, lambda n: cap, overhead)
    assert [n for b in buckets for n in b] == sorted(counts)  # contiguous runs, all lengths
    modelled = sum(bucket_cost(sum(counts[n] for n in b), b[-1], cap, overhead) for b in buckets)
    assert modelled == pytest.approx(_brute_force(lengths, cap, overhead))
    # its forwards (each chunk padded to its own longest) cost at most the model's figure
    assert _cost_of_plan(lengths, plan, overhead) <= modelled + 1e-9
    exact = plan_forwards(lengths, lambda n: cap, pad=False)
    assert all(len({lengths[r] for r in f}) == 1 for f in exact)
    assert _cost_of_plan(lengths, plan, overhead) <= _cost_of_plan(lengths, exact, overhead)


def test_extremes() -> None:
    lengths = [5, 6, 5, 9, 12, 6]
    no_overhead = plan_forwards(lengths, lambda n: 100, overhead=0.0)
    assert all(len({lengths[r] for r in f}) == 1 for f in no_overhead)  # padding never pays
    one = plan_forwards(lengths, lambda n: 100, overhead=1e9)
    assert one == [[0, 2, 1, 5, 3, 4]]  # one forward, shortest first
    capped = plan_forwards(lengths, lambda n: 4, overhead=1e9)
    assert [len(f) for f in capped] == [4, 2]
    # many tiny groups of neighbouring lengths (a decoder's deletions) are merged
    tiny = [10, 11, 12, 13, 14, 15, 16, 17]
    assert len(plan_forwards(tiny, lambda n: 32, overhead=32.0)) < len(tiny)
