"""π-Soft evaluation throughput vs plain batched forwards on SmolLM2-135M.

Throughput = perturbed forwards (sequences) per second. The π-Soft run evaluates
``2 + 2·|π|·n_draws`` sequences per item (clean, zero baseline, NC and NS for every π and draw) in
chunks of ``max_batch``; the baselines run the same number of unperturbed copies of the same
items with the same chunking:

- ``plain (logits)``: ``model(tokens, attention_mask)`` — full logits at every position;
- ``plain (target row)``: the residual stream + head at the target row only (the same forward the
  evaluation uses, without masks, sampling, routing or distances).

The ratio soft ÷ plain (goal ≥ 0.8) is reported against both. Writes results/bench_soft.json.

    python -m benchmarks.bench_soft [--items 2] [--max-batch 64] [--n-draws 15]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from lens_attrib import attribute, load_model
from lens_attrib.data import generate_sva
from lens_attrib.evaluation.soft import DEFAULT_PIS, soft_metrics
from lens_attrib.forward import head_outputs
from lens_attrib.hooks.guard import model_guard


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--n-draws", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="results/bench_soft.json")
    args = parser.parse_args()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m")
    items = generate_sva(args.items, seed=0, n_attractors=(1, 2))
    attr = attribute(model, [it.prompt for it in items], method="gradient")
    rows_per_item = 2 + 2 * len(DEFAULT_PIS) * args.n_draws
    n_rows = rows_per_item * len(items)
    idx = torch.arange(len(items)).repeat_interleave(rows_per_item)
    tokens, mask = attr.token_ids[idx], attr.mask[idx]
    positions = attr.target.positions[idx]

    def plain_logits() -> None:
        with model_guard(model), torch.inference_mode():
            for s in range(0, n_rows, args.max_batch):
                kw = (
                    {}
                    if bool(mask.all())
                    else {"attention_mask": mask[s : s + args.max_batch].long()}
                )
                model(tokens[s : s + args.max_batch], **kw)

    def plain_target_row() -> None:
        head_outputs(model, tokens, mask, positions, max_batch=args.max_batch)

    def soft(routing: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            soft_metrics(
                model,
                attr,
                raw=False,
                n_draws=args.n_draws,
                routing=routing,
                max_batch=args.max_batch,
            )

    plain_logits()  # warm-up
    timings = {
        "plain (logits)": _time(plain_logits, args.repeats),
        "plain (target row)": _time(plain_target_row, args.repeats),
        "pi-soft dynamic": _time(lambda: soft("dynamic"), args.repeats),
        "pi-soft fixed": _time(lambda: soft("fixed"), args.repeats),
    }
    throughput = {k: n_rows / v for k, v in timings.items()}
    rows = []
    for name in ("pi-soft dynamic", "pi-soft fixed"):
        rows.append(
            {
                "run": name,
                "forwards_per_s": throughput[name],
                "ratio_vs_plain_logits": throughput[name] / throughput["plain (logits)"],
                "ratio_vs_plain_target_row": throughput[name] / throughput["plain (target row)"],
            }
        )
    print(
        f"SmolLM2-135M, {len(items)} items × {rows_per_item} sequences "
        f"(len {tokens.shape[1]}), max_batch={args.max_batch}, "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'run':<22}{'seq/s':>10}{'÷ plain logits':>16}{'÷ plain target row':>20}")
    for name in ("plain (logits)", "plain (target row)"):
        print(f"{name:<22}{throughput[name]:>10.1f}{'':>16}{'':>20}")
    for r in rows:
        print(
            f"{r['run']:<22}{r['forwards_per_s']:>10.1f}{r['ratio_vs_plain_logits']:>16.3f}"
            f"{r['ratio_vs_plain_target_row']:>20.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": "smollm2-135m",
                "items": len(items),
                "rows_per_item": rows_per_item,
                "seq_len": int(tokens.shape[1]),
                "max_batch": args.max_batch,
                "threads": torch.get_num_threads(),
                "seconds": timings,
                "throughput": throughput,
                "ratios": rows,
                "goal": 0.8,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
