"""First-use training time of the built-in classifiers, measured on a sample and extrapolated.

For each classifier (default: ``minilm-l6-sst2`` and ``smollm2-135m-sst2``) the steps of
:func:`lens_attrib.load_classifier`'s first use run on the first ``--n`` training phrases:

- ``features``: :func:`lens_attrib.classifiers.residual_features`, the final residual of every
  item (the linear head's features; on the dev items, and on the training items when no
  fine-tuning follows);
- ``prefix``: :func:`~lens_attrib.classifiers.frozen_prefix.build_prefix`, the frozen lower
  blocks once per training item, and ``prefix features``: the training features from there
  (:func:`~lens_attrib.classifiers.frozen_prefix.prefix_features`);
- ``epoch``: one epoch of :func:`lens_attrib.classifiers.fine_tune` from that prefix.

Extrapolated first use = ``features × n_dev / n + (prefix + prefix features) × n_train / n +
epochs × epoch × n_train / n`` (the classifier's own ``n_train``, dev size and epochs); code
without the frozen prefix (before 2026-11-26) computes the training features with ``features``
and runs every epoch from the tokens, so there ``features × (n_train + n_dev) / n + epochs ×
epoch × n_train / n``. Left out: the linear head's L-BFGS fit (seconds) and the final dev scoring
(one ``features`` pass over the dev items). A sample of the first ``n`` phrases has the length
distribution of the whole set, so the extrapolation is linear in the number of items. CPU seconds
(``*_cpu_s``, all threads of the process) are reported beside wall seconds: on a shared machine
they depend less on the other jobs' load; compare runs taken on the same machine at the same
time. Writes ``results/bench_training.json``.

    python -m benchmarks.bench_training [--n 160] [--threads 1] [--names minilm-l6-sst2,...]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lens_attrib import load_model
from lens_attrib.classifiers import CLASSIFIERS, new_head, residual_features, task_data
from lens_attrib.classifiers.finetune import fine_tune
from lens_attrib.classifiers.frozen_prefix import build_prefix, prefix_features

DEFAULT_NAMES = "minilm-l6-sst2,smollm2-135m-sst2"


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds and its CPU seconds."""
    started, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - started, time.process_time() - cpu


def bench_one(name: str, n: int) -> dict[str, Any]:
    """Time every first-use step on the first ``n`` training items of classifier ``name``."""
    spec = CLASSIFIERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(spec.model)
    inputs, targets, dev_inputs, _, _ = task_data(model, spec)
    sample, sample_targets = inputs[:n], targets[:n]
    _, features, features_cpu = _timed(lambda: residual_features(model, sample))
    layer = int(model.cfg.n_layers) - spec.tuned_blocks
    prefix, prefix_s, prefix_cpu = _timed(lambda: build_prefix(model, sample, layer))
    _, prefix_feat_s, prefix_feat_cpu = _timed(lambda: prefix_features(model, prefix))
    head = new_head(model, 1 if spec.task == "stsb" else 2)
    _, epoch, epoch_cpu = _timed(
        lambda: fine_tune(
            model,
            head,
            sample,
            sample_targets,
            k=spec.tuned_blocks,
            regression=spec.task == "stsb",
            epochs=1,
            lr=spec.lr,
            seed=spec.seed,
            prefix=prefix,
        )
    )
    n_train, n_dev = len(inputs), len(dev_inputs)
    per_train = n_train / n
    total = features * n_dev / n + (prefix_s + prefix_feat_s) * per_train
    total += spec.epochs * epoch * per_train
    total_cpu = features_cpu * n_dev / n + (prefix_cpu + prefix_feat_cpu) * per_train
    total_cpu += spec.epochs * epoch_cpu * per_train
    return {
        "name": name,
        "n_sample": n,
        "n_train": n_train,
        "n_dev": n_dev,
        "epochs": spec.epochs,
        "tuned_blocks": spec.tuned_blocks,
        "features_s": round(features, 2),
        "features_cpu_s": round(features_cpu, 2),
        "prefix_s": round(prefix_s, 2),
        "prefix_cpu_s": round(prefix_cpu, 2),
        "prefix_features_s": round(prefix_feat_s, 2),
        "prefix_features_cpu_s": round(prefix_feat_cpu, 2),
        "epoch_s": round(epoch, 2),
        "epoch_cpu_s": round(epoch_cpu, 2),
        "epoch_full_min": round(epoch * per_train / 60, 2),
        "total_min": round(total / 60, 2),
        "total_cpu_min": round(total_cpu / 60, 2),
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
    print("seconds on the sample, wall (cpu); first use extrapolated to the full set, minutes")
    for r in rows:
        print(
            f"{r['name']:<18} features {r['features_s']:.1f} ({r['features_cpu_s']:.1f})  "
            f"prefix {r['prefix_s']:.1f} ({r['prefix_cpu_s']:.1f})  "
            f"prefix features {r['prefix_features_s']:.1f} ({r['prefix_features_cpu_s']:.1f})  "
            f"epoch {r['epoch_s']:.1f} ({r['epoch_cpu_s']:.1f})  "
            f"first use {r['total_min']:.1f} min ({r['total_cpu_min']:.1f} cpu-min)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
