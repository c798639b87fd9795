"""Prefix chunks against the one-forward path for explaining a continuation (SmolLM2, CPU).

``OMP_NUM_THREADS=1 python -m benchmarks.bench_prefix_chunks [--cases 64+32 64+12 16+8]
[--reps 3]``

In one process, alternating the order each round: Saliency on the one-forward path and with 4
prefix chunks (:data:`lens_attrib.methods.prefix_chunks.STEP_GRADIENT_CHUNKS`), and Integrated
Gradients (``n_steps=2``) with 2, 4 and 8 chunks (:data:`~lens_attrib.methods.prefix_chunks.
PREFIX_CHUNKS`), for a random-id prompt of P tokens and a forced continuation of S tokens.
Prints each setting's median seconds and the ratios that decide the defaults.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

import lens_attrib.methods.prefix_chunks as prefix_chunks
from lens_attrib import Target, attribute, show_progress
from lens_attrib.models import load_model


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(model, prompt_len: int, steps: int, reps: int, seed: int = 0) -> dict[str, float]:
    """Median seconds per setting (``gradient/1`` one forward, ``gradient/4`` chunks,
    ``ig/K`` IG with K chunks)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 40_000, (prompt_len,), generator=gen)
    cont = torch.randint(100, 40_000, (steps,), generator=gen).tolist()
    target = Target(continuation=cont)
    saved = prefix_chunks.PREFIX_CHUNKS, prefix_chunks.STEP_GRADIENT_CHUNKS
    times: dict[str, list[float]] = {}

    def run(label: str, method: str, chunks: int, step_chunks: bool, **options) -> None:
        prefix_chunks.PREFIX_CHUNKS, prefix_chunks.STEP_GRADIENT_CHUNKS = chunks, step_chunks
        seconds = _seconds(lambda: attribute(model, prompt, target, method=method, **options))
        times.setdefault(label, []).append(seconds)

    try:
        for rep in range(reps):
            saliency = [("gradient/1", 1, False), ("gradient/4", 4, True)]
            ig = [2, 4, 8]
            if rep % 2:
                saliency.reverse()
                ig.reverse()
            for label, chunks, step_chunks in saliency:
                run(label, "gradient", chunks, step_chunks)
            for chunks in ig:
                run(f"ig/{chunks}", "integrated_gradients", chunks, False, n_steps=2)
    finally:
        prefix_chunks.PREFIX_CHUNKS, prefix_chunks.STEP_GRADIENT_CHUNKS = saved
    return {label: statistics.median(values) for label, values in times.items()}


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=["64+32", "64+12", "16+8"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m")
    rows = []
    with show_progress(False):
        attribute(model, torch.tensor([5, 6, 7]), Target(continuation=[8, 9]), method="gradient")
        for case in args.cases:
            prompt_len, steps = (int(x) for x in case.split("+"))
            med = measure(model, prompt_len, steps, args.reps)
            rows.append({"case": case, **med})
            print(
                f"{case}: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in med.items())
                + f" | saliency chunks ÷ one {med['gradient/4'] / med['gradient/1']:.2f}"
                + f" | IG 2÷4 {med['ig/2'] / med['ig/4']:.2f}, 8÷4 {med['ig/8'] / med['ig/4']:.2f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
