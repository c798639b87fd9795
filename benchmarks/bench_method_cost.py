"""Attribution cost per method on a trained classifier's items, as a ratio to its forward (the
π-Soft paper's Table 6 analogue: seconds per sample of each explanation method).

    python -m benchmarks.bench_method_cost --model minilm-l6 [--n 40] [--grad-ellm-depth 1]
    python -m benchmarks.bench_method_cost --model smollm2-135m --n 20 --grad-ellm-depth 4

Items: the first ``--n`` SST-2 validation sentences (the faithfulness experiment's draw, seed 0,
at most 128 tokens), explained for the built-in ``<model>-sst2`` classifier's predicted class,
``--batch-size`` items per call (the faithfulness runs' unit), float32, one thread. Every method
is called with the options the tables use (:func:`experiments.method_settings.experiment_options`:
value zeroing's aggregation, IG's adaptive rule, Grad-ELLM at ``--grad-ellm-depth``, a variant's
own options), once untimed on the first batch (lazy set-up), then timed over every batch.

Printed per method: CPU seconds per item of ``attribute`` alone (no evaluation), and that ÷ the
CPU seconds per item of the classifier's forward over the same batches, measured in the same
run (:func:`experiments.faithfulness.classifier_outputs`, the head's output at its feature
position). A method's evaluation cost in a run is its journal's CPU seconds less this
(``python -m experiments.run_costs``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_METHODS = (
    "alti,attnlrp,lrp,gradient,grad_x_input,integrated_gradients,deeplift,rollout,attention,"
    "logat,normxlogit,embed_norm,grad_ellm,reagent[stopping_condition_top_k=1],value_zeroing,"
    "decompx,globenc,random,grad_x_input[pooling=l2],integrated_gradients[pooling=l2],"
    "deeplift[pooling=l2]"
)


def cpu_seconds(call: Callable[[], Any]) -> float:
    """CPU seconds of this process spent in ``call()``."""
    started = time.process_time()
    call()
    return time.process_time() - started


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm-l6", choices=["minilm-l6", "smollm2-135m"])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument(
        "--grad-ellm-depth", type=int, default=1, help="Grad-ELLM's n_layers (a run's choice)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from experiments.faithfulness import classifier_outputs, truncate
    from experiments.method_settings import experiment_options
    from lens_attrib import attribute
    from lens_attrib.backend import arch_of
    from lens_attrib.classifiers import load_classifier
    from lens_attrib.data import load_sst2
    from lens_attrib.method_variants import base_method
    from lens_attrib.methods import METHODS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = load_classifier(f"{args.model}-sst2")
    model, target = clf.model, clf.target()
    encoder = arch_of(model).encoder
    items = load_sst2("validation", n=args.n, seed=args.seed)
    texts = [truncate(model.tokenizer, it.prompt, args.max_tokens) for it in items]
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    settings = argparse.Namespace(vz_aggregation="auto", ig_max_steps=None)

    def forward_all() -> None:
        for batch in batches:
            classifier_outputs(model, clf, batch)

    forward_all()
    forward = cpu_seconds(forward_all) / len(texts)
    print(f"{args.model}-sst2, {len(texts)} items, batches of {args.batch_size}, one thread")
    print(f"{'forward':40s} {forward:8.4f} CPU-s/item")
    print(f"{'method':40s} {'CPU-s/item':>10s} {'÷ forward':>10s}")
    for method in args.methods.split(","):
        name = base_method(method)
        if not METHODS[name].applies_to(encoder=encoder):
            print(f"{method:40s} does not apply to this architecture")
            continue
        options = experiment_options(method, args.seed, model, settings, args.grad_ellm_depth)

        def explain(batch: list[str], options: dict[str, Any] = options, name: str = name) -> Any:
            return attribute(model, batch, target, method=name, **options)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explain(batches[0])
            seconds = cpu_seconds(lambda: [explain(b) for b in batches]) / len(texts)
        print(f"{method:40s} {seconds:10.4f} {seconds / forward:10.1f}", flush=True)


if __name__ == "__main__":
    main()
