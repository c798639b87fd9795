"""Benchmark DeepLIFT and ReAGent against Gradient×Input on SmolLM2-135M and SST-2 sentences.

    python -m benchmarks.bench_deeplift_reagent [--n 5] [--reps 3] [--threads 1]

The first ``--n`` SST-2 validation sentences of 20–40 tokens, one sentence per call (float32, on
CUDA when available, else CPU with ``--threads`` threads), the methods in interleaved rounds (one
call of each per sentence and round, after one warm-up call) so that load from other processes
hits all of them alike. Reports the median and mean seconds per sentence, their ratios to
``grad_x_input``, ReAGent's probe steps per sentence, and one call on all sentences as a batch.
The π-Soft paper (Inseq, GPU, Llama-3.1-8B) reports 0.95 s for DeepLIFT and 17.5 s for ReAGent per
sample against 0.32 s for Grad-ELLM. Prints a markdown table and writes
``results/bench_deeplift_reagent.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_lrpx import timed

METHODS = ("grad_x_input", "deeplift", "reagent")


def sentences(model: Any, n: int) -> list[str]:
    from lens_attrib.data import load_sst2

    out = []
    for item in load_sst2("validation"):
        if 20 <= len(model.tokenizer(item.prompt)["input_ids"]) <= 40:
            out.append(item.prompt)
        if len(out) == n:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/bench_deeplift_reagent.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from lens_attrib import attribute, load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m").to(device)
        texts = sentences(model, args.n)
        attribute(model, texts[0], method="grad_x_input")  # warm-up
        seconds: dict[str, list[float]] = {m: [] for m in METHODS}
        steps = []
        for rep in range(args.reps):
            for text in texts:
                for m in METHODS:
                    seconds[m].append(
                        timed(functools.partial(attribute, model, text, method=m), device)
                    )
                if rep == 0:
                    steps.append(attribute(model, text, method="reagent").meta["probe_steps"][0])
        batch = {
            m: timed(functools.partial(attribute, model, texts, method=m), device) for m in METHODS
        }
    median = {m: statistics.median(v) for m, v in seconds.items()}
    mean = {m: statistics.mean(v) for m, v in seconds.items()}
    result = {
        "device": device,
        "threads": args.threads,
        "tokens": [len(model.tokenizer(t)["input_ids"]) for t in texts],
        "median_s": median,
        "mean_s": mean,
        "median_ratio": {m: median[m] / median["grad_x_input"] for m in METHODS},
        "mean_ratio": {m: mean[m] / mean["grad_x_input"] for m in METHODS},
        "reagent_probe_steps": steps,
        "batch_s": batch,
    }
    print("| method | median s | mean s | median ÷ GxI | mean ÷ GxI | batch of n, s |")
    print("|---|---|---|---|---|---|")
    for m in METHODS:
        print(
            f"| {m} | {median[m]:.3f} | {mean[m]:.3f} | {result['median_ratio'][m]:.2f} | "
            f"{result['mean_ratio'][m]:.2f} | {batch[m]:.2f} |"
        )
    print(f"tokens {result['tokens']}, ReAGent probe steps {steps}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
