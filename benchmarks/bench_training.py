"""First-use training time of the built-in classifiers, measured on a sample and extrapolated.

For each classifier (default: ``minilm-l6-sst2`` and ``smollm2-135m-sst2``) the two training
stages of :func:`lens_attrib.load_classifier` run on the first ``--n`` training phrases:

- ``features``: :func:`lens_attrib.classifiers.residual_features` (stage 1, the linear head's
  cached features; the built-in run computes them on the training *and* dev items);
- ``fine-tune``: :func:`lens_attrib.classifiers.fine_tune` for one epoch, split (when the code
  reports it, ``info["prefix_seconds"]``) into the one-time pass over the frozen lower blocks
  and the epoch itself.

Extrapolated first-use total = ``features × (n_train + n_dev) / n`` + ``prefix × n_train / n`` +
``epochs × epoch × n_train / n`` (the classifier's own ``n_train``, dev size and epochs). The linear
head's L-BFGS fit (seconds) and the final dev scoring (one forward per dev item) are left out. CPU
seconds (``*_cpu_s``, all threads of the process) are reported beside wall seconds: on a shared
machine they depend less on the other jobs' load. A sample of the first ``n`` phrases has the length
distribution of the whole set, so the extrapolation is linear in the number of items. Numbers depend
on the machine's load: compare runs taken on the same machine at the same time. Writes
``results/bench_training.json``.

    python -m benchmarks.bench_training [--n 160] [--names minilm-l6-sst2,smollm2-135m-sst2]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lens_attrib import load_model
from lens_attrib.classifiers import CLASSIFIERS, new_head, residual_features, task_data
from lens_attrib.classifiers.finetune import fine_tune

DEFAULT_NAMES = "minilm-l6-sst2,smollm2-135m-sst2"


def bench_one(name: str, n: int) -> dict[str, Any]:
    """Time both stages on the first ``n`` training items of classifier ``name``."""
    spec = CLASSIFIERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(spec.model)
    inputs, targets, dev_inputs, _, _ = task_data(model, spec)
    sample, sample_targets = inputs[:n], targets[:n]
    started, cpu = time.perf_counter(), time.process_time()
    residual_features(model, sample)
    features = time.perf_counter() - started
    features_cpu = time.process_time() - cpu
    head = new_head(model, 1 if spec.task == "stsb" else 2)
    started, cpu = time.perf_counter(), time.process_time()
    _, _, info = fine_tune(
        model,
        head,
        sample,
        sample_targets,
        k=spec.tuned_blocks,
        regression=spec.task == "stsb",
        epochs=1,
        lr=spec.lr,
        seed=spec.seed,
    )
    tune = time.perf_counter() - started
    tune_cpu = time.process_time() - cpu
    prefix = float(info.get("prefix_seconds", 0.0))
    epoch = tune - prefix
    n_train, n_dev = len(inputs), len(dev_inputs)
    total = (
        features * (n_train + n_dev) / n + prefix * n_train / n + spec.epochs * epoch * n_train / n
    )
    return {
        "name": name,
        "n_sample": n,
        "n_train": n_train,
        "n_dev": n_dev,
        "epochs": spec.epochs,
        "tuned_blocks": spec.tuned_blocks,
        "features_s": round(features, 2),
        "features_cpu_s": round(features_cpu, 2),
        "fine_tune_s": round(tune, 2),
        "fine_tune_cpu_s": round(tune_cpu, 2),
        "prefix_s": round(prefix, 2),
        "epoch_s": round(epoch, 2),
        "epoch_full_min": round(epoch * n_train / n / 60, 2),
        "total_min": round(total / 60, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=160, help="training items timed per classifier")
    parser.add_argument("--names", default=DEFAULT_NAMES)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", default="results/bench_training.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [bench_one(name, args.n) for name in args.names.split(",")]
    print(f"torch threads: {torch.get_num_threads()}; sample of {args.n} training items")
    print(
        f"{'classifier':<20} {'features s':>10} {'(cpu)':>7} {'tune s':>7} {'(cpu)':>7} "
        f"{'prefix s':>9} {'epoch s':>8} {'epoch (full) min':>16} {'first use min':>13}"
    )
    for r in rows:
        print(
            f"{r['name']:<20} {r['features_s']:>10.1f} {r['features_cpu_s']:>7.1f} "
            f"{r['fine_tune_s']:>7.1f} {r['fine_tune_cpu_s']:>7.1f} {r['prefix_s']:>9.1f} "
            f"{r['epoch_s']:>8.1f} {r['epoch_full_min']:>16.1f} {r['total_min']:>13.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
