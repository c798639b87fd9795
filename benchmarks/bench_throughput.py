"""Throughput and memory of every method against a plain forward on SmolLM2-135M.

    python -m benchmarks.bench_throughput [--lengths 64 256 512] [--methods a,b] \\
        [--batches 1 2 4 8 16] [--budget-mb 8192] [--reps 2] [--quick]

For every sequence length T (prompts of exactly T tokens, float32, CUDA when available, else
CPU) and every method (plus ``forward``: the engine's no-grad forward to the target row,
:func:`lens_attrib.forward.head_outputs`), the batch sizes of ``--batches`` are tried in order
(after one warm-up call at batch 1). At each batch it measures the median time of ``--reps``
calls and the peak *extra* memory of one call: on CUDA ``max_memory_allocated`` above the memory
allocated before; on CPU the peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) above the resident set before (freed heap handed back first). The
ladder stops at the first batch over the budget.

Reported per method and length: items/s at the best batch (the fastest tried within the
budget), the peak extra MB at batch 1, the MB per extra item (slope of the last two batches),
and the largest batch within ``--budget-mb``: measured when the ladder crossed the budget,
else extrapolated linearly from the slope (marked ``~``). The summary gives the issue's ratios:
gradient methods' largest batch ÷ the forward's, AttnLRP items/s ÷ Gradient×Input items/s, and
NormXLogit items/s ÷ forward items/s.

``--quick``: lengths 64, batches 1 2 4, forward + grad_x_input + attnlrp + normxlogit, one rep.
Prints markdown tables and writes ``results/bench_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_lrpx import timed
from lens_attrib.cli import method_list

QUICK_METHODS = ["grad_x_input", "attnlrp", "normxlogit"]
SLOW_OPTIONS: dict[str, dict[str, Any]] = {"integrated_gradients": {"n_steps": 8}}
"""Cheaper settings for the slowest methods (stated in the output)."""
TEXT = (
    "The keys to the old wooden cabinet in the hallway of my grandmother's house were lost "
    "last summer, and nobody in the family has been able to find them since then. "
)


# --------------------------------------------------------------------------- memory
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_extra_mb(fn: Callable[[], Any], device: str) -> float:
    """Peak memory of ``fn()`` above what was in use before it, in MB."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    from lens_attrib.models import return_freed_memory

    return_freed_memory()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - before) / 1024


# --------------------------------------------------------------------------- workloads
def prompts(model: Any, length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` rows of exactly ``length`` token ids (BOS + text repeated) and their mask."""
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    row = [model.tokenizer.bos_token_id, *(ids * (length // len(ids) + 1))][:length]
    tokens = torch.tensor([row] * batch, dtype=torch.long, device=model.cfg.device)
    return tokens, torch.ones_like(tokens, dtype=torch.bool)


def workload(model: Any, method: str, length: int, batch: int) -> Callable[[], Any]:
    from lens_attrib import Target, attribute
    from lens_attrib.forward import head_outputs

    tokens, mask = prompts(model, length, batch)
    if method == "forward":
        last = torch.full((batch,), length - 1, device=tokens.device)
        return lambda: head_outputs(model, tokens, mask, last, max_batch=batch)
    target = Target(token=[int(tokens[0, 1])] * batch)  # a fixed token: no prediction pass
    opts = SLOW_OPTIONS.get(method, {})
    return lambda: attribute(model, tokens, target, method=method, attention_mask=mask, **opts)


def measure(
    model: Any, method: str, length: int, batches: list[int], budget_mb: float, reps: int
) -> dict[str, Any]:
    device = str(model.cfg.device)
    workload(model, method, length, 1)()  # warm-up
    rows: list[dict[str, Any]] = []
    for b in batches:
        fn = workload(model, method, length, b)
        try:
            mb = peak_extra_mb(fn, device)
            seconds = statistics.median(timed(fn, device) for _ in range(reps))
        except (MemoryError, torch.OutOfMemoryError):
            rows.append({"batch": b, "oom": True})
            break
        rows.append({"batch": b, "seconds": seconds, "items_s": b / seconds, "peak_mb": mb})
        if mb > budget_mb:
            break
    return {"method": method, "length": length, "rows": rows, **fit(rows, budget_mb)}


def fit(rows: list[dict[str, Any]], budget_mb: float) -> dict[str, Any]:
    """Best batch and items/s within the budget; MB per item; the largest batch in the budget.

    MB per item: the least-squares slope of peak MB over batch (when noise makes it ≤ 0, the
    largest peak ÷ its batch, an upper bound). The largest batch is measured when the ladder
    crossed the budget, else extrapolated from the largest batch tried.
    """
    measured = [r for r in rows if not r.get("oom")]
    ok = [r for r in measured if r["peak_mb"] <= budget_mb]
    best = max(ok, key=lambda r: r["items_s"]) if ok else None
    slope = math.nan
    if len(measured) >= 2:
        xs = [float(r["batch"]) for r in measured]
        ys = [float(r["peak_mb"]) for r in measured]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope <= 0:
            slope = max(ys) / xs[ys.index(max(ys))]
    crossed = len(ok) < len(rows)
    largest: float = math.nan
    if crossed:
        largest = ok[-1]["batch"] if ok else 0
    elif ok and slope > 0:
        largest = ok[-1]["batch"] + math.floor((budget_mb - ok[-1]["peak_mb"]) / slope)
    return {
        "best_batch": best["batch"] if best else None,
        "items_s": best["items_s"] if best else math.nan,
        "mb_batch1": rows[0].get("peak_mb", math.nan) if rows else math.nan,
        "mb_per_item": slope,
        "largest_batch": largest,
        "largest_measured": crossed,
    }


# --------------------------------------------------------------------------- report
def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals per length (largest batches ÷ forward's; items/s ratios)."""
    out = []
    for length in sorted({r["length"] for r in results}):
        at = {r["method"]: r for r in results if r["length"] == length}
        fwd = at.get("forward")
        row: dict[str, Any] = {"length": length}
        if fwd:
            from lens_attrib.methods import METHODS

            for name, r in at.items():
                if name in METHODS and METHODS[name].uses_gradient:
                    row[f"largest_batch {name} ÷ forward (goal ≥ 0.4)"] = (
                        r["largest_batch"] / fwd["largest_batch"]
                    )
        if "attnlrp" in at and "grad_x_input" in at:
            row["items/s attnlrp ÷ grad_x_input (goal ≥ 0.8)"] = (
                at["attnlrp"]["items_s"] / at["grad_x_input"]["items_s"]
            )
        if "normxlogit" in at and fwd:
            row["items/s normxlogit ÷ forward (goal ≥ 0.9)"] = (
                at["normxlogit"]["items_s"] / fwd["items_s"]
            )
        out.append(row)
    return out


def table(results: list[dict[str, Any]], budget_mb: float) -> str:
    lines = [
        f"| T | method | best batch | items/s | MB at batch 1 | MB/item | largest batch ≤ "
        f"{budget_mb:.0f} MB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mark = "" if r["largest_measured"] else "~"
        lines.append(
            f"| {r['length']} | {r['method']} | {r['best_batch']} | {r['items_s']:.2f} | "
            f"{r['mb_batch1']:.0f} | {r['mb_per_item']:.0f} | {mark}{r['largest_batch']} |"
        )
    return "\n".join(lines)


def print_tables(results: list[dict[str, Any]], budget_mb: float) -> list[dict[str, Any]]:
    print(table(results, budget_mb))
    summary = ratios(results)
    for row in summary:
        shown = ", ".join(f"{k} = {v:.2f}" for k, v in row.items() if k != "length")
        print(f"T={row['length']}: {shown}")
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument(
        "--methods",
        type=method_list,
        default=None,
        help="comma-separated methods (default: every method that applies to decoders)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--budget-mb", type=float, default=8192, help="memory budget in MB")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per batch (median)")
    parser.add_argument("--quick", action="store_true", help="64 tokens, batches 1 2 4, 3 methods")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default="results/bench_throughput.json")
    parser.add_argument(
        "--report", default=None, help="re-print the tables of a saved JSON (no measuring)"
    )
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        results = [{**r, **fit(r["rows"], args.budget_mb)} for r in saved["results"]]
        print_tables(results, args.budget_mb)
        return {**saved, "results": results, "ratios": ratios(results)}
    if args.threads:
        torch.set_num_threads(args.threads)
    from lens_attrib import load_model
    from lens_attrib.methods import METHODS

    if args.quick:
        args.lengths, args.batches, args.reps = [64], [1, 2, 4], 1
        args.methods = args.methods or QUICK_METHODS
    methods = args.methods or sorted(n for n, s in METHODS.items() if s.decoder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m", device=device)
        results = []
        for length in args.lengths:
            for method in ["forward", *methods]:
                started = time.perf_counter()
                r = measure(model, method, length, args.batches, args.budget_mb, args.reps)
                results.append(r)
                print(
                    f"T={length} {method}: {r['items_s']:.2f} items/s at batch {r['best_batch']}, "
                    f"{r['mb_batch1']:.0f} MB at batch 1 ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    summary = print_tables(results, args.budget_mb)
    payload = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "budget_mb": args.budget_mb,
        "batches": args.batches,
        "options": SLOW_OPTIONS,
        "results": results,
        "ratios": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
    return payload


if __name__ == "__main__":
    main()
