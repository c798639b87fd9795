"""Benchmark Integrated Gradients with a norm pooling beside its signed sum, as a table holds both.

    python -m benchmarks.bench_ig_pooling [--n 4] [--batch-size 4] [--pooling l1]

Items: the first ``--n`` SST-2 validation sentences (the faithfulness experiment's draw, seed 0,
at most 128 tokens), explained for the built-in ``smollm2-135m-sst2`` classifier's predicted
class (trained on first use, else read from the cache), float32, one thread, ``--batch-size``
items per call (the AOPC run's batch). IG at its defaults (adaptive panels to a 1 % gap).

Ways to get both the signed scores and the ``--pooling`` ones, CPU seconds per item:

- ``separate, final pass``: two calls, ``pooling="sum"`` then the pooled one, which repeats the
  adaptive rounds and takes the vectors in one more pass over the final nodes (before),
- ``one call, final pass``: the pooled call alone (its ``meta["signed_scores"]`` serve the
  signed unit), the vectors still taken in a pass over the final nodes,
- ``one call, kept``: the pooled call alone, each panel's vectors kept from the round that
  evaluated its nodes (the default).

Every ratio is to the ``pooling="sum"`` call measured in the same run. Also printed: the largest
relative difference of the kept signed scores from the ``"sum"`` call's, and of the kept pooled
scores from the final pass's (float32 rounding).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from typing import Any

import torch


def cpu_seconds(call: Any) -> tuple[Any, float]:
    started = time.process_time()
    out = call()
    return out, time.process_time() - started


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--pooling", default="l1", choices=["l1", "l2"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from experiments.faithfulness import truncate
    from lens_attrib import attribute
    from lens_attrib.classifiers import load_classifier
    from lens_attrib.data import load_sst2
    from lens_attrib.methods import integrated_gradients as ig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = load_classifier("smollm2-135m-sst2")
    model, target = clf.model, clf.target()
    items = load_sst2("validation", n=args.n, seed=0)
    texts = [truncate(model.tokenizer, it.prompt, 128) for it in items]
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]

    def run(options: dict[str, Any], fit: bool = True) -> tuple[list[Any], float]:
        real_fit = ig.vectors_fit
        if not fit:
            ig.vectors_fit = lambda paths, max_steps: False  # type: ignore[assignment]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = [
                    cpu_seconds(
                        lambda b=b: attribute(
                            model, b, target, method="integrated_gradients", **options
                        )
                    )
                    for b in batches
                ]
        finally:
            ig.vectors_fit = real_fit  # type: ignore[assignment]
        return [a for a, _ in out], sum(s for _, s in out) / len(texts)

    signed, t_sum = run({})
    final, t_final = run({"pooling": args.pooling}, fit=False)
    kept, t_kept = run({"pooling": args.pooling})
    rows = [
        ("pooling=sum alone", t_sum),
        ("separate, final pass", t_sum + t_final),
        ("one call, final pass", t_final),
        ("one call, kept", t_kept),
    ]
    print(f"SmolLM2-135M SST-2 classifier, {len(texts)} items, batch {args.batch_size}, "
          f"pooling={args.pooling}, float32, 1 thread")  # fmt: skip
    print("| way | CPU-s per item | ÷ pooling=sum |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} | {seconds / t_sum:.2f} |")
    signed_diff = max(rel(k.meta["signed_scores"], s.scores) for k, s in zip(kept, signed))
    pooled_diff = max(rel(k.scores, f.scores) for k, f in zip(kept, final))
    print(f"kept signed scores vs pooling=sum call: max rel. difference {signed_diff:.2e}")
    print(f"kept pooled scores vs final pass: max rel. difference {pooled_diff:.2e}")


if __name__ == "__main__":
    main()
