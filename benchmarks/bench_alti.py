"""ALTI-Logit cost on SmolLM2-135M: wall time ÷ one forward, peak memory ÷ ``run_with_cache``.

Run: ``python -m benchmarks.bench_alti [--lengths 64 128 256 512] [--out results/bench_alti.json]``.

Every measurement runs in its own subprocess (``--worker KIND T``) so that peak memory is not
polluted by earlier ones. Memory: after loading the model and a short warm-up, the worker resets
the kernel's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``) and records VmRSS;
after the measured call it reads VmHWM. ``peak_delta`` = VmHWM − VmRSS before the call (the
memory the call itself needed); ``peak_total`` = VmHWM (model weights included). Where
``clear_refs`` is unavailable, ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is used instead
(then the peak may be the model load's). Goals: time ratio ≤ 20×, memory ratio ≤ 2×.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

TEXT = (
    "The keys to the old cabinet in the hallway were lost last winter, and nobody in the house "
    "remembered where the spare set had been kept. "
)
KINDS = ("forward", "run_with_cache", "alti_logit")


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(kind: str, length: int) -> dict[str, Any]:
    import torch

    from lens_attrib.methods.alti import alti_logit
    from lens_attrib.models import load_model

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m")
    ids = model.tokenizer(TEXT * (1 + length // 20))["input_ids"][:length]
    tokens = torch.tensor([ids])
    assert tokens.shape[1] == length

    def call(toks: Any) -> None:
        with torch.no_grad():
            if kind == "forward":
                model(toks)
            elif kind == "run_with_cache":
                _, cache = model.run_with_cache(toks)
                del cache
            else:
                alti_logit(model, toks)

    call(tokens[:, :8])  # warm-up (thread pools, lazy buffers)
    gc.collect()
    exact = _reset_peak()
    before = _status_kb("VmRSS") or 0
    started = time.perf_counter()
    call(tokens)
    seconds = time.perf_counter() - started
    peak = _status_kb("VmHWM") if exact else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak is None:
        peak = maxrss
    repeats = [seconds]
    if kind == "forward":  # the denominator: median of a few
        for _ in range(2):
            t0 = time.perf_counter()
            call(tokens)
            repeats.append(time.perf_counter() - t0)
    return {
        "kind": kind,
        "length": length,
        "seconds": sorted(repeats)[len(repeats) // 2],
        "peak_total_mb": peak / 1024,
        "peak_delta_mb": (peak - before) / 1024,
        "exact_peak": exact,
        "threads": torch.get_num_threads(),
    }


def measure(kind: str, length: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_alti", "--worker", kind, str(length)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--out", default="results/bench_alti.json")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "T"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    rows = []
    for length in args.lengths:
        r = {kind: measure(kind, length) for kind in KINDS}
        alti, fwd, cache = r["alti_logit"], r["forward"], r["run_with_cache"]
        rows.append(
            {
                "T": length,
                "forward_s": fwd["seconds"],
                "alti_logit_s": alti["seconds"],
                "time_ratio": alti["seconds"] / fwd["seconds"],
                "cache_peak_delta_mb": cache["peak_delta_mb"],
                "alti_peak_delta_mb": alti["peak_delta_mb"],
                "mem_ratio_delta": alti["peak_delta_mb"] / max(cache["peak_delta_mb"], 1e-9),
                "cache_peak_total_mb": cache["peak_total_mb"],
                "alti_peak_total_mb": alti["peak_total_mb"],
                "mem_ratio_total": alti["peak_total_mb"] / cache["peak_total_mb"],
                "raw": r,
            }
        )
    head = (
        "| T | forward s | ALTI-Logit s | time ratio (goal ≤ 20) | run_with_cache peak Δ MB | "
        "ALTI-Logit peak Δ MB | mem ratio Δ (goal ≤ 2) | peak total MB cache / ALTI |"
    )
    print(head)
    print("|" + "---|" * 8)
    for row in rows:
        print(
            f"| {row['T']} | {row['forward_s']:.2f} | {row['alti_logit_s']:.2f} | "
            f"{row['time_ratio']:.1f}× | {row['cache_peak_delta_mb']:.0f} | "
            f"{row['alti_peak_delta_mb']:.0f} | {row['mem_ratio_delta']:.2f}× | "
            f"{row['cache_peak_total_mb']:.0f} / {row['alti_peak_total_mb']:.0f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "load_avg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
