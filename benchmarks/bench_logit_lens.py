"""Benchmark NormXLogit and Grad-ELLM on SmolLM2-135M (CPU, float32).

    python -m benchmarks.bench_logit_lens [--lengths 128 512] [--reps 3] [--probe-batches 1 2 4]

Reports, measured in one run:

1. Time ratios at every sequence length T (batch of one prompt of exactly T tokens):
   NormXLogit over all 30 layers ÷ one forward pass (``model(tokens)``, full logits; goal ≤ 1.10),
   with the default target (the prediction: residuals are kept until the label is known) and a
   given token (every layer reduced in its hook); Grad-ELLM (last layer, and last 4) ÷
   grad_x_input (goal ≤ 1.0). The methods run in interleaved rounds (one call of each per round) so
   that load from other processes hits all of them alike; each time is the minimum over rounds.
2. The largest batch NormXLogit runs at T = 512 within 8 GB (8·10⁹ bytes). Each probe batch size
   runs in a fresh subprocess: load the model, reset the kernel's peak-RSS counter
   (``/proc/self/clear_refs`` ← 5), run NormXLogit once, read the peak RSS (``VmHWM``). A least
   squares line ``peak(B) = a + b·B`` through the probes (a = weights + runtime, b = memory per
   item) gives ``B_max = floor((8·10⁹ − a) / b)`` for the whole process (weights included).

Prints a markdown table and writes ``results/bench_logit_lens.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GOAL_BYTES = 8 * 10**9
TEXT = (
    "The keys to the old wooden cabinet in the hallway of my grandmother's house were lost "
    "last summer, and nobody in the family has been able to find them since then. "
)


def load() -> Any:
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("smollm2-135m")


def tokens_of_length(model: Any, length: int, batch: int = 1) -> torch.Tensor:
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    row = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor([row] * batch, dtype=torch.long)


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{key}:\s+(\d+) kB", text)
    if match is None:
        raise RuntimeError(f"{key} not in /proc/self/status")
    return int(match.group(1)) * 1024


def probe(batch: int, length: int, mode: str) -> dict[str, Any]:
    """Peak resident memory of one NormXLogit call (run in a fresh process)."""
    from lens_attrib import Target
    from lens_attrib.methods.registry import attribute

    model = load()
    tokens = tokens_of_length(model, length, batch)
    target = Target(token=" found") if mode == "token" else None
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    with torch.inference_mode():
        attribute(model, tokens, target, method="normxlogit")
    peak = _status("VmHWM")
    return {"batch": batch, "length": length, "mode": mode, "baseline": baseline, "peak": peak}


def run_probe(batch: int, length: int, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_logit_lens", "--probe", str(batch)]
    cmd += ["--probe-length", str(length), "--probe-mode", mode]
    cmd += ["--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ))
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def fit_max_batch(probes: list[dict[str, Any]]) -> dict[str, Any]:
    xs = torch.tensor([float(p["batch"]) for p in probes], dtype=torch.float64)
    ys = torch.tensor([float(p["peak"]) for p in probes], dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], dim=1)
    a, b = torch.linalg.lstsq(design, ys[:, None]).solution[:, 0].tolist()
    residual = float((design @ torch.tensor([a, b], dtype=torch.float64) - ys).abs().max())
    return {
        "intercept_bytes": a,
        "bytes_per_item": b,
        "max_fit_residual_bytes": residual,
        "max_batch": int((GOAL_BYTES - a) // b),
        "probes": probes,
    }


def time_round_robin(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: min(ts) for name, ts in times.items()}


def timings(model: Any, length: int, reps: int) -> dict[str, float]:
    from lens_attrib import Target
    from lens_attrib.methods.registry import attribute

    tokens = tokens_of_length(model, length)
    given = Target(token=" found")

    def inference(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode():
                return fn()

        return run

    fns: dict[str, Callable[[], Any]] = {
        "forward": inference(lambda: model(tokens)),
        "normxlogit": inference(lambda: attribute(model, tokens, method="normxlogit")),
        "normxlogit_token": inference(lambda: attribute(model, tokens, given, method="normxlogit")),
        "grad_x_input": lambda: attribute(model, tokens, method="grad_x_input"),
        "grad_ellm": lambda: attribute(model, tokens, method="grad_ellm"),
        "grad_ellm_4": lambda: attribute(model, tokens, method="grad_ellm", n_layers=4),
    }
    return time_round_robin(fns, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--probe-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--memory-length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a busy host)")
    parser.add_argument("--out", default="results/bench_logit_lens.json")
    parser.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-length", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--probe-mode", default="prediction", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe is not None:
        print(json.dumps(probe(args.probe, args.probe_length, args.probe_mode)))
        return

    model = load()
    timings(model, 16, 1)  # warm-up
    per_length: dict[int, dict[str, Any]] = {}
    for length in args.lengths:
        t = timings(model, length, args.reps)
        per_length[length] = {
            "seconds": t,
            "normxlogit_over_forward": t["normxlogit"] / t["forward"],
            "normxlogit_token_over_forward": t["normxlogit_token"] / t["forward"],
            "grad_ellm_over_grad_x_input": t["grad_ellm"] / t["grad_x_input"],
            "grad_ellm_4_over_grad_x_input": t["grad_ellm_4"] / t["grad_x_input"],
        }
    memory = {
        mode: fit_max_batch([run_probe(b, args.memory_length, mode) for b in args.probe_batches])
        for mode in ("prediction", "token")
    }
    result = {
        "model": "smollm2-135m",
        "device": "cpu",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "lengths": per_length,
        "memory_length": args.memory_length,
        "memory": memory,
        "memory_goal_bytes": GOAL_BYTES,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    rows = [
        "| T | forward s | NormXLogit ÷ forward (pred / token; goal ≤ 1.10) | "
        "Grad-ELLM ÷ grad_x_input (1 / 4 layers; goal ≤ 1.0) |",
        "|---|---|---|---|",
    ]
    for length, r in per_length.items():
        rows.append(
            f"| {length} | {r['seconds']['forward']:.3f} | "
            f"{r['normxlogit_over_forward']:.2f} / {r['normxlogit_token_over_forward']:.2f} | "
            f"{r['grad_ellm_over_grad_x_input']:.2f} / {r['grad_ellm_4_over_grad_x_input']:.2f} |"
        )
    rows += [
        "",
        f"| NormXLogit at T={args.memory_length}, target | MB per item | intercept MB | "
        "max batch ≤ 8 GB |",
        "|---|---|---|---|",
    ]
    for mode, m in memory.items():
        rows.append(
            f"| {mode} | {m['bytes_per_item'] / 1e6:.1f} | {m['intercept_bytes'] / 1e6:.0f} | "
            f"{m['max_batch']} |"
        )
    print("\n".join(rows))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
