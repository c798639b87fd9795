"""Which rows of different lengths share a forward: exact-length groups, or neighbouring lengths
padded together when the groups are tiny.

A forward of ``R`` rows padded to length ``L`` costs about ``c · (o + R · L)``: a fixed
overhead ``o`` (the ~10 kernels per layer and the Python around them, paid once per forward)
plus work per token. Rows of one length need no padding; when an evaluation has many lengths
with a few rows each (deleted-token inputs of a decoder, one length per deletion step), every
tiny forward pays ``o`` again. :func:`plan_forwards` sorts the rows by length and picks the
partition of the sorted lengths into contiguous buckets (each run as forwards of at most
``max_rows(L)`` rows padded to the bucket's longest ``L``) that minimises

    Σ_buckets  ⌈n / max_rows(L)⌉ · o  +  n · L        (token units),

by dynamic programming over the distinct lengths; the exact-length grouping is one of the
candidate partitions, so the plan never costs more than it under the model. ``o`` defaults to
:data:`FORWARD_OVERHEAD_TOKENS`. Padded rows compute the same numbers as unpadded ones up to
floating-point summation order (the backend hides padding keys and, for left-padded decoders,
shifts rotary positions back), so the plan changes only the cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

FORWARD_OVERHEAD_TOKENS = 32.0
"""Fixed cost of one forward in tokens of work, measured on SmolLM2-135M (CPU, one thread,
``time.process_time``): without gradients 1 row × 8 tokens took 114 ms, 32 × 8 779 ms (2.7 ms
per token, ~92 ms ≈ 34 tokens fixed); with the backward to the embeddings 1 × 8 took 245 ms,
4 × 8 412 ms (~200 ms ≈ 38 tokens fixed)."""


def bucket_cost(n_rows: int, length: int, cap: int, overhead: float) -> float:
    """Modelled cost of ``n_rows`` rows padded to ``length``, ``cap`` rows per forward."""
    return -(-n_rows // max(cap, 1)) * overhead + n_rows * length


def cheapest_buckets(
    counts: dict[int, int], max_rows: Callable[[int], int], overhead: float
) -> list[list[int]]:
    """The runs of the sorted distinct lengths (``counts``: rows per length) whose summed
    :func:`bucket_cost` is least (dynamic programming over the run ends, ``O(k²)``)."""
    distinct = sorted(counts)
    best = [0.0] + [float("inf")] * len(distinct)
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        rows, longest = 0, distinct[j - 1]
        cap = max_rows(longest)
        for i in range(j - 1, -1, -1):  # bucket = distinct[i:j]
            rows += counts[distinct[i]]
            cost = best[i] + bucket_cost(rows, longest, cap, overhead)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(distinct)
    while j > 0:
        buckets.append(distinct[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


def plan_forwards(
    lengths: Sequence[int],
    max_rows: Callable[[int], int],
    *,
    pad: bool = True,
    overhead: float | None = None,
) -> list[list[int]]:
    """Forwards covering the rows of ``lengths``: lists of row indices, shortest first within a
    bucket, each at most ``max_rows(L)`` rows (``L``: the bucket's longest length).
    ``pad=False``: one group per exact length (no padding); else the cheapest contiguous
    bucketing (:func:`cheapest_buckets`; ``overhead``: ``o`` in tokens, default
    :data:`FORWARD_OVERHEAD_TOKENS`)."""
    overhead = FORWARD_OVERHEAD_TOKENS if overhead is None else overhead
    by_length: dict[int, list[int]] = {}
    for r, n in enumerate(lengths):
        by_length.setdefault(int(n), []).append(r)
    if pad:
        counts = {n: len(rows) for n, rows in by_length.items()}
        buckets = cheapest_buckets(counts, max_rows, overhead)
    else:
        buckets = [[n] for n in sorted(by_length)]
    forwards: list[list[int]] = []
    for bucket in buckets:
        members = sorted((r for n in bucket for r in by_length[n]), key=lambda r: (lengths[r], r))
        cap = max(1, max_rows(bucket[-1]))
        forwards += [members[s : s + cap] for s in range(0, len(members), cap)]
    return forwards


__all__ = ["FORWARD_OVERHEAD_TOKENS", "bucket_cost", "cheapest_buckets", "plan_forwards"]
