"""Benchmark LRP, AttnLRP and Integrated Gradients against Gradient×Input on SmolLM2-135M.

    python -m benchmarks.bench_lrpx [--lengths 32 128 512] [--reps 3] [--ig-steps 50]

Reports, measured in one run at every sequence length T (batch of one prompt of exactly T
tokens, float32, on CUDA when available, else CPU), the median time over ``--reps`` rounds; the
methods run in interleaved rounds (one call of each per round, after one warm-up round) so that
load from other processes hits all of them alike:

- ``attnlrp ÷ grad_x_input`` (goal ≤ 1.0; LXT's efficient AttnLRP measures 0.8–1.0× on this model,
  the decomposition paper's LRPx 1.6–1.9×),
- ``lrp ÷ grad_x_input`` (goal ≤ 0.85: the detached attention pattern spares the q/k backward),
- ``integrated_gradients ÷ (n_steps × grad_x_input)`` (one IG call per round).

Prints a markdown table and writes ``results/bench_lrpx.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

TEXT = (
    "The keys to the old wooden cabinet in the hallway of my grandmother's house were lost "
    "last summer, and nobody in the family has been able to find them since then. "
)


def load(device: str) -> Any:
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("smollm2-135m").to(device)


def tokens_of_length(model: Any, length: int) -> torch.Tensor:
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    row = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor([row], dtype=torch.long, device=model.cfg.device)


def timed(fn: Any, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_length(model: Any, length: int, reps: int, ig_steps: int, device: str) -> dict[str, Any]:
    from lens_attrib.methods.registry import attribute

    tokens = tokens_of_length(model, length)
    calls = {
        "grad_x_input": lambda: attribute(model, tokens, method="grad_x_input"),
        "lrp": lambda: attribute(model, tokens, method="lrp"),
        "attnlrp": lambda: attribute(model, tokens, method="attnlrp"),
        "integrated_gradients": lambda: attribute(
            model, tokens, method="integrated_gradients", n_steps=ig_steps
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    gaps: dict[str, float] = {}
    for name, fn in calls.items():  # warm-up, and the conservation facts
        a = fn()
        gap = a.meta.get("completeness_gap")
        ref = a.meta["explained_value"]
        if gap is not None:
            gaps[name] = float((gap.abs() / ref.abs()).max())
    for _ in range(reps):
        for name, fn in calls.items():
            times[name].append(timed(fn, device))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gxi = med["grad_x_input"]
    return {
        "T": length,
        "seconds": med,
        "all_seconds": times,
        "attnlrp_over_gxi": med["attnlrp"] / gxi,
        "lrp_over_gxi": med["lrp"] / gxi,
        "ig_over_steps_gxi": med["integrated_gradients"] / (ig_steps * gxi),
        "relative_gap": gaps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ig-steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="results/bench_lrpx.json")
    args = parser.parse_args(argv)
    model = load(args.device)
    rows = [bench_length(model, t, args.reps, args.ig_steps, args.device) for t in args.lengths]
    result = {
        "model": "smollm2-135m",
        "dtype": "float32",
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "reps": args.reps,
        "ig_steps": args.ig_steps,
        "goals": {"attnlrp_over_gxi": 1.0, "lrp_over_gxi": 0.85},
        "rows": rows,
    }
    lines = [
        f"SmolLM2-135M, {args.device}, float32, batch 1, median of {args.reps} rounds",
        "",
        "| T | grad_x_input s | lrp s | attnlrp s | IG s | attnlrp ÷ GxI (≤1.0) | "
        f"lrp ÷ GxI (≤0.85) | IG ÷ ({args.ig_steps}×GxI) | attnlrp gap | IG gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["seconds"]
        lines.append(
            f"| {r['T']} | {s['grad_x_input']:.3f} | {s['lrp']:.3f} | {s['attnlrp']:.3f} | "
            f"{s['integrated_gradients']:.2f} | {r['attnlrp_over_gxi']:.2f} | "
            f"{r['lrp_over_gxi']:.2f} | {r['ig_over_steps_gxi']:.2f} | "
            f"{r['relative_gap'].get('attnlrp', float('nan')):.2%} | "
            f"{r['relative_gap'].get('integrated_gradients', float('nan')):.2%} |"
        )
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
