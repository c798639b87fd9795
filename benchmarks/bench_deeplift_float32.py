"""Benchmark DeepLIFT's float64 Rescale multipliers against the float32 secant they replaced.

    python -m benchmarks.bench_deeplift_float32 [--n 6] [--reps 3]

Models: SmolLM2-135M with the built-in ``smollm2-135m-sst2`` classifier's head (trained on first
use, else read from the cache), and MiniLM-L6 with a random pooler-and-classifier head
(``Linear–Tanh–Linear`` on the first position, seed 0). Items: the first ``--n`` SST-2 validation
sentences, one batch, one thread. Each model is loaded in float32 and float64 (the same
weights).

Two numbers per model, both taken in this one run:

- **departure**: ``max |s32 − s64| / max |s64|`` over the items, of Gradient×Input and of float32
  DeepLIFT with either multiplier (the float64 one is the library's; the float32 secant is
  ``(φ(h) − φ(h₀))/(h − h₀)`` in the model's dtype, restored here by patching the rule);
- **CPU seconds per batch** of float32 DeepLIFT with either multiplier (median of ``--reps``
  interleaved rounds), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

import lens_attrib.hooks.deeplift as rescale_patches
from lens_attrib.hooks import rules


def float32_rescale(act: Callable[[Tensor], Tensor], h: Tensor, h0: Tensor, eps: float) -> Tensor:
    """The multiplier as it was: the secant in the model's dtype."""
    with torch.no_grad():
        dh = h - h0
        secant = rules.safe_ratio(act(h) - act(h0), dh)
        return torch.where(dh.abs() < eps, rules.derivative(act, h), secant)


def float32_hooked(
    act: Callable[[Tensor], Tensor], h: Tensor, h0: Tensor, a: Tensor, a0: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        dh = h - h0
        exact = dh.abs() >= eps
        return torch.where(exact, rules.safe_ratio(a - a0, dh), 0.0), exact


@contextmanager
def float32_secant() -> Iterator[None]:
    saved = rescale_patches.rescale_multiplier, rescale_patches.hooked_secant
    rescale_patches.rescale_multiplier = float32_rescale  # type: ignore[assignment]
    rescale_patches.hooked_secant = float32_hooked  # type: ignore[assignment]
    try:
        yield
    finally:
        rescale_patches.rescale_multiplier, rescale_patches.hooked_secant = saved


def departure(a32: Any, a64: Any) -> float:
    return max(
        float((s32.double() - s64).abs().max() / s64.abs().max())
        for s32, s64 in zip(a32.scores, a64.scores)
    )


def random_head(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(384, 384), nn.Tanh(), nn.Linear(384, 2)).to(dtype)


def models(name: str) -> tuple[Any, Any, Any, Any, str]:
    """float32 and float64 models and targets, and a description."""
    from lens_attrib import Target, load_model

    if name == "minilm-l6":
        m32, m64 = (load_model(name, dtype=d) for d in (torch.float32, torch.float64))
        t32, t64 = (
            Target(token=1, head=random_head(d), position=0) for d in (torch.float32, torch.float64)
        )
        return m32, m64, t32, t64, "MiniLM-L6, random Linear–Tanh–Linear head"
    from lens_attrib.classifiers import load_classifier

    m32, m64 = (load_model(name, dtype=d) for d in (torch.float32, torch.float64))
    c32 = load_classifier("smollm2-135m-sst2", model=m32)
    c64 = load_classifier("smollm2-135m-sst2", model=m64)
    return m32, m64, c32.target(), c64.target(), "SmolLM2-135M, the SST-2 classifier's head"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lens_attrib import attribute
    from lens_attrib.data import load_sst2

    texts = [item.prompt for item in load_sst2("validation", n=args.n, seed=0)]
    print("| model | G×I | DeepLIFT, float32 secant | DeepLIFT, float64 | CPU-s float32 secant "
          "| CPU-s float64 | ratio |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name in ("smollm2-135m", "minilm-l6"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m32, m64, t32, t64, what = models(name)

            def call(model: Any, target: Any, method: str = "deeplift") -> Any:
                return attribute(model, texts, target, method=method)

            gxi = departure(call(m32, t32, "grad_x_input"), call(m64, t64, "grad_x_input"))
            ref = call(m64, t64)
            new = departure(call(m32, t32), ref)
            with float32_secant():
                old = departure(call(m32, t32), ref)
            seconds: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.reps):
                for key in ("old", "new"):
                    start = time.process_time()
                    if key == "old":
                        with float32_secant():
                            call(m32, t32)
                    else:
                        call(m32, t32)
                    seconds[key].append(time.process_time() - start)
        s_old, s_new = (statistics.median(seconds[k]) for k in ("old", "new"))
        print(
            f"| {what} | {gxi:.1e} | {old:.1e} | {new:.1e} | {s_old:.2f} | {s_new:.2f} "
            f"| {s_new / s_old:.2f} |"
        )


if __name__ == "__main__":
    main()
